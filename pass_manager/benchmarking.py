"""Measure pass cost: repeat runs on fresh copies and keep min / median / max.

Example (three lines to benchmark your own pass):
    >>> from pass_manager.benchmarking import benchmark_passes
    >>> result = benchmark_passes([MyPass()], torch.export.export(model, inputs), repeat=5)
    >>> print(result.table())
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .manager import PassManager
from .program import node_count
from .program_sets import MethodsRunResult
from .validation import copy_program

__all__ = ["BenchmarkResult", "Timings", "benchmark_passes", "time_call"]


@dataclass
class Timings:
    """Repeated wall-time samples of one measured thing, in seconds."""

    name: str
    samples: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def row(self) -> str:
        return (
            f"{self.name:<36} {self.min * 1e3:>10.2f} {self.median * 1e3:>10.2f} "
            f"{self.max * 1e3:>10.2f}"
        )


def time_call(
    name: str,
    fn: Callable[[Any], Any],
    make_input: Callable[[], Any],
    repeat: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> Timings:
    """Time ``fn(make_input())`` ``repeat`` times; building the input is not timed.

    ``clock`` is wall time by default; ``time.process_time`` (CPU time) is steadier on a
    machine that other processes share.
    """
    timings = Timings(name)
    for _ in range(repeat):
        argument = make_input()
        start = clock()
        fn(argument)
        timings.samples.append(clock() - start)
    return timings


@dataclass
class BenchmarkResult:
    nodes: int
    total: Timings
    passes: list[Timings]
    checks: Timings

    def table(self) -> str:
        head = f"{'measured (ms)':<36} {'min':>10} {'median':>10} {'max':>10}"
        rows = [self.total.row(), self.checks.row(), *(t.row() for t in self.passes)]
        return "\n".join([f"program: {self.nodes} nodes", head, *rows])


def benchmark_passes(
    passes: Sequence[Any], program: Any, repeat: int = 5, **manager_options: Any
) -> BenchmarkResult:
    """Run ``passes`` under a PassManager ``repeat`` times, each on a deep copy of ``program``
    (a program, or the methods of one model as ``{name: program}``, each pass timed per
    method).

    Reports the whole run, the condition-check time, and each pass's own time.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"benchmark_passes: repeat={repeat!r}: the runs to time, at least 1")
    total = Timings("pipeline total")
    checks = Timings("condition checks")
    per_pass: dict[str, Timings] = {}
    for _ in range(repeat):
        fresh = copy_program(program)  # one copy: methods' shared tensors stay shared
        manager = PassManager(list(passes), **manager_options)
        start = time.perf_counter()
        result = manager.run(fresh)
        total.samples.append(time.perf_counter() - start)
        reports = (result.reports if isinstance(result, MethodsRunResult)
                   else {"": result.report})
        checks.samples.append(sum(report.check_time for report in reports.values()))
        for method, report in reports.items():
            for record in report.records:
                key = f"{method + ': ' if method else ''}#{record.index} {record.name}"
                per_pass.setdefault(key, Timings(key)).samples.append(record.wall_time)
    programs = program.values() if isinstance(program, Mapping) else [program]
    return BenchmarkResult(sum(map(node_count, programs)), total, list(per_pass.values()),
                           checks)
