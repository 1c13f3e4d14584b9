"""verify's report: one row per check (how many items passed and failed, the first failures named), and the
report of a cache (complete, its rows, what `--repair` deleted), as the CLI prints it and `--json` writes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MAX_EXAMPLES = 5


@dataclass
class Check:
    """One row of the report: how many items passed and failed, and the first failures named."""

    name: str
    passed: int = 0
    failed: int = 0
    problems: list[str] = field(default_factory=list)
    note: str = ""
    skipped: bool = False

    def ok(self, count: int = 1) -> None:
        self.passed += count

    def fail(self, problem: str) -> None:
        self.failed += 1
        if len(self.problems) < MAX_EXAMPLES:
            self.problems.append(problem)


@dataclass
class VerifyReport:
    out: str
    complete: bool
    checks: list[Check]
    summary: dict[str, Any] = field(default_factory=dict)
    repaired: list[str] = field(default_factory=list)
    """What `verify --repair` deleted before checking (stray shard files or objects)."""

    @property
    def ok(self) -> bool:
        return self.complete and all(check.failed == 0 for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"out": self.out, "ok": self.ok, "complete": self.complete, "summary": self.summary,
                "repaired": self.repaired, "checks": [asdict(check) for check in self.checks]}


__all__ = ["MAX_EXAMPLES", "Check", "VerifyReport"]
