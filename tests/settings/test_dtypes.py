"""The one dtype-name table: CLI names, recorded names, torch dtypes, and no torch import to read it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vaecache.errors import UsageError
from vaecache.settings.dtypes import DTYPE_CHOICES, RECORDED_NAMES, check_dtype_name, recorded_name, torch_dtype


def test_names_map_both_ways() -> None:
    assert DTYPE_CHOICES == ("fp32", "bf16", "fp16")
    assert [torch_dtype(name) for name in DTYPE_CHOICES] == [torch.float32, torch.bfloat16, torch.float16]
    assert [recorded_name(torch_dtype(name)) for name in DTYPE_CHOICES] == list(RECORDED_NAMES.values())
    assert RECORDED_NAMES == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def test_unknown_names_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="--dtype must be one of fp32, bf16, fp16, got 'fp64'"):
        check_dtype_name("fp64")
    with pytest.raises(UsageError, match="--dtype must be one of"):
        torch_dtype("float32")
    with pytest.raises(UsageError, match="dtype torch.float64 is not one of float32, bfloat16, float16"):
        recorded_name(torch.float64)


def test_reading_the_table_does_not_import_torch() -> None:
    code = "import sys, vaecache.settings.dtypes as d; d.check_dtype_name('bf16'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
