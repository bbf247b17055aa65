"""Pass-manager overhead against torch's PassManager on the same cheap passes.

Graphs of about 100, 1,000 and 10,000 nodes (a chain of elementwise ops, built with the
fx Graph API). Three cheap passes: a read-only analysis, a meta-only tagger and a
rewrite that changes one node. Our passes declare conditions (checked once, then
cached); torch's run as plain callables. Prints min/median/max and the ratio of
medians from one run, plus the per-node cost of fingerprint and snapshot.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult
from torch.fx.passes.infra.pass_manager import PassManager as TorchPassManager

from pass_manager import Condition, PassManager, function_pass
from pass_manager._rollback.snapshot import Snapshot
from pass_manager.benchmarking import time_call
from pass_manager.program import fingerprint

OPS = (torch.ops.aten.relu.default, torch.ops.aten.neg.default, torch.ops.aten.sin.default)


def chain_graph(nodes: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    for i in range(nodes - 2):
        value = graph.call_function(OPS[i % len(OPS)], (value,))
    graph.output(value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def has_output(program) -> list[str]:
    return [] if any(n.op == "output" for n in program.graph.nodes) else ["no output node"]


HasOutput = Condition("HasOutput", has_output, doc="the graph returns something")


def count_ops(gm):
    sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return TorchPassResult(gm, False)


def tag_first(gm):
    next(iter(gm.graph.nodes)).meta["tagged"] = True
    return TorchPassResult(gm, True)


def flip_last_op(gm):
    node = next(n for n in reversed(gm.graph.nodes) if n.op == "call_function")
    node.target = OPS[(OPS.index(node.target) + 1) % len(OPS)]
    return TorchPassResult(gm, True)


RAW_PASSES = [count_ops, tag_first, flip_last_op]
OUR_PASSES = [
    function_pass(count_ops, provides={HasOutput}, name="count_ops"),
    function_pass(tag_first, requires={HasOutput}, preserves={HasOutput}, name="tag_first"),
    function_pass(flip_last_op, requires={HasOutput}, preserves={HasOutput}, name="flip_last_op"),
]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    lines = [
        "## Pass-manager overhead vs torch.fx PassManager (same 3 cheap passes)",
        "",
        "| nodes | torch median ms | ours median ms (min/max) | ratio ours/torch "
        "| fingerprint µs/node | snapshot µs/node |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size in args.sizes:
        gm = chain_graph(size)
        fresh = lambda gm=gm: copy.deepcopy(gm)  # noqa: E731 - a per-size factory
        torch_t = time_call("torch", lambda m: TorchPassManager(RAW_PASSES)(m), fresh, args.repeat)
        ours_t = time_call("ours", lambda m: PassManager(OUR_PASSES).run(m), fresh, args.repeat)
        fp_t = time_call("fingerprint", fingerprint, fresh, args.repeat)
        snap_t = time_call("snapshot", Snapshot, fresh, args.repeat)
        lines.append(
            f"| {size} | {torch_t.median * 1e3:.2f} | {ours_t.median * 1e3:.2f} "
            f"({ours_t.min * 1e3:.2f}/{ours_t.max * 1e3:.2f}) | "
            f"{ours_t.median / torch_t.median:.2f}x | {fp_t.median / size * 1e6:.2f} | "
            f"{snap_t.median / size * 1e6:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
