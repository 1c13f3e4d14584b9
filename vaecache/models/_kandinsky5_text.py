"""Kandinsky 5's embedding of one prompt by itself (vaecache.text runs it through `TextFamily.one_prompt`): its
Qwen2.5-VL sees no attention mask, so a batch's padding would change a prompt's rows."""

from __future__ import annotations

from typing import Any


def encode_one_prompt(encoder: Any, prompt: str) -> tuple[Any, int, bool]:
    """One prompt by itself, as Kandinsky5T2VPipeline._encode_prompt_qwen runs a batch of one: the template
    filled, its text cut where its tokens pass crop + length (the tokens past length - 2 of the prompt's,
    decoded, removed from the text's end), tokenized to at most crop + length, run without an attention mask,
    hidden_states[layer] from crop on (every row the prompt's: nothing is padded). `encoder` is a
    vaecache.text.encoder.TextEncoder; returns (its rows in the compute dtype, their count, whether the prompt was
    cut)."""
    family, tokenizer = encoder.family, encoder.tokenizer
    crop, allowed = family.crop_start, family.crop_start + family.length
    text = family.template.format(prompt)
    ids = tokenizer([text], return_tensors="pt", padding="longest")["input_ids"]
    truncated = ids.shape[-1] > allowed
    if truncated:
        removed = tokenizer.decode(ids[0][crop:-2][family.length - 2:])
        if len(removed) > 0:
            text = text[:-len(removed)]
    inputs = tokenizer([text], max_length=allowed, truncation=True, return_tensors="pt", padding=True)
    hidden = encoder.model(input_ids=inputs.input_ids.to(encoder.device), output_hidden_states=True).hidden_states
    rows = hidden[encoder.layer][0, crop:].to(encoder.compute_dtype)
    count = int(inputs.attention_mask[0, crop:].sum())
    return rows[:count], count, truncated
