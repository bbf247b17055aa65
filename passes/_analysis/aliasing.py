"""Which tensors of an FX graph share storage.

Read from operator schemas (:mod:`passes._analysis.op_schema`) and, for ops that only *may* return
a view (``reshape``, ``to``, ``contiguous``), from the storages of the fake tensors in
``node.meta["val"]``. Nothing runs the program.

A value's :class:`Alias` is its storage root (a node producing fresh memory, or the
canonical node of a buffer/input) and the chain of view nodes leading from the root to it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.fx import Node

from .op_schema import (
    DROPOUTS,
    STORAGE_VIEWS,
    OpFacts,
    argument_value,
    aten_op,
    facts_of,
    shared_input,
    shares_storage,
    target_of,
)

__all__ = ["Alias", "OpaqueNode", "alias_map", "aliased_argument"]

_aten = torch.ops.aten


class Alias(NamedTuple):
    """Where a value lives: ``root`` owns the storage, ``chain`` are the view nodes from it.

    A named tuple rather than a frozen dataclass: a scan makes one per node of the graph,
    and a frozen dataclass costs a Python-level ``object.__setattr__`` per field.
    """

    root: Node
    chain: tuple[Node, ...] = ()


@dataclass(frozen=True)
class OpaqueNode:
    """A node whose effect on its arguments cannot be read from a schema."""

    node: Node
    reason: str


def aliased_argument(node: Node) -> tuple[int, Node, bool] | None:
    """For an op whose single tensor result aliases an argument: (index, argument, written).

    ``written`` is True for an in-place op (the result *is* the written argument) and
    False for a view. Ops that only may alias (``reshape``, ``to``) count as views when the
    fake tensors say they share storage, or when there is no fake tensor to ask.
    """
    return _aliased(node, facts_of(node))


def _aliased(node: Node, facts: OpFacts | None) -> tuple[int, Node, bool] | None:
    if facts is not None and facts.self_if_shared:
        shared = shared_input(node)
        return None if shared is None else (shared[0], shared[2], False)
    if facts is None or facts.result_of is None:
        return None
    value = argument_value(node, facts.schema, facts.result_of)
    if not isinstance(value, Node):
        return None
    if facts.maybe_view and shares_storage(node, value) is False and not (
            _dropout_is_identity(node)):
        return None
    return facts.result_of, value, facts.result_written


def _dropout_is_identity(node: Node) -> bool:
    """A dropout that returns its input itself (``train=False`` or ``p=0``); its fake
    result is a copy, so storage sharing does not tell."""
    if aten_op(node) not in DROPOUTS:
        return False
    _, p, train = (argument_value(node, _aten.dropout.default._schema, i) for i in range(3))
    return train is False or (isinstance(p, (int, float)) and p == 0)


def _multi_alias(node: Node, facts: OpFacts | None) -> tuple[str, list] | None:
    """Ops with several results aliasing arguments.

    ``("views", [arg])`` for list-of-views ops (split, unbind: ``Tensor(a -> *)``),
    ``("elements", [arg per result])`` for ops whose i-th result views their list's i-th
    tensor (``broadcast_tensors``: op_schema.ELEMENT_VIEWS) and
    ``("returns", [arg or None per result])`` for tuple results that alias written args.
    """
    if facts is None:
        return None
    if facts.element_views:
        values = argument_value(node, facts.schema, 0)
        return ("elements", list(values)) if isinstance(values, (list, tuple)) else None
    if facts.list_views_of is not None:
        value = argument_value(node, facts.schema, facts.list_views_of)
        return ("views", [value]) if isinstance(value, Node) else None
    if not any(i is not None for i in facts.results_alias):
        return None
    per_result = []
    for i in facts.results_alias:
        value = None if i is None else argument_value(node, facts.schema, i)
        per_result.append(value if isinstance(value, Node) else None)
    return "returns", per_result


def alias_map(
    nodes: Iterable[Node], canonical: dict[Node, Node] | None = None,
    writers: list[Node] | None = None,
) -> tuple[dict[Node, Alias], list[OpaqueNode]]:
    """The :class:`Alias` of every node, and the nodes whose aliasing is unknowable.

    ``canonical`` maps nodes that denote the same storage (e.g. two ``get_attr`` nodes of
    one buffer) to one representative, used as their root. ``writers``, when given,
    receives in graph order every node that may write (:func:`may_write`) and every
    higher-order op call (its subgraphs may write): the scan then looks at those only.
    """
    canonical = canonical or {}
    aliases: dict[Node, Alias] = {}
    multi: dict[Node, tuple[str, list]] = {}
    opaque: list[OpaqueNode] = []
    for node in nodes:
        facts = facts_of(node)
        if writers is not None and (facts.may_write if facts is not None else (
            node.op == "call_function"
            and isinstance(node.target, torch._ops.HigherOrderOperator)
        )):
            writers.append(node)
        if facts is not None and facts.fresh:  # most nodes: nothing below applies
            aliases[node] = Alias(node)
            continue
        if node.op in ("placeholder", "get_attr"):
            aliases[node] = Alias(canonical.get(node, node))
            continue
        if node.op == "output":
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            base, index = node.args[0], node.args[1]
            info = multi.get(base) if isinstance(base, Node) else None
            if info is not None:
                kind, targets = info
                if kind == "views":
                    source = aliases[targets[0]]
                    aliases[node] = Alias(source.root, (*source.chain, base, node))
                    continue
                if kind == "elements":
                    element = targets[index] if isinstance(index, int) and (
                        0 <= index < len(targets)) else None
                    if isinstance(element, Node) and element in aliases:
                        source = aliases[element]
                        aliases[node] = Alias(source.root, (*source.chain, base, node))
                        continue
                if isinstance(index, int) and targets[index] is not None:
                    aliases[node] = aliases[targets[index]]
                    continue
            aliases[node] = Alias(node)
            continue
        if node.op in ("call_module", "call_method") and node.target != "_guards_fn":
            opaque.append(OpaqueNode(node, f"{node.op} {node.target!r} has no schema"))
        if target_of(node) is _aten.set_.source_Tensor:
            # The tensor becomes its source: later writes to it write the source's storage.
            source = argument_value(node, _aten.set_.source_Tensor._schema, 1)
            if source in aliases:
                aliases[node] = aliases[source]
                continue
        found = _aliased(node, facts)
        if found is not None and found[1] in aliases:
            _, arg, written = found
            source = aliases[arg]
            if target_of(node) in STORAGE_VIEWS:
                # Addressed in its input's storage, not in its input: a view of the root.
                aliases[node] = Alias(source.root, (node,))
            else:
                aliases[node] = source if written else Alias(source.root, (*source.chain, node))
            continue
        info = _multi_alias(node, facts)
        if info is not None:
            multi[node] = info
        aliases[node] = Alias(node)
    return aliases, opaque
