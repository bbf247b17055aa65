"""Trailing ``aten.copy_(state, value)`` write-backs: what a mutation output becomes in a
graph module, and becomes again when it is lifted.

``ep.module()`` turns each ``BUFFER_MUTATION`` / ``PARAMETER_MUTATION`` /
``USER_INPUT_MUTATION`` output into a ``copy_`` right before the output node, and
``InplaceToFunctional`` leaves the same on a graph module. Lifted, each becomes the
mutation output it stands for, which ``ep.module()`` turns back into the same ``copy_``.

An ExportedProgram writes its mutation outputs back after the graph, in input order; a
graph module writes back in its own order. The two agree unless a written-back value is a
view of state that is itself written back, so that case is refused, as are write-backs a
mutation output cannot say (a broadcasting or casting ``copy_``, one piece of state written
back twice, a write to a lifted constant).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from .._analysis.aliasing import aliased_argument
from .._analysis.buffers import trailing_write_backs
from .._analysis.op_schema import argument_value, facts_of
from ..errors import LiftError
from .state import LiftedState

__all__ = ["WriteBack", "check_write_back_values", "trailing_writes"]


@dataclass(frozen=True)
class WriteBack:
    """A trailing ``copy_(target, value)``: ``target`` is a ``get_attr`` of lifted state or a
    user-input placeholder."""

    node: Node
    target: Node
    value: Node


def _storage_root(node: Node) -> Node:
    """The node owning the storage ``node``'s value lives in, followed through the views
    and in-place results the op schemas declare."""
    while True:
        found = aliased_argument(node)
        if found is not None:
            node = found[1]
            continue
        if node.op == "call_function" and node.target is operator.getitem and isinstance(
                node.args[0], Node):
            base, index = node.args[0], node.args[1]
            facts = facts_of(base)
            if facts is not None and facts.list_views_of is not None:
                source = facts.list_views_of  # split / unbind: every result is a view
            elif facts is not None and isinstance(index, int) and index < len(
                    facts.results_alias):
                source = facts.results_alias[index]
            else:
                source = None
            value = argument_value(base, facts.schema, source) if source is not None else None
            if isinstance(value, Node):
                node = value
                continue
        return node


def trailing_writes(gm: torch.fx.GraphModule, lifted: dict[Node, LiftedState]) -> list[WriteBack]:
    """The graph's trailing write-backs, each checked to be one a mutation output can say."""
    found: list[WriteBack] = []
    written: dict[object, Node] = {}  # the lifted state or input placeholder -> its copy_
    for node in trailing_write_backs(gm):
        target, value = node.args[0], node.args[1]
        if (len(node.args) > 2 and node.args[2]) or node.kwargs.get("non_blocking"):
            raise LiftError("a non_blocking write-back has no mutation output form", node.name)
        state = lifted.get(target)
        if state is not None and state.kind == InputKind.CONSTANT_TENSOR:
            raise LiftError(
                f"writes the constant {state.target!r}; torch.export lifts a plain tensor "
                "attribute as a constant and refuses writes to it: register it as a buffer",
                node.name)
        key = state if state is not None else target
        if key in written:
            raise LiftError(
                f"{target.name} is written back twice (also by {written[key].name}); a "
                "program has one mutation output per piece of state", node.name)
        written[key] = node
        if not isinstance(value, Node):
            raise LiftError("the written-back value is not a graph value", node.name)
        found.append(WriteBack(node, target, value))
    roots = {lifted.get(w.target, w.target) for w in found}
    for write in found:
        root = _storage_root(write.value)
        if lifted.get(root, root) in roots:
            raise LiftError(
                f"writes back {write.value.name}, a view of {root.name}, which is itself "
                "written back: an ExportedProgram writes its mutation outputs back in input "
                "order, so the value would depend on that order. Clone it first (or run "
                "InplaceToFunctional, which does)", write.node.name)
    return found


def check_write_back_values(writes: list[tuple[WriteBack, Node, Node]]) -> None:
    """Each (write-back, lifted target, lifted value): a mutation output replaces its
    target whole, so the value must have the target's shape, dtype and device (as the
    fake values say); a broadcasting or casting ``copy_`` has no such form."""
    for write, target, value in writes:
        t, v = target.meta.get("val"), value.meta.get("val")
        if not isinstance(t, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise LiftError("the write-back's target or value has no fake tensor value",
                            write.node.name)
        if t.shape != v.shape or t.dtype != v.dtype or t.device != v.device:
            raise LiftError(
                f"copies a {v.dtype} {tuple(v.shape)} value on {v.device} into a {t.dtype} "
                f"{tuple(t.shape)} tensor on {t.device}: a mutation output replaces its "
                "target whole, with the same shape, dtype and device", write.node.name)
