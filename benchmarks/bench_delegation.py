"""Cost of lowering the KV-cache decoder to delegates and moving its caches into them.

For 1, 4 and 16 layers: ``to_delegate`` with two partitioners (everything in one
delegate; only the cache updates, one delegate per layer), then
``ConsumeBufferMutationsInDelegate`` alone and under a PassManager (its conditions
checked). Node counts are the top level before / after lowering / after consumption,
and the nodes inside the delegates. The reference cost is ``run_decompositions({})``
on the same program, measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch

from pass_manager import PassManager
from pass_manager.benchmarking import time_call
from passes import ConsumeBufferMutationsInDelegate
from passes.delegation import AllNodePartitioner, OpSupportPartitioner, delegates, to_delegate
from passes.flow.examples import kv_decoder

__all__ = ["main"]

PARTITIONERS = {
    "everything": AllNodePartitioner(),
    "cache updates": OpSupportPartitioner([torch.ops.aten.index_copy]),
}


def _nodes(program) -> int:
    return len(program.graph.nodes)


def _row(layers: int, name: str, ep, partitioner, decomp_ms: float, repeat: int) -> str:
    lowered = to_delegate(ep, partitioner)
    consumed = ConsumeBufferMutationsInDelegate().call(lowered).program
    inner = sum(_nodes(d.program) for d in delegates(consumed))
    lower_t = time_call("lower", lambda p: to_delegate(p, partitioner), lambda: ep, repeat)
    consume_t = time_call(
        "consume", ConsumeBufferMutationsInDelegate().call, lambda: lowered, repeat
    )
    managed_t = time_call(
        "managed", PassManager([ConsumeBufferMutationsInDelegate()]).run, lambda: lowered, repeat
    )
    ratio = (lower_t.median + consume_t.median) * 1e3 / decomp_ms
    return (
        f"| {layers} | {name} | {_nodes(ep)} / {_nodes(lowered)} / {_nodes(consumed)}; {inner} "
        f"| {decomp_ms:.1f} | {lower_t.median * 1e3:.1f} | {consume_t.median * 1e3:.1f} "
        f"| {managed_t.median * 1e3:.1f} | {ratio:.3f} |"
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    lines = [
        "## Delegation: to_delegate + ConsumeBufferMutationsInDelegate on the KV decoder",
        "",
        "Median ms over repeated runs; inputs are not modified, so each run starts alike.",
        "",
        "| layers | partitioner | nodes (top: before / lowered / consumed; in delegates) "
        "| run_decompositions ms | to_delegate ms | consume ms | consume+checks ms "
        "| (to_delegate+consume)/decompositions |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for layers in args.layers:
        model, example = kv_decoder(layers)
        exported = torch.export.export(model, example)
        decomp = time_call(
            "decomp",
            lambda ep: ep.run_decompositions({}),
            functools.partial(copy.deepcopy, exported),
            max(1, args.repeat // 2),
        )
        ep = exported.run_decompositions({})
        for name, partitioner in PARTITIONERS.items():
            lines.append(_row(layers, name, ep, partitioner, decomp.median * 1e3, args.repeat))
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
