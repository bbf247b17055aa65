"""Cost of MarkMutableBuffers and InplaceToFunctional against ``run_decompositions({})``.

All timings come from the same run, on the same exported KV-cache decoder at 1, 4, 16 and
32 layers; each is the best of ``--repeats`` runs on a fresh deep copy (copying is not
timed). The speed-up uses InplaceToFunctional plus ``recompile()`` of the rewritten graph
module (what the PassManager does after it): the cost of a runnable functional program,
like run_decompositions'. The rewrite alone is shown too.

    python -m benchmarks.bench_functionalize [--layers 1 4 16 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch

from benchmarks.models import kv_decoder
from pass_manager import graph_module_of
from passes import InplaceToFunctional, MarkMutableBuffers

__all__ = ["main", "measure"]


def _best(repeats: int, prepare: Callable, run: Callable) -> float:
    best = float("inf")
    for _ in range(repeats):
        subject = prepare()
        start = time.perf_counter()
        run(subject)
        best = min(best, time.perf_counter() - start)
    return best


def _functionalize(program) -> None:
    InplaceToFunctional().call(program)
    graph_module_of(program).recompile()


def measure(n_layers: int, repeats: int) -> dict:
    model, inputs = kv_decoder(n_layers)
    ep = torch.export.export(model, inputs)

    def marked():
        program = copy.deepcopy(ep)
        MarkMutableBuffers().call(program)
        return program

    return {
        "layers": n_layers,
        "nodes": len(ep.graph.nodes),
        "decomp": _best(repeats, lambda: copy.deepcopy(ep), lambda p: p.run_decompositions({})),
        "mark": _best(repeats, lambda: copy.deepcopy(ep), lambda p: MarkMutableBuffers().call(p)),
        "rewrite": _best(repeats, marked, lambda p: InplaceToFunctional().call(p)),
        "functional": _best(repeats, marked, _functionalize),
    }


def main(argv: list[str] | None = None) -> str:
    """Print the table and return it as Markdown (the ``python -m benchmarks`` convention)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = [measure(n, args.repeats) for n in args.layers]
    lines = [
        "## InplaceToFunctional vs run_decompositions({}) on the exported KV decoder",
        "",
        "| layers | nodes | run_decompositions ms | MarkMutableBuffers ms | I2F rewrite ms "
        "| I2F + recompile ms | I2F µs/node | speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['nodes']} | {1e3 * r['decomp']:.1f} | {1e3 * r['mark']:.1f} "
            f"| {1e3 * r['rewrite']:.1f} | {1e3 * r['functional']:.1f} "
            f"| {1e6 * r['functional'] / r['nodes']:.1f} | {r['decomp'] / r['functional']:.1f}x |"
        )
    first, last = rows[0], rows[-1]
    growth = (last["functional"] / first["functional"]) / (last["nodes"] / first["nodes"])
    lines += [
        "",
        f"speed-up = run_decompositions / (I2F + recompile), best of {args.repeats}. "
        f"I2F cost growth / node-count growth from {first['layers']} to {last['layers']} "
        f"layers: {growth:.2f} (1.0 = linear).",
    ]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
