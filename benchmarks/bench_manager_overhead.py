"""Pass-manager overhead per pass: ``PassManager([p]).run(prog)`` against the bare pass.

For each of the five passes, on the 32-layer decoder and on a decoder with 256 MiB of KV
cache (16 layers, dim 512, 4,096 positions): the bare cost is ``p.call(prog)`` plus the
``recompile()`` its result needs (InplaceToFunctional; UnfreezeMutableBuffer when it
changed something); the managed cost is building ``PassManager([p])`` and running it
(conditions checked, snapshot, change detection, recompile). Each is timed ``--repeat``
times on fresh copies (copying is not timed), in CPU time of this process after a garbage
collection, bare and managed interleaved; the table gives the medians, min-of-runs and
the managed/bare ratio of both (target <= 1.10). ``--memory`` also measures, in a child
process per pass, the peak RSS the managed run adds on the big-state decoder, against the
program's buffer bytes (target <= 5%).

A full run (no ``--only`` / ``--pass``) also measures how the two passes that need a
quantized program, SkipAnnotateDataMovementOps and UnfreezeMutableBuffer, grow from 4 to
64 layers, bare and managed, against the node count of their inputs (target: cost ratio
<= 1.2x node ratio; ``bench_pass_cost`` measures the other passes' growth). Each pass's
input program comes from :mod:`tests.models.pass_inputs` (the pass-contract tests use it too).

    python -m benchmarks.bench_manager_overhead [--repeat 7] [--memory] [--only 32-layer]
        [--pass SkipAnnotateDataMovementOps]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from pass_manager import PassManager, graph_module_of
from pass_manager.benchmarking import Timings, time_call
from passes import InplaceToFunctional, UnfreezeMutableBuffer
from tests.models.pass_inputs import PASSES, inputs_for

__all__ = ["PROGRAMS", "main"]

PROGRAMS: dict[str, dict[str, Any]] = {
    "32-layer": {"n_layers": 32},
    "256MiB-state": {"n_layers": 16, "dim": 512, "max_seq": 4096},
}
GROWTH_LAYERS = (4, 64)
GROWTH_PASSES = ("SkipAnnotateDataMovementOps", "UnfreezeMutableBuffer")


def bare(pass_: Any, program: Any) -> Any:
    """The pass alone, plus the recompile its result needs to run."""
    out = pass_.call(program)
    result = out.program if out is not None else program
    if isinstance(pass_, (InplaceToFunctional, UnfreezeMutableBuffer)) and out.modified:
        graph_module_of(result).recompile()
    return result


def managed(make_pass: Callable[[], Any], program: Any) -> Any:
    return PassManager([make_pass()]).run(program).program


def measure(name: str, repeat: int, passes: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of program ``name``: every pass, or only those in ``passes``."""
    only = passes[0] if passes and len(passes) == 1 else None
    factories, _ = inputs_for(PROGRAMS[name], only=only)
    rows = []
    for pass_name, make_pass in PASSES.items():
        if passes and pass_name not in passes:
            continue
        b, m = _bare_and_managed(make_pass, factories[pass_name], repeat)
        rows.append({
            "program": name, "pass": pass_name,
            "bare_ms": b.median * 1e3, "managed_ms": m.median * 1e3,
            "ratio_median": m.median / b.median, "ratio_min": m.min / b.min,
        })
    return rows


def _bare_and_managed(
    make_pass: Callable[[], Any], make_input: Callable[[], Any], repeat: int
) -> tuple[Timings, Timings]:
    """``repeat`` timings of the bare and the managed pass, interleaved so that load on the
    machine hits both alike."""
    b, m = Timings("bare"), Timings("managed")
    run_bare = lambda p: bare(make_pass(), p)  # noqa: E731
    run_managed = lambda p: managed(make_pass, p)  # noqa: E731
    for _ in range(repeat):
        # CPU time, each run after a collection: on a shared machine wall time mostly
        # measures the other processes, and a collection one run triggers and the other
        # does not is noise of the order of the small passes' whole cost.
        for timings, run in ((b, run_bare), (m, run_managed)):
            gc.collect()
            timings.samples += time_call(
                timings.name, run, make_input, 1, clock=time.process_time
            ).samples
    return b, m


def measure_growth(repeat: int) -> list[str]:
    """The growth table of SkipAnnotateDataMovementOps and UnfreezeMutableBuffer: min-of-runs
    cost at 4 and 64 layers, bare and managed, against their inputs' node counts."""
    nodes: dict[tuple[str, int], int] = {}
    cost: dict[tuple[str, str, int], float] = {}
    for layers in GROWTH_LAYERS:
        factories, _ = inputs_for({"n_layers": layers})
        for pass_name in GROWTH_PASSES:
            make_input = factories[pass_name]
            nodes[pass_name, layers] = len(graph_module_of(make_input()).graph.nodes)
            b, m = _bare_and_managed(PASSES[pass_name], make_input, repeat)
            cost[pass_name, "bare", layers], cost[pass_name, "managed", layers] = b.min, m.min
    small, big = GROWTH_LAYERS
    lines = [
        "", f"## Growth from {small} to {big} layers of the passes on quantized programs "
        f"(CPU ms: min of {repeat} runs)", "",
        "Inputs as above: the annotated program (SkipAnnotateDataMovementOps) and the "
        "converted one (UnfreezeMutableBuffer). Target: cost ratio <= 1.2x node ratio.", "",
        f"| pass | nodes ({small} -> {big} layers) | node ratio | mode | {small} layers "
        f"| {big} layers | cost ratio | cost ratio / node ratio |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for pass_name in GROWTH_PASSES:
        n_small, n_big = nodes[pass_name, small], nodes[pass_name, big]
        for mode in ("bare", "managed"):
            a, z = cost[pass_name, mode, small], cost[pass_name, mode, big]
            lines.append(
                f"| {pass_name} | {n_small} -> {n_big} | x{n_big / n_small:.2f} | {mode} "
                f"| {a * 1e3:.2f} | {z * 1e3:.1f} | x{z / a:.2f} "
                f"| {z / a / (n_big / n_small):.2f} |")
    return lines


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_child(pass_name: str, mode: str) -> None:
    """In a child process: the peak RSS one run adds over the resident input program."""
    factories, buffer_bytes = inputs_for(PROGRAMS["256MiB-state"], only=pass_name)
    program = factories[pass_name]()
    del factories
    gc.collect()
    # Give freed memory back to the system first, so the peak counts new memory only.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak (VmHWM) to the current RSS
    base = _rss_kib("VmRSS")
    if mode == "managed":
        managed(PASSES[pass_name], program)
    else:
        bare(PASSES[pass_name](), program)
    extra = (_rss_kib("VmHWM") - base) * 1024
    print(json.dumps({"extra": extra, "buffer_bytes": buffer_bytes}))


def measure_memory() -> list[dict[str, Any]]:
    rows = []
    for pass_name in PASSES:
        row: dict[str, Any] = {"pass": pass_name}
        for mode in ("bare", "managed"):
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_manager_overhead", "--peak-child",
                 pass_name, mode], capture_output=True, text=True, check=True,
            )
            data = json.loads(done.stdout.strip().splitlines()[-1])
            row[f"{mode}_extra_mib"] = data["extra"] / 2**20
            row["buffer_mib"] = data["buffer_bytes"] / 2**20
        row["manager_extra_pct"] = (
            100 * (row["managed_extra_mib"] - row["bare_extra_mib"]) / row["buffer_mib"]
        )
        row["managed_extra_pct"] = 100 * row["managed_extra_mib"] / row["buffer_mib"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> str:
    """Print the tables as they are measured; return them as Markdown (``python -m benchmarks``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--only", choices=sorted(PROGRAMS), action="append")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--pass", dest="passes", choices=sorted(PASSES), action="append",
                        help="measure only this pass (repeatable)")
    parser.add_argument("--peak-child", nargs=2, metavar=("PASS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peak_child:
        _peak_child(*args.peak_child)
        return ""
    lines = [
        f"## Pass-manager overhead per pass (CPU ms: median of {args.repeat} interleaved runs)",
        "",
        "bare = `p.call(program)` + the `recompile()` its result needs; managed = "
        "`PassManager([p]).run(program)` (conditions, snapshot, change detection, recompile). "
        "Target: managed / bare <= 1.10.",
        "",
        "| program | pass | bare | managed | managed / bare (medians) | managed / bare (minima) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name in args.only or PROGRAMS:
        for r in measure(name, args.repeat, args.passes):
            lines.append(f"| {r['program']} | {r['pass']} | {r['bare_ms']:.1f} "
                         f"| {r['managed_ms']:.1f} | {r['ratio_median']:.3f}x "
                         f"| {r['ratio_min']:.3f}x |")
            print(lines[-1], flush=True)
    if not args.only and not args.passes:
        growth = measure_growth(args.repeat)
        print("\n".join(growth), flush=True)
        lines += growth
    if args.memory:
        memory = [
            "", "### Peak extra RSS on the 256MiB-state decoder (MiB, one child process per run)",
            "", "| pass | buffers | bare | managed | manager's share of buffers |",
            "|---|---:|---:|---:|---:|",
        ]
        print("\n".join(memory), flush=True)
        for r in measure_memory():
            memory.append(f"| {r['pass']} | {r['buffer_mib']:.0f} | {r['bare_extra_mib']:.1f} "
                          f"| {r['managed_extra_mib']:.1f} | {r['manager_extra_pct']:.2f}% |")
            print(memory[-1], flush=True)
        lines += memory
    return "\n".join(lines)


if __name__ == "__main__":
    main()
