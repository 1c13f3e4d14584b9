"""The DP x SP layout of a world of ranks. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from vaecache.errors import UsageError

# ---------------------------------------------------------------------------------------------
# Mesh (pure)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """World = DP x SP. SP groups are contiguous blocks of sp_size ranks.

    With world 8 and sp_size 2 the SP groups are [0, 1], [2, 3], [4, 5], [6, 7]; each is one
    data-parallel replica (dp_rank 0..3) and its sp_rank 0 member writes the results.
    """

    rank: int
    world_size: int
    sp_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"world size must be >= 1, got {self.world_size}")
        if self.sp_size < 1:
            raise UsageError(f"--sp-size must be >= 1, got {self.sp_size}")
        if self.world_size % self.sp_size != 0:
            choices = ", ".join(str(d) for d in range(1, self.world_size + 1) if self.world_size % d == 0)
            raise UsageError(
                f"--sp-size {self.sp_size} must divide the world size {self.world_size} "
                f"({self.world_size} processes cannot form groups of {self.sp_size}); "
                f"choose one of: {choices}"
            )
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is outside world size {self.world_size}")

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (SP groups)."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        """Which SP group (data shard) this rank belongs to."""
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        """Position of this rank inside its SP group."""
        return self.rank % self.sp_size

    @property
    def is_writer(self) -> bool:
        """One rank per SP group writes output: the group's sp_rank 0."""
        return self.sp_rank == 0

    def sp_group_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of SP group ``dp_rank`` (default: this rank's group)."""
        dp = self.dp_rank if dp_rank is None else dp_rank
        if not 0 <= dp < self.dp_size:
            raise UsageError(f"dp rank {dp} is outside 0..{self.dp_size - 1}")
        return list(range(dp * self.sp_size, (dp + 1) * self.sp_size))


def make_mesh(rank: int, world_size: int, sp_size: int) -> Mesh:
    """Pure: the DP x SP layout for ``rank``; raises UsageError when sp_size does not divide world."""
    return Mesh(rank=rank, world_size=world_size, sp_size=sp_size)
