"""CLIP's slow tokenization (vaecache/text/clip_slow.py) against transformers 4.57's own slow CLIPTokenizer, which
musubi-tuner pins: the class is not in transformers 5, so the test installs 4.57.1 from the package index into a folder
of its own and runs it in a child process beside ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.text.tiny_text import train_clip_tokenizer
from vaecache.text.clip_slow import SlowClipTokenizer, tokenized_alike

HOSTILE = ["“SALE” sign in the shop window", "the &amp; robot &lt;arm&gt;", "full-width ＡＢＣ text",
           "don’t stop, it's the robot's arm", "Ã©tÃ© mojibake", "  spaces\tand\nnewlines  ", "<|endoftext|> inside",
           "", "ümlaut café naïve 東京", "emoji 🚗 car", "a red car drives down a wet street at night " * 12]
"""Captions ftfy changes (curly quotes, entities, full-width, mojibake), and ones it leaves: every one must tokenize as
the slow class does; the last is longer than 77 tokens."""
SLOW_CLIP = """
import json, sys
from transformers.models.clip.tokenization_clip import CLIPTokenizer
folder, captions = sys.argv[1], json.load(open(sys.argv[2], encoding="utf-8"))
tokenizer = CLIPTokenizer(vocab_file=folder + "/vocab.json", merges_file=folder + "/merges.txt")
print(json.dumps({"version": __import__("transformers").__version__,
                  "padded": [tokenizer(c, max_length=77, truncation=True, padding="max_length")["input_ids"]
                             for c in captions],
                  "whole": [tokenizer(c)["input_ids"] for c in captions]}))
"""


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("clip") / "tokenizer"
    train_clip_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def slow(clip_folder: Path) -> SlowClipTokenizer:
    from transformers import AutoTokenizer

    return SlowClipTokenizer.like(AutoTokenizer.from_pretrained(clip_folder))


def test_prompts_ftfy_leaves_alone_tokenize_as_the_tokenizers_backed_class(clip_folder, slow) -> None:
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(clip_folder)
    for caption in HOSTILE:
        ours = slow([caption], max_length=77, truncation=True, padding="max_length")
        theirs = fast([caption], max_length=77, truncation=True, padding="max_length")
        assert (ours == {"input_ids": theirs["input_ids"], "attention_mask": theirs["attention_mask"]}) == \
            tokenized_alike(caption), caption
    assert [tokenized_alike(c) for c in HOSTILE[:5]] == [False] * 5
    ids = slow(["“SALE”"], max_length=77, truncation=True, padding="max_length", return_tensors="pt")
    assert ids["input_ids"].shape == (1, 77) and int(ids["attention_mask"].sum()) == 2 + len(slow.ids('"sale"'))
    assert slow.ids("“SALE”") == slow.ids('"sale"')  # ftfy straightened the quotes, the class lower-cased


def test_musubis_pinned_transformers_tokenizes_every_caption_as_ours(clip_folder, slow, tmp_path_factory) -> None:
    """transformers 4.57.1's slow CLIPTokenizer, installed into a folder (with the tokenizers and huggingface-hub its
    import checks), run in a child process on the same vocabulary and merges: the same ids for every caption, padded
    to 77 with truncation and whole."""
    target = tmp_path_factory.mktemp("transformers457")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                                str(target), "transformers==4.57.1", "tokenizers==0.22.1", "huggingface-hub==0.36.0"],
                               capture_output=True, text=True, timeout=600)
    if installed.returncode != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"cannot install transformers 4.57.1 from the package index: {installed.stderr[-400:]}")
        pytest.skip("transformers 4.57.1 cannot be installed here (no package index): the slow class is not run")
    captions = tmp_path_factory.mktemp("captions") / "captions.json"
    captions.write_text(json.dumps(HOSTILE), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(target), "TRANSFORMERS_VERBOSITY": "error"}
    child = subprocess.run([sys.executable, "-c", SLOW_CLIP, str(clip_folder), str(captions)], capture_output=True,
                           text=True, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    theirs = json.loads(child.stdout.strip().splitlines()[-1])
    assert theirs["version"] == "4.57.1"
    assert slow(HOSTILE, max_length=77, truncation=True, padding="max_length")["input_ids"] == theirs["padded"]
    assert slow(HOSTILE)["input_ids"] == theirs["whole"]
