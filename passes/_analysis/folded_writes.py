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

import functools
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
    known = _known_values(gm, _held_mutable(gm))
    if not any(_mutates(node.target) and not _never_runs(node)
               and all(known[i] for i in node.all_input_nodes)
               for node in gm.graph.nodes if node.op == "call_function"):
        return {}  # no write the folder ran: the scan of every write is not needed
    found: dict[str, list[Node]] = {}
    for state, writers in find_mutations(gm).writers.items():
        if state.kind not in (BUFFER, PARAMETER):
            continue
        ran = [w for w in writers if w is not None and not _never_runs(w)
               and all(known.get(i, False) for i in w.all_input_nodes)]  # a HOP body's: no
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
        if not _copies_or_puts(node.target):
            continue
        if not node.args or not isinstance(node.args[0], Node):
            continue
        producers = _producers(node.args[0])
        if producers is not None and any(
            p.op == "get_attr" and str(p.target) in buffers for p in producers
        ):
            held.update(producers)
    return held


@functools.cache
def _mutates(target: Any) -> bool:
    """An op whose schema writes an argument (cached per op)."""
    schema = getattr(target, "_schema", None)
    return schema is None or schema.is_mutable  # no schema: it may write anything


@functools.cache
def _copies_or_puts(target: Any) -> bool:
    """A ``copy_`` / ``put_`` op, by torchao's test of its name (cached: ``str`` of an op
    is slow, and a decoder calls a few ops thousands of times)."""
    name = str(target)
    return "copy_" in name or "put_" in name


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


def _known_values(gm: GraphModule, held: set[Node]) -> dict[Node, bool]:
    """Whether the folder knows each node's value, in one walk in graph order (a node's
    inputs come before it): a ``get_attr``, or a call it runs whose every input it knows,
    unless that call is a dequantize or reads a node it holds mutable."""
    known: dict[Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            known[node] = True
            continue
        inputs = node.all_input_nodes
        # Most nodes depend on a placeholder: the cheap test first.
        known[node] = (node.op == "call_function" and bool(inputs)
                       and all(known[i] for i in inputs) and not _never_runs(node)
                       and node.target not in _DEQUANTIZE
                       and not any(isinstance(a, Node) and a in held for a in node.args))
    return known


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
