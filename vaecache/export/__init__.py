"""Exports of a finished cache to the layouts trainers read, one module per trainer format, each in that
trainer's own convention: musubi-tuner's latent cache (`musubi`) and WebDataset tars for webdataset and
Megatron-Energon (`webdataset`), and LTX-2's trainer's precomputed folder (`ltx2`)."""

from __future__ import annotations

from vaecache.errors import ExportError
from vaecache.export.common import ExportSummary, safe_name, safetensors_bytes
from vaecache.export.ltx2 import export_ltx2
from vaecache.export.musubi import MUSUBI_ARCHITECTURES, export_musubi, musubi_arch, musubi_tensors
from vaecache.export.webdataset import ENERGON_MODES, batched_by_shape, decode_sample, export_webdataset, webdataset_key

EXPORT_FORMATS = ("musubi", "webdataset", "ltx2")

__all__ = ["ENERGON_MODES", "EXPORT_FORMATS", "ExportError", "ExportSummary", "MUSUBI_ARCHITECTURES",
           "batched_by_shape", "decode_sample", "export_ltx2", "export_musubi", "export_webdataset", "musubi_arch",
           "musubi_tensors", "safe_name", "safetensors_bytes", "webdataset_key"]
