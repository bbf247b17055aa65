"""What a pass returns (:class:`PassResult`) and what a run records of each pass (the report)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .program import graph_module_of

__all__ = ["PassRecord", "PassResult", "Report"]


@dataclass
class PassResult:
    """What a pass returns: the program (same form as its input) and whether it changed.

    ``modified`` is the pass's own claim (the manager measures the truth and reports a
    wrong claim); ``notes`` are remarks for the run report; ``statistics`` counts what the
    pass did, by a short description (``{"in-place ops rewritten: aten.add_": 3}``), per
    call (a pass is an immutable value: it returns its counts, never keeps them on self).
    """

    program: Any
    modified: bool | None = None
    notes: list[str] = field(default_factory=list)
    statistics: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return graph_module_of(self.program)


@dataclass
class PassRecord:
    """One pass run: timings in seconds, node counts, and what changed."""

    name: str
    index: int
    wall_time: float = 0.0
    check_time: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    modified: bool = False
    claimed_modified: bool | None = None
    checked: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What the pass counted (its PassResult.statistics), by description.
    statistics: dict[str, int | float] = field(default_factory=dict)
    # "Type: first line of the message" when the pass failed (and was rolled back).
    error: str = ""


def _count(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"


@dataclass
class Report:
    plan: str = ""
    # The run's ``strict`` option (a reproducer replays the pass the same way).
    strict: bool = False
    records: list[PassRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def total_time(self) -> float:
        return sum(r.wall_time for r in self.records)

    @property
    def check_time(self) -> float:
        return sum(r.check_time for r in self.records)

    def table(self) -> str:
        header = ("#", "pass", "time ms", "checks ms", "nodes", "modified")
        rows = [
            (
                str(r.index),
                r.name,
                f"{r.wall_time * 1e3:.2f}",
                f"{r.check_time * 1e3:.2f}",
                f"{r.nodes_before} -> {r.nodes_before if r.error else r.nodes_after}",
                "FAILED" if r.error else "yes" if r.modified else "no",
            )
            for r in self.records
        ]
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in rows]
        for r in self.records:
            lines += [f"  {r.name}: {note}" for note in r.notes]
            lines += [f"  {r.name} failed: {r.error}"] if r.error else []
        lines += self.statistics_lines()
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def statistics_lines(self) -> list[str]:
        """Per pass that counted anything: its counters, one per line (MLIR style)."""
        lines = []
        for r in self.records:
            if not r.statistics:
                continue
            if not lines:
                lines.append("statistics:")
            lines.append(f"  #{r.index} {r.name}")
            width = max(len(_count(v)) for v in r.statistics.values())
            lines += [f"    {_count(v):>{width}}  {key}" for key, v in r.statistics.items()]
        return lines

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {**asdict(self), "total_time": self.total_time, "check_time": self.check_time}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)
