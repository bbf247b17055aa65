"""An order of a functional program that coremltools 9.0 converts when Core ML owns its state.

coremltools' ``canonicalize_inplace_pattern`` pass moves each ``coreml_update_state``
(emitted at the end of the MIL program, one per owned buffer, in the order of their new
values) right behind the op that computes the new value, inserting it before the op that
followed that producer in a list of the block's ops taken when the pass started. When that
follower is an update the pass has already moved and deleted, the insert raises
``KeyError: %coreml_update_state_0 ...`` from inside ExecuTorch's ``preprocess``:

* fp16 compute (ExecuTorch's default): when Core ML owns two or more buffers and the last
  op of the program computes a new state value (the last op's follower is the first
  update, moved already unless the last op computes that first state alone). Every model
  that computes its outputs before writing two caches hits it
  (``out = f(k, v); k.index_copy_(...); v.index_copy_(...); return out``), and so does one
  value written last into two buffers (Core ML drops ``aten.copy`` as an identity).
* fp32 compute: whenever one value is written into two buffers. Each state value is cast
  to the state's fp16 right before its update; coremltools merges the two equal casts, and
  the merged cast's follower is the first of its two updates.

The fix changes the order and the ops, never a value: :func:`coreml_state_order` gives each
buffer written from a value another buffer is written from too an op of its own,
``aten.maximum(v, v)`` (exactly ``v``, NaN and signed zeros included; an op coremltools
neither drops nor merges, as it does a clone or ``v + 0``); it then puts every node a new
state value depends on first and the rest (the user outputs' own work) after, so the last
op computes a user output. When every user output is itself on the way to a new state value
(``v = f(x); a.copy_(v); b.copy_(v); return v``), nothing is left to put last, so the last
user output is returned as ``maximum(u, u)``, computed last.

Before (``a`` and ``b`` both written from ``add_2``, the output computed first)::

    add_1 = aten.add(add, mul_2)           # user output
    add_2 = aten.add(x, 1)                 # new value of a and b
    copy = aten.copy(b_b, add_2)
    return (add_2, copy, add_1)            # BUFFER_MUTATION a, b; USER_OUTPUT

After::

    add_2 = aten.add(x, 1)
    maximum = aten.maximum(add_2, add_2)   # b's own op
    add_1 = aten.add(add, mul_2)           # last: not a new state value
    return (add_2, maximum, add_1)
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Node

from pass_manager.program import graph_module_copy

__all__ = ["coreml_state_order", "needs_coreml_state_order"]

# Ops coremltools' torch frontend turns into nothing (identity, removed by its
# noop_elimination): they cannot be the last op of the MIL program.
_ERASED = {
    "alias", "clone", "_clone_dim_order", "copy", "detach", "lift_fresh_copy",
    "_to_copy", "_to_dim_order_copy", "view", "_unsafe_view", "reshape",
}


def _op_name(node: Node) -> str:
    """``copy`` for ``aten.copy.default`` and its Edge form; ``""`` for a non-operator."""
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else ""


def _state_values_of(graph: torch.fx.Graph, specs: list[OutputSpec]) -> list[Node]:
    returned = list(graph.output_node().args[0])
    return [returned[i] for i, spec in enumerate(specs)
            if spec.kind == OutputKind.BUFFER_MUTATION and isinstance(returned[i], Node)]


def _state_values(ep: ExportedProgram) -> list[Node]:
    return _state_values_of(ep.graph, list(ep.graph_signature.output_specs))


def _ancestors(nodes: list[Node]) -> set[Node]:
    found: set[Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


def _last_kept(graph: torch.fx.Graph) -> Node | None:
    """The last op coremltools keeps."""
    for node in reversed(graph.nodes):
        if node.op == "call_function" and _op_name(node) not in _ERASED:
            return node
    return None


def _last_is_state(ep: ExportedProgram) -> bool:
    """Whether the last op coremltools keeps computes a new state value (or feeds one)."""
    return _last_kept(ep.graph) in _ancestors(_state_values(ep))


def _root(node: Node) -> Node:
    """The op Core ML computes ``node`` with: through the copies it drops."""
    while node.op == "call_function" and _op_name(node) in ("alias", "clone", "_clone_dim_order",
                                                           "copy", "detach"):
        node = node.args[1] if _op_name(node) == "copy" else node.args[0]  # copy(dst, src)
    return node


def _shared_roots(ep: ExportedProgram) -> bool:
    roots = [_root(v) for v in _state_values(ep)]
    return len(set(roots)) < len(roots)


def needs_coreml_state_order(ep: ExportedProgram) -> bool:
    """Whether ``ep`` updates two or more buffers and its last kept op computes state, or
    writes one value into two buffers: the programs coremltools 9.0 fails on with
    ``KeyError`` when Core ML owns them."""
    return len(_state_values(ep)) >= 2 and (_last_is_state(ep) or _shared_roots(ep))


def coreml_state_order(ep: ExportedProgram) -> ExportedProgram:
    """A copy of functional ``ep`` computing the same values in a form coremltools
    converts (see the module docstring); ``ep`` itself unless it needs one.
    State tensors are shared with ``ep``, which is not modified."""
    if not needs_coreml_state_order(ep):
        return ep
    gm = graph_module_copy(ep.graph_module)
    work = ep._update(gm, copy.deepcopy(ep.graph_signature))
    specs = list(work.graph_signature.output_specs)
    _distinct_state_values(work.graph, specs)
    state = _ancestors(_state_values_of(work.graph, specs))
    output = work.graph.output_node()
    # Ancestor-closed first, the rest after: still a topological order.
    for node in [n for n in work.graph.nodes if n.op == "call_function" and n not in state]:
        output.prepend(node)
    if _last_kept(work.graph) in state:
        _return_through_maximum(work.graph, specs)
    work.graph.eliminate_dead_code()
    work.graph.lint()
    gm.recompile()
    return work._update(gm, ExportGraphSignature(list(work.graph_signature.input_specs), specs))


def _same_value(graph: torch.fx.Graph, value: Node) -> Node:
    """``maximum(value, value)``: exactly ``value`` (NaN and signed zeros included), an op
    Core ML neither drops nor merges with ``value``."""
    same = graph.call_function(torch.ops.aten.maximum.default, (value, value))
    same.meta.update({k: v for k, v in value.meta.items()
                      if k in ("val", "tensor_meta", "stack_trace", "nn_module_stack")})
    return same


def _distinct_state_values(graph: torch.fx.Graph, specs: list[OutputSpec]) -> None:
    """Each buffer written from a value another buffer is written from too gets its own
    op: coremltools casts each state value to the state's fp16 and merges equal casts."""
    output = graph.output_node()
    returned = list(output.args[0])
    seen: set[Node] = set()
    for index, spec in enumerate(specs):
        if spec.kind != OutputKind.BUFFER_MUTATION or not isinstance(returned[index], Node):
            continue
        root = _root(returned[index])
        if root in seen:
            with graph.inserting_before(output):
                returned[index] = _same_value(graph, root)
            specs[index] = OutputSpec(spec.kind, TensorArgument(returned[index].name),
                                      spec.target)
        seen.add(root)
    output.args = (tuple(returned),)


def _return_through_maximum(graph: torch.fx.Graph, specs: list[OutputSpec]) -> None:
    """Return the last tensor user output as ``maximum(u, u)``, computed last."""
    output = graph.output_node()
    returned = list(output.args[0])
    users = [i for i, spec in enumerate(specs)
             if spec.kind == OutputKind.USER_OUTPUT and isinstance(returned[i], Node)
             and isinstance(returned[i].meta.get("val"), torch.Tensor)]
    if not users:
        return  # nothing returned: ExecuTorch refuses a Core ML program without outputs
    index = users[-1]
    with graph.inserting_before(output):
        returned[index] = _same_value(graph, returned[index])
    specs[index] = OutputSpec(specs[index].kind, TensorArgument(returned[index].name),
                              specs[index].target)
    output.args = (tuple(returned),)
