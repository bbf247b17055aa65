"""Differential fuzzing of MarkMutableBuffers + InplaceToFunctional against eager PyTorch.

Generates small programs over a few buffers, a frozen parameter and inputs that mix
in-place ops, views (taken before and after writes) and reads; exports each, runs the two
passes on both program forms and compares 4 successive calls with the eager module
(outputs, buffers, the parameter and mutated inputs, exactly). Prints how many programs
were checked, transformed, rejected (by reason) and mismatched; the exit status is
non-zero on any mismatch or crash.

    python -m benchmarks.fuzz_functionalize --programs 2000 --seed 0

The generator and the check live in :mod:`tests.models.random_programs`, shared with the
property-based test (tests/passes/_functionalization/test_functionalize_differential.py),
which drives the generator from hypothesis.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from typing import Any

from tests.models.random_programs import (
    ALL_WRITES,
    RandomChooser,
    check_against_torch,
    generate_program,
)

__all__ = ["Tally", "main", "summarize"]


class Tally:
    """Outcomes counted as the command reports them: ours by kind (refusals by reason) and
    run_decompositions({})'s on the same valid programs, also split by our outcome."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.torch_counts: collections.Counter = collections.Counter()
        self.failures: list[tuple[int, str, Any]] = []
        self.seeds: list[int] = []

    def add(self, seed: int, outcome: str, reference: str | None, steps: Any = None) -> None:
        self.seeds.append(seed)
        self.counts[outcome.split(":")[0] if not outcome.startswith(("rejected", "invalid"))
                    else outcome] += 1
        if reference is not None:
            self.torch_counts[reference if reference == "ok" else reference.split(":")[0]] += 1
            self.torch_counts[f"{reference.split(':')[0]} (ours {outcome.split(':')[0]})"] += 1
        if outcome.startswith(("mismatch", "crash")):
            self.failures.append((seed, outcome, steps))

    def report(self, elapsed: float | None = None) -> None:
        counts = collections.Counter(self.counts)
        valid = sum(n for k, n in counts.items() if not k.startswith("invalid"))
        took = f" in {elapsed:.0f} s" if elapsed is not None else ""
        print(f"checked {len(self.seeds)} programs{took} ({valid} valid)")
        for key in ("transformed", "unchanged"):
            share = f" ({100 * counts[key] / valid:.1f}%)" if valid else ""
            print(f"  {key:<28} {counts.pop(key, 0)}{share}")
        for key in ("mismatch", "crash"):
            print(f"  {key:<28} {counts.pop(key, 0)}")
        for key in sorted(counts):
            print(f"  {key:<28} {counts[key]}")
        if self.torch_counts:
            print("run_decompositions({}) on the same valid programs:")
            for key in sorted(self.torch_counts):
                print(f"  {key:<28} {self.torch_counts[key]}")
        for seed, outcome, steps in self.failures[:10]:
            print(f"\nseed {seed}: {outcome}\n  steps: {steps}")


def summarize(paths: list[str]) -> Tally:
    """The tally of ``--log`` files (a run split into shards, or resumed): each seed once."""
    tally = Tally()
    for path in paths:
        with open(path) as log:
            for line in log:
                seed, outcome, reference = line.rstrip("\n").split("\t")
                tally.add(int(seed), outcome, None if reference == "None" else reference)
    repeated = sorted({s for s in tally.seeds if tally.seeds.count(s) > 1})
    if repeated:
        raise SystemExit(f"seeds checked more than once: {repeated[:10]}")
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                        help="also run run_decompositions({}) on each program and count "
                             "its wrong results and crashes")
    parser.add_argument("--progress", type=int, default=0,
                        help="report progress to stderr every N programs")
    parser.add_argument("--log", type=argparse.FileType("w"), default=None,
                        help="write one line per program (seed, ours, torch's) to this file, "
                             "so a long run's partial results survive an interruption")
    parser.add_argument("--summarize", nargs="+", metavar="LOG",
                        help="report on --log files of earlier runs instead of running")
    args = parser.parse_args(argv)
    if args.summarize:
        tally = summarize(args.summarize)
        seeds = sorted(tally.seeds)
        print(f"seeds {seeds[0]}-{seeds[-1]}"
              + ("" if seeds == list(range(seeds[0], seeds[-1] + 1)) else " (with gaps)"))
        tally.report()
        return 1 if tally.failures else 0
    # Deep-copying thousands of exported programs repeats torch's own LeafSpec deprecation
    # warning; it says nothing about the programs checked.
    warnings.filterwarnings("ignore", category=FutureWarning)
    tally = Tally()
    start = time.perf_counter()
    for i in range(args.programs):
        seed = args.seed + i
        steps = generate_program(RandomChooser(seed), args.max_steps, ALL_WRITES)
        outcome, reference = check_against_torch(steps, seed, torch_too=args.torch)
        tally.add(seed, outcome, reference, steps)
        if args.log:
            print(f"{seed}\t{outcome}\t{reference}", file=args.log, flush=True)
        if args.progress and (i + 1) % args.progress == 0:
            print(f"  ... {i + 1} programs, {time.perf_counter() - start:.0f} s, "
                  f"{len(tally.failures)} mismatches/crashes", file=sys.stderr, flush=True)
    tally.report(time.perf_counter() - start)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
