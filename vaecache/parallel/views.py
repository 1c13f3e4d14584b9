"""Sequence-parallel VAE encode: split the views of one sample across an SP group, gather the latents.

A sample holds N views (cameras x clips, flattened into dim 0). The G ranks of an SP group all
hold the same N views; each encodes about N / G of them and an ``all_gather`` inside the group
gives every rank all N latents. The plan is a pure function of (N, G):

* ``padded`` = the smallest multiple of G that is >= N, ``per_rank`` = padded // G;
* when ``per_rank >= N`` (N == 1 or G == 1) every rank encodes all N itself, with no communication;
* otherwise the views are padded by repeating the real ones (view i of the padded batch is real
  view ``i % N``, never zeros), sp rank r encodes padded views ``[r * per_rank, (r + 1) * per_rank)``,
  and the gathered result is trimmed back to N.

``plan_sp(N, G, unit=K)`` does the same in whole units of K consecutive views (the views one VAE forward
encodes together; the encode pipeline's ``--views-per-forward``): N and the padding are whole units, so a
unit is never split across ranks and its latents do not depend on G. ``sp_encode`` splits single views.

Collectives run only on the group passed in, never on the world group, and the encode never
touches the caller's random number generators.

### Using sp_encode in training code

``sp_encode(x, encode_fn, group)`` is a drop-in replacement for ``encode_fn(x)`` when several
ranks hold the same batch: every rank passes the full batch and gets the full result back,
equal (``torch.equal``) to what ``encode_fn(x)`` returns on one process, given an ``encode_fn``
whose output for a row does not depend on the other rows (a VAE encoder in eval mode).

.. code-block:: python

    import torch
    import torch.distributed as dist
    from vaecache.parallel import sp_encode

    # Contiguous blocks of sp_size ranks share a sample; create every group on every rank.
    sp_size = 2
    sp_group = None
    for start in range(0, dist.get_world_size(), sp_size):
        group = dist.new_group(list(range(start, start + sp_size)))
        if start <= dist.get_rank() < start + sp_size:
            sp_group = group

    def encode(views: torch.Tensor) -> torch.Tensor:
        # Deterministic per view: use the posterior mean (or mode); do not sample in here.
        # One view per forward: conv kernels may pick another algorithm for another batch size,
        # so this is what makes the result bitwise independent of how views are split.
        return torch.cat([vae.encode(v).latent_dist.mode() for v in views.split(1)])

    with torch.no_grad():
        # x: (B * num_cameras, C, T, H, W), identical on every rank of the SP group.
        latents = sp_encode(x, encode, sp_group)   # (B * num_cameras, C', T', H', W') everywhere

Notes:

* Every rank of the group must call ``sp_encode`` with the same shapes and dtype, in the same
  order as its other collectives on that group. A mismatch raises ``DistributedError`` on all
  ranks; a peer that died or hangs raises ``DistributedError`` after the group's timeout.
* Gradients do not flow through the gather; encode a frozen VAE under ``torch.no_grad()``.
* The RNG state (CPU and current CUDA device) is the same after the call as before, for every
  group size, so the rest of the training step sees the same random stream with or without SP.
  Sample noise for the latents outside, after the call, if you need it.
* ``group=None`` (or a group of one) simply calls ``encode_fn(x)``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor
from torch.distributed import ProcessGroup

from vaecache.distributed.context import collective_errors
from vaecache.errors import DistributedError, UsageError

__all__ = ["SPPlan", "gather_views", "pad_views", "plan_sp", "sp_encode"]

# dtypes every backend moves natively; anything else (int16, uint16, float8, ...) is sent as bytes.
# gloo rejects int16/uint16/float8 with "Invalid scalar type"; an all_gather only copies, so
# reinterpreting the bytes is exact.
_NATIVE_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64}
)
_META_DIMS = 8  # shape dims sent verbatim in the consistency check (a crc covers the rest)


@dataclass(frozen=True)
class SPPlan:
    """How ``num_views`` views are split over an SP group of ``group_size`` ranks, in whole units of ``unit``
    consecutive views (the views one VAE forward encodes together: a unit is never split, so its latents do
    not depend on the group size)."""

    num_views: int
    group_size: int
    unit: int = 1

    def __post_init__(self) -> None:
        for name in ("num_views", "group_size", "unit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"SPPlan.{name} must be an integer >= 1, got {value!r}")
        if self.num_views % self.unit:
            raise UsageError(f"SPPlan: {self.num_views} views are not whole units of {self.unit}")

    @property
    def num_units(self) -> int:
        return self.num_views // self.unit

    @property
    def padded(self) -> int:
        """Views after padding: the smallest multiple of group_size units that is >= num_units, in views."""
        return -(-self.num_units // self.group_size) * self.group_size * self.unit

    @property
    def per_rank(self) -> int:
        """Views each rank encodes when the work is split (whole units)."""
        return self.padded // self.group_size

    @property
    def is_local(self) -> bool:
        """True when splitting saves nothing (one unit, or G == 1): every rank encodes all N."""
        return self.per_rank >= self.num_views

    def view_indices(self, sp_rank: int) -> list[int]:
        """Indices into the real views (0..N-1) that ``sp_rank`` encodes, in order; all N when local. Padding
        repeats real units (unit i of the padded batch is real unit i % units)."""
        if not 0 <= sp_rank < self.group_size:
            raise UsageError(f"sp rank {sp_rank} is outside an SP group of {self.group_size}")
        if self.is_local:
            return list(range(self.num_views))
        units = self.per_rank // self.unit
        first = sp_rank * units
        return [(u % self.num_units) * self.unit + v for u in range(first, first + units) for v in range(self.unit)]


def plan_sp(num_views: int, group_size: int, unit: int = 1) -> SPPlan:
    """Pure: the split of ``num_views`` views over ``group_size`` ranks, in units of ``unit`` views."""
    return SPPlan(num_views=num_views, group_size=group_size, unit=unit)


def pad_views(x: Tensor, plan: SPPlan) -> Tensor:
    """Repeat the real views along dim 0 up to ``plan.padded`` rows (row i is view i % N: whole units repeat)."""
    _check_batch(x, plan.num_views, "pad_views input")
    if plan.padded == plan.num_views:
        return x
    copies = -(-plan.padded // plan.num_views)
    return torch.cat([x] * copies)[: plan.padded]


def _take_views(x: Tensor, indices: list[int]) -> Tensor:
    """``x[indices]``, as a view without a copy when the indices are one ascending run."""
    start = indices[0]
    if indices == list(range(start, start + len(indices))):
        return x[start : start + len(indices)]
    return x.index_select(0, torch.tensor(indices, dtype=torch.long, device=x.device))


def _check_batch(t: Any, rows: int, what: str) -> None:
    if not isinstance(t, Tensor):
        raise UsageError(f"{what} must be a torch.Tensor with one row per view, got {type(t).__name__}")
    if t.dim() == 0 or t.shape[0] != rows:
        shape = tuple(t.shape)
        raise DistributedError(f"{what} has shape {shape}; expected {rows} rows in dim 0")


@contextmanager
def _isolated_rng(x: Tensor) -> Iterator[None]:
    """Run the block on a copy of the RNG state (CPU, the current CUDA device and x's device)."""
    devices: set[int] = set()
    if x.is_cuda:
        devices.add(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.add(torch.cuda.current_device())
    with torch.random.fork_rng(devices=sorted(devices)):
        yield


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _meta(local: Tensor, plan: SPPlan) -> list[int]:
    shape = list(local.shape)
    dims = shape[:_META_DIMS] + [-1] * (_META_DIMS - min(len(shape), _META_DIMS))
    return [
        plan.num_views,
        plan.group_size,
        plan.unit,
        local.dim(),
        _dtype_code(local.dtype),
        zlib.crc32(repr(shape).encode()),
        *dims,
    ]


def _describe_meta(row: list[int]) -> str:
    ndim = row[3]
    dims = row[6 : 6 + min(ndim, _META_DIMS)]
    shape = "(" + ", ".join(str(d) for d in dims) + (", ..." if ndim > _META_DIMS else "") + ")"
    names = {_dtype_code(d): str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return f"{shape} {names.get(row[4], 'dtype?')} for N={row[0]}, G={row[1]}, unit={row[2]}"


def _group_ranks(group: ProcessGroup | None) -> list[int]:
    try:
        return tdist.get_process_group_ranks(group)
    except Exception:
        return []


def _all_gather_flat(out: Tensor, local: Tensor, group: ProcessGroup) -> None:
    """Gather equal-sized ``local`` from every rank of ``group`` into ``out`` (concatenated on dim 0)."""
    single = getattr(tdist, "all_gather_single", None) or getattr(tdist, "all_gather_into_tensor", None)
    if single is not None:
        single(out, local, group=group)
        return
    parts = list(out.chunk(tdist.get_world_size(group)))
    tdist.all_gather(parts, local, group=group)


def _check_consistent(local: Tensor, plan: SPPlan, group: ProcessGroup, sp_rank: int) -> None:
    """Exchange (N, G, shape, dtype) so a mismatch raises on every rank instead of hanging one."""
    mine = _meta(local, plan)
    width = len(mine)
    gathered = torch.empty(plan.group_size * width, dtype=torch.int64, device=local.device)
    with collective_errors("all_gather(shape check)", group):
        _all_gather_flat(gathered, torch.tensor(mine, dtype=torch.int64, device=local.device), group)
    rows = gathered.view(plan.group_size, width).tolist()
    bad_rows = [r for r, row in enumerate(rows) if row[6] != plan.per_rank or row[3] < 1]
    if all(row == mine for row in rows) and not bad_rows:
        return
    ranks = _group_ranks(group)
    me = ranks[sp_rank] if ranks else sp_rank
    detail = "; ".join(f"sp rank {r}: {_describe_meta(row)}" for r, row in enumerate(rows))
    raise DistributedError(
        f"rank {me}: gather_views in SP group {ranks}: ranks disagree ({detail}); every rank must "
        f"pass the same N and per-rank encoded views of one shape and dtype ({plan.per_rank} rows here)"
    )


def gather_views(local: Tensor, plan: SPPlan, group: ProcessGroup | None) -> Tensor:
    """All N encoded views on every rank, from this rank's encode of ``plan.view_indices(sp_rank)``.

    The precompute path: each rank builds and encodes only its own views, then calls this. When
    ``plan.is_local`` ``local`` already holds all N and is returned unchanged (no communication).
    """
    if plan.is_local:
        _check_batch(local, plan.num_views, "the local encode")
        return local
    if group is None:
        raise UsageError(
            f"gather_views needs the SP process group for a split over {plan.group_size} ranks (got None)"
        )
    if not isinstance(local, Tensor):
        raise UsageError(f"the local encode must be a torch.Tensor, got {type(local).__name__}")
    size = tdist.get_world_size(group)
    sp_rank = tdist.get_rank(group)
    if sp_rank < 0:
        raise DistributedError(f"rank {tdist.get_rank()} is not a member of SP group {_group_ranks(group)}")
    if size != plan.group_size:
        raise DistributedError(
            f"plan is for an SP group of {plan.group_size} ranks but SP group {_group_ranks(group)} has {size}"
        )
    if local.dim() == 0:
        raise DistributedError("the local encode is a 0-d tensor; expected one row per view")
    _check_consistent(local, plan, group, sp_rank)

    local = local.contiguous()
    rest = tuple(local.shape[1:])
    if local.dtype in _NATIVE_DTYPES:
        out = torch.empty((plan.padded, *rest), dtype=local.dtype, device=local.device)
        with collective_errors("all_gather", group):
            _all_gather_flat(out, local, group)
    else:
        flat = local.view(-1).view(torch.uint8)
        raw = torch.empty(plan.group_size * flat.numel(), dtype=torch.uint8, device=local.device)
        with collective_errors("all_gather", group):
            _all_gather_flat(raw, flat, group)
        out = raw.view(local.dtype).view(plan.padded, *rest)
    return out[: plan.num_views]


def sp_encode(
    x: Tensor, encode_fn: Callable[[Tensor], Tensor], group: ProcessGroup | None = None
) -> Tensor:
    """``encode_fn(x)`` computed by the ranks of ``group`` together; the full result on every rank.

    ``x`` is the full batch of N views (dim 0), identical on every rank of the group. ``encode_fn``
    must map k views to k encoded rows independently of each other. ``group`` None or of size 1
    just calls ``encode_fn(x)``. The caller's RNG state is unchanged afterwards. See the module
    docstring for a training-loop example.
    """
    if not isinstance(x, Tensor) or x.dim() == 0:
        raise UsageError(f"sp_encode needs a tensor with views in dim 0, got {getattr(x, 'shape', type(x))}")
    num_views = x.shape[0]
    if num_views == 0:
        raise UsageError("sp_encode got an empty batch (0 views)")
    group_size = 1 if group is None else tdist.get_world_size(group)
    plan = plan_sp(num_views, max(group_size, 1))
    if plan.is_local:
        with _isolated_rng(x):
            out = encode_fn(x)
        _check_batch(out, num_views, "encode_fn output")
        return out
    sp_rank = tdist.get_rank(group)
    if sp_rank < 0:
        raise DistributedError(f"rank {tdist.get_rank()} is not a member of SP group {_group_ranks(group)}")
    local_x = _take_views(x, plan.view_indices(sp_rank))
    with _isolated_rng(x):
        local = encode_fn(local_x)
    return gather_views(local, plan, group)
