"""Pass cost against node count on the exported KV decoder, next to ``run_decompositions({})``.

For 1, 4, 16, 32 and 64 layers, in one run: MarkMutableBuffers, InplaceToFunctional
(with the recompile the manager does after it, so the result is runnable like
run_decompositions'), to_delegate and
ConsumeBufferMutationsInDelegate, the functionalization pipeline (Mark +
InplaceToFunctional) and the whole pipeline (with delegation) under a PassManager
(conditions checked), and ``ep.run_decompositions({})`` — the upstream way to get a functional
program. Each is timed ``--repeat`` times on a fresh deep copy (copying is not timed);
tables give min/median/max and ratios of medians. Writes ``pass_cost.png`` beside this file.

    python -m benchmarks.bench_pass_cost [--layers 1 4 16 32 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from pass_manager import PassManager, function_pass, graph_module_of
from pass_manager.benchmarking import Timings, time_call
from passes import ConsumeBufferMutationsInDelegate, InplaceToFunctional, MarkMutableBuffers
from passes.conditions import Functional
from passes.delegation import AllNodePartitioner, to_delegate
from passes.examples import kv_decoder

__all__ = ["main", "measure"]

PLOT = Path(__file__).resolve().parent / "pass_cost.png"


def _marked(ep):
    program = copy.deepcopy(ep)
    MarkMutableBuffers().call(program)
    return program


def _functionalize_pipeline() -> PassManager:
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()])


def _functional(ep):
    return _functionalize_pipeline().run(copy.deepcopy(ep)).program


def _functionalize(program) -> None:
    InplaceToFunctional().call(program)
    graph_module_of(program).recompile()


def _pipeline() -> PassManager:
    lower = function_pass(
        lambda program: to_delegate(program, AllNodePartitioner()),
        requires={Functional},
        name="to_delegate",
    )
    return PassManager(
        [MarkMutableBuffers(), InplaceToFunctional(), lower, ConsumeBufferMutationsInDelegate()]
    )


def measure(n_layers: int, repeat: int) -> tuple[int, dict[str, Timings]]:
    model, inputs = kv_decoder(n_layers)
    ep = torch.export.export(model, inputs)
    functional = _functional(ep)
    lowered = to_delegate(copy.deepcopy(functional), AllNodePartitioner())
    fresh = lambda: copy.deepcopy(ep)  # noqa: E731 - a timing input factory
    timings = {
        "run_decompositions({})": time_call(
            "decomp", lambda p: p.run_decompositions({}), fresh, repeat
        ),
        "MarkMutableBuffers": time_call(
            "mark", lambda p: MarkMutableBuffers().call(p), fresh, repeat
        ),
        "InplaceToFunctional": time_call("i2f", _functionalize, lambda: _marked(ep), repeat),
        "to_delegate": time_call(
            "lower",
            lambda p: to_delegate(p, AllNodePartitioner()),
            lambda: copy.deepcopy(functional),
            repeat,
        ),
        "ConsumeBufferMutationsInDelegate": time_call(
            "consume",
            lambda p: ConsumeBufferMutationsInDelegate().call(p),
            lambda: copy.deepcopy(lowered),
            repeat,
        ),
        "functionalize (PassManager)": time_call(
            "functionalize", lambda p: _functionalize_pipeline().run(p), fresh, repeat
        ),
        "whole pipeline (PassManager)": time_call(
            "pipeline", lambda p: _pipeline().run(p), fresh, repeat
        ),
    }
    return len(ep.graph.nodes), timings


def _plot(results: list[tuple[int, int, dict[str, Timings]]]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib is not installed: `make bench` installs the bench extra; no plot)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    nodes = [n for _, n, _ in results]
    for name in results[0][2]:
        ax.plot(nodes, [t[name].median * 1e3 for _, _, t in results], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nodes in the exported decoder (1, 4, 16, 32, 64 layers)")
    ax.set_ylabel("median time (ms)")
    ax.set_title("Pass cost vs node count")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return f"![pass cost against node count]({PLOT.name})"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    results = []
    for n_layers in args.layers:
        print(f"  measuring {n_layers} layer(s) ...", flush=True)
        nodes, timings = measure(n_layers, args.repeat)
        results.append((n_layers, nodes, timings))

    names = list(results[0][2])
    lines = [
        f"## Pass cost on the exported KV decoder (ms: min / median / max of {args.repeat} runs)",
        "",
        "| layers | nodes | " + " | ".join(names) + " |",
        "|---:|---:|" + "---:|" * len(names),
    ]
    for n_layers, nodes, timings in results:
        cells = [
            f"{t.min * 1e3:.1f} / {t.median * 1e3:.1f} / {t.max * 1e3:.1f}"
            for t in timings.values()
        ]
        lines.append(f"| {n_layers} | {nodes} | " + " | ".join(cells) + " |")

    lines += [
        "",
        "| layers | nodes | InplaceToFunctional µs/node | run_decompositions / "
        "InplaceToFunctional | run_decompositions / functionalize (PassManager) "
        "| run_decompositions / whole pipeline |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n_layers, nodes, t in results:
        decomp = t["run_decompositions({})"].median
        i2f = t["InplaceToFunctional"].median
        lines.append(
            f"| {n_layers} | {nodes} | {i2f / nodes * 1e6:.1f} | {decomp / i2f:.1f}x "
            f"| {decomp / t['functionalize (PassManager)'].median:.1f}x "
            f"| {decomp / t['whole pipeline (PassManager)'].median:.1f}x |"
        )
    by_layers = {n: (nodes, t) for n, nodes, t in results}
    if 4 in by_layers and 32 in by_layers:
        (n4, t4), (n32, t32) = by_layers[4], by_layers[32]
        lines += ["", f"Cost growth from 4 to 32 layers (nodes x{n32 / n4:.1f}):", ""]
        for name in names:
            lines.append(f"- {name}: x{t32[name].median / t4[name].median:.1f}")
    lines += ["", _plot(results)]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
