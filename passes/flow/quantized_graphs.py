"""What a converted (pt2e-quantized) program quantized: grids of its state and outputs, its ops.

The main job's quantization checks compare two quantized flows. Their tolerances come from
the programs themselves: one step of the quantization grid (the ``scale`` of the
quantize/dequantize pair) of the values a buffer holds or an output carries. And when two
flows quantized different graphs, :func:`quantized_ops` says which ops differ, so a check can
explain itself instead of blaming the state.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from .._analysis.buffers import user_outputs
from .._analysis.quantize_ops import is_dequantize, is_quantize_or_dequantize, scale_of

__all__ = ["buffer_grid", "describe_op_difference", "output_grid", "quantized_ops"]

# How far back from a buffer write or an output to look for the quantized value it carries:
# far enough to pass the data-movement ops between a dequantize and a cache write
# (index_copy, a view, the write-back copy).
_HOPS = 4


def _scale(gm: GraphModule, node: Node) -> float:
    scale: Any = scale_of(node)
    if isinstance(scale, Node) and scale.op == "get_attr":
        scale = getattr(gm, str(scale.target))
    if isinstance(scale, torch.Tensor):
        return float(scale.max().item()) if scale.numel() else 0.0
    return float(scale) if isinstance(scale, (int, float)) else 0.0


def _grid_near(gm: GraphModule, start: list[Node]) -> float:
    """The largest q/dq scale within a few producer hops of ``start`` (0.0 when none)."""
    best, frontier, seen = 0.0, list(start), set(start)
    for _ in range(_HOPS):
        following = []
        for node in frontier:
            if is_quantize_or_dequantize(node):
                best = max(best, _scale(gm, node))
            for arg in node.all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    following.append(arg)
        frontier = following
    return best


def buffer_grid(gm: GraphModule) -> dict[str, float]:
    """Per buffer FQN: one step of the grid its reads are quantized on or its writes carry."""
    grids: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        name = str(node.target)
        # The buffer's values quantized, not a buffer holding qparams (per-channel scales).
        near = [user for user in node.users
                if is_quantize_or_dequantize(user) and user.args[0] is node]
        writes = [
            user
            for user in node.users
            if user.op == "call_function" and "copy_" in str(user.target) and user.args[0] is node
        ]
        grid = max(
            (_scale(gm, q) for q in near),
            default=0.0,
        )
        for write in writes:
            grid = max(grid, _grid_near(gm, [a for a in write.all_input_nodes if a is not node]))
        if grid:
            grids[name] = max(grids.get(name, 0.0), grid)
    return grids


def output_grid(program: ExportedProgram | GraphModule) -> float:
    """One step of the grid the program's outputs are quantized on (0.0 when they are not):
    the outputs its caller gets (an ExportedProgram's user outputs, by its graph
    signature), not the caches a lifted program returns on the caches' own grids.

    It is the largest grid within a few hops before them, which may be the grid an op
    before the output read rather than the output's own (0.0214 for an output on 0.0127 on
    the built-in decoder). That is the tolerance the "no worse than" checks want: two
    calibrations of one program differ by more than the output's own step (Hugging Face's
    tiny Llama, one grid per cache against each method alone: 0.1738 against 0.1699 with
    the output's own step 0.0026). The runtime check, one program against itself, takes
    the output's own grid (:func:`passes.executorch.runtime.output_grid`)."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    return _grid_near(gm, user_outputs(program))


def quantized_ops(gm: GraphModule) -> Counter[str]:
    """How many times each op runs on a dequantized input (what the quantizer annotated)."""
    ops: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if not is_dequantize(node):
            continue
        for user in node.users:
            if user.op == "call_function" and not is_quantize_or_dequantize(user):
                ops[_op_name(user.target)] += 1
    return ops


# One op in two spellings: torchao's recipe decomposes (run_decompositions turns reshape into
# view), the passes do not; counted apart, the check said the flows quantized different graphs.
_SAME_OP = {"aten.reshape": "aten.view", "aten._unsafe_view": "aten.view"}


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        name = target.name().replace("::", ".")
        return _SAME_OP.get(name, name)
    return str(getattr(target, "__name__", target))


def describe_op_difference(mine: Counter[str], theirs: Counter[str]) -> str:
    """ "only with the passes: ...; only without: ..." or "" when both quantized the same ops."""

    def listing(counter: Counter[str]) -> str:
        return ", ".join(f"{op} x{n}" for op, n in sorted(counter.items()))

    parts = []
    if mine - theirs:
        parts.append(f"quantized only with the passes: {listing(mine - theirs)}")
    if theirs - mine:
        parts.append(f"only without: {listing(theirs - mine)}")
    return "; ".join(parts)
