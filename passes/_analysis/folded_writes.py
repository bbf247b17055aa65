"""The in-place state writes torchao's constant folding ran once, while converting.

``convert_pt2e(fold_quantize=True)`` folds constants with an ``fx.Interpreter``
(``torchao.quantization.pt2e.constant_fold.ConstantFolder``) that *runs* every node whose
inputs are all known, on the module's own tensors, before deciding whether to fold it.
An in-place write of a buffer computed from buffers and constants alone (a step counter's
``pos.add_(1)``, a decay's ``state.mul_(0.9)``, ``cache.index_fill_(0, idx, 0)``) is such
a node: it runs once during conversion, so the converted program starts one step ahead of
the model it was converted from. :func:`folded_state_writes` finds those writes, by the
folder's own rules, in the converted graph (which keeps them: a write is never folded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # defines the quantized_decomposed ops
from torch.fx import GraphModule, Node

from .buffers import BUFFER, PARAMETER, find_mutations

__all__ = ["folded_state_writes"]


def folded_state_writes(gm: GraphModule) -> dict[str, list[Node]]:
    """The buffers and parameters that constant folding wrote, by FQN, with the writes it
    ran (in graph order), by the folder's rules.

    The folder runs a call when it knows every input. It knows a ``get_attr``, and the
    value of a call it ran unless that call is a dequantize or reads (as a direct argument)
    a node of a chain torchao holds mutable: the producers of a ``copy_`` / ``put_``
    destination that reach a buffer. It runs no placeholder, constructor (a call with no
    node input), nondeterministic (seeded random) op, higher-order op or submodule call.
    """
    held_mutable = _held_mutable(gm)
    known: dict[Node, bool] = {}
    found: dict[str, list[Node]] = {}
    for state, writers in find_mutations(gm).writers.items():
        if state.kind not in (BUFFER, PARAMETER):
            continue
        ran = [w for w in writers if w is not None and _runs(w, known, held_mutable)]
        if ran:
            found[state.name] = ran
    return found


def _held_mutable(gm: GraphModule) -> set[Node]:
    """The nodes torchao's folder holds mutable (``ConstantFolder._find_mutable_buffers``):
    every producer of a ``copy_`` / ``put_`` destination whose chain reaches a buffer and no
    placeholder."""
    buffers = {name for name, _ in gm.named_buffers()}
    held: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_schema"):
            continue
        if "copy_" not in str(node.target) and "put_" not in str(node.target):
            continue
        if not node.args or not isinstance(node.args[0], Node):
            continue
        producers = _producers(node.args[0])
        if producers is not None and any(
            p.op == "get_attr" and str(p.target) in buffers for p in producers
        ):
            held.update(producers)
    return held


def _producers(node: Node) -> list[Node] | None:
    """``node`` and every node it is computed from (direct arguments), or None when one is
    a placeholder (torchao's ``collect_producer_nodes``)."""
    found, frontier = [node], [node]
    while frontier:
        current = frontier.pop()
        for arg in (*current.args, *current.kwargs.values()):
            if not isinstance(arg, Node):
                continue
            if arg.op == "placeholder":
                return None
            found.append(arg)
            frontier.append(arg)
    return found


def _runs(node: Node, known: dict[Node, bool], held: set[Node]) -> bool:
    """Whether the folder runs ``node``: it knows every input."""
    if _never_runs(node):
        return False
    return all(_known(i, known, held) for i in node.all_input_nodes)


def _known(node: Node, known: dict[Node, bool], held: set[Node]) -> bool:
    """Whether the folder knows ``node``'s value. Iterative: a graph unrolled over many
    steps chains thousands of nodes."""
    stack = [node]
    while stack:
        current = stack[-1]
        if current in known:
            stack.pop()
            continue
        if current.op == "get_attr" or _never_runs(current):
            known[current] = current.op == "get_attr"
            stack.pop()
            continue
        pending = [i for i in current.all_input_nodes if i not in known]
        if pending:
            stack.extend(pending)
            continue
        known[current] = all(known[i] for i in current.all_input_nodes) and not (
            current.target in _DEQUANTIZE
            or any(isinstance(a, Node) and a in held for a in current.args))
        stack.pop()
    return known[node]


_DEQUANTIZE = {
    torch.ops.quantized_decomposed.dequantize_per_tensor.default,
    torch.ops.quantized_decomposed.dequantize_per_tensor.tensor,
    torch.ops.quantized_decomposed.dequantize_per_channel.default,
}


def _never_runs(node: Node) -> bool:
    """A node the folder never runs, whatever its inputs."""
    if node.op != "call_function":
        return True  # placeholders, get_attr (a value, not a run), submodule calls, output
    target: Any = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    ):
        return True
    return not node.all_input_nodes  # a constructor (``torch.arange(4)``): skipped
