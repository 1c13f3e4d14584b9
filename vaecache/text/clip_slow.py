"""CLIP's tokenization as musubi-tuner's pinned transformers (4.57) computes it: the slow `CLIPTokenizer`, whatever
transformers is installed.

musubi-tuner (commit 30c658c, transformers 4.57 in its requirements) loads HunyuanVideo's, FramePack's and Kandinsky 5's
CLIP-L tokenizer as `CLIPTokenizer`, which in 4.57 is the Python ("slow") class of `models/clip/tokenization_clip.py`:
it cleans a prompt with `ftfy.fix_text`, collapses whitespace and lower-cases it, splits it with CLIP's pattern, maps
each piece's UTF-8 bytes to unicode characters and applies the BPE merges (the first 48,894 of merges.txt, each word
ending in `</w>`). transformers 5 has no slow class; its `CLIPTokenizer` is the tokenizers-backed one, whose
normalizer is NFC, whitespace and lower case without ftfy, so a prompt that ftfy changes (curly quotes, HTML entities,
full-width characters, mojibake) gets other ids: another pooled output. This module does what the slow class does,
from the vocabulary and merges the tokenizer folder holds (tests compare it with transformers 4.57's class itself)."""

from __future__ import annotations

import functools
import json
from typing import Any

PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
"""CLIPTokenizer.pat (case-insensitive), the pieces a cleaned prompt is split into."""
MERGES_USED = 49152 - 256 - 2
"""The slow class reads `merges.txt`'s lines 1 to 48,894 (after the version line): CLIP's vocabulary size less the
byte alphabet and the two special tokens."""
SPECIAL = ("<|startoftext|>", "<|endoftext|>")
"""Pieces the slow class's BPE cache maps to themselves."""
NAME = "slow-clip"
REFERENCE = ("transformers 4.57 models/clip/tokenization_clip.py CLIPTokenizer (the slow class musubi-tuner 30c658c "
             "loads): ftfy.fix_text, whitespace_clean, lower case, CLIP's pattern, byte-level BPE")


@functools.lru_cache(maxsize=1)
def byte_characters() -> dict[int, str]:
    """CLIP's reversible map from the 256 byte values to printable unicode characters (`bytes_to_unicode`)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapped = dict(zip(kept, map(chr, kept)))
    extra = 0
    for value in range(256):
        if value not in mapped:
            mapped[value] = chr(256 + extra)
            extra += 1
    return mapped


def clean(text: str) -> str:
    """The slow class's cleaning: ftfy's fix_text, runs of whitespace to one space, stripped, lower case."""
    import ftfy
    import regex

    return regex.sub(r"\s+", " ", ftfy.fix_text(text)).strip().lower()


def tokenized_alike(text: str) -> bool:
    """Whether the slow class and the tokenizers-backed one give this prompt the same ids: the latter's normalizer
    (NFC, runs of whitespace to one space, lower case) leaves what the slow cleaning does, ftfy aside, and whitespace
    at the ends makes no piece of either."""
    import unicodedata

    import regex

    return clean(text) == regex.sub(r"\s+", " ", unicodedata.normalize("NFC", text)).strip().lower()


class SlowClipTokenizer:
    """CLIP's slow tokenization over a vocabulary and merges, with the special ids of the tokenizer it stands in for.

    `__call__(texts, max_length=, truncation=, padding="max_length")` answers with the input ids and attention mask
    the 4.57 class's `__call__` gives: `<|startoftext|>` ids `<|endoftext|>`, the ids cut to `max_length - 2` when
    truncating, padded on the right with the pad id."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], *, bos_id: int, eos_id: int,
                 pad_id: int, unk_id: int, added: dict[str, int] | None = None) -> None:
        self.vocab = vocab
        self.ranks = {pair: rank for rank, pair in enumerate(merges[:MERGES_USED])}
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.added = dict(added or {})
        """Added tokens (the special ones among them): the slow class's base splits a text on them first and maps
        each to its id, tokenizing only what lies between."""
        self._words: dict[str, list[str]] = {token: [token] for token in SPECIAL}

    @classmethod
    def like(cls, tokenizer: Any) -> SlowClipTokenizer:
        """The slow tokenization of a loaded (tokenizers-backed) CLIP tokenizer: its BPE vocabulary and merges, and its
        special tokens' ids."""
        model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
        if model.get("type") != "BPE" or model.get("end_of_word_suffix") != "</w>":
            raise ValueError("not CLIP's byte-level BPE (end_of_word_suffix </w>)")
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
        unk = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else tokenizer.eos_token_id
        return cls(dict(model["vocab"]), merges, bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id,
                   pad_id=tokenizer.pad_token_id, unk_id=unk, added=dict(tokenizer.get_added_vocab()))

    def ids(self, text: str) -> list[int]:
        """The prompt's ids, without the special tokens around them."""
        import regex

        found: list[int] = []
        bytes_to_chars = byte_characters()
        for chunk, added in self._chunks(text):
            if added is not None:
                found.append(added)
                continue
            for piece in regex.findall(PATTERN, clean(chunk), regex.IGNORECASE):
                word = "".join(bytes_to_chars[b] for b in piece.encode("utf-8"))
                found.extend(self.vocab.get(token, self.unk_id) for token in self._bpe(word))
        return found

    def _chunks(self, text: str) -> list[tuple[str, int | None]]:
        """The text split on added tokens, the longest first where two start at one place (the base class's trie):
        (text, None) pieces to tokenize and (token, id) for each added token."""
        chunks: list[tuple[str, int | None]] = []
        start = position = 0
        names = sorted(self.added, key=len, reverse=True)
        while position < len(text):
            token = next((name for name in names if name and text.startswith(name, position)), None)
            if token is None:
                position += 1
                continue
            if position > start:
                chunks.append((text[start:position], None))
            chunks.append((token, self.added[token]))
            position = start = position + len(token)
        if start < len(text):
            chunks.append((text[start:], None))
        return chunks

    def _bpe(self, word: str) -> list[str]:
        if word in self._words:
            return self._words[word]
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pairs = set(zip(parts, parts[1:]))
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self._words[word] = parts
        return parts

    def __call__(self, texts: list[str], *, max_length: int | None = None, truncation: bool = False,
                 padding: str | None = None, return_tensors: str | None = None) -> dict[str, Any]:
        rows = []
        for text in texts:
            ids = self.ids(text)
            if truncation and max_length is not None:
                ids = ids[:max(0, max_length - 2)]
            rows.append([self.bos_id, *ids, self.eos_id])
        masks = [[1] * len(row) for row in rows]
        if padding == "max_length" and max_length is not None:
            masks = [mask + [0] * (max_length - len(row)) for row, mask in zip(rows, masks)]
            rows = [row + [self.pad_id] * (max_length - len(row)) for row in rows]
        if return_tensors == "pt":
            import torch

            return {"input_ids": torch.tensor(rows, dtype=torch.long),
                    "attention_mask": torch.tensor(masks, dtype=torch.long)}
        return {"input_ids": rows, "attention_mask": masks}


__all__ = ["NAME", "REFERENCE", "SlowClipTokenizer", "clean", "tokenized_alike"]
