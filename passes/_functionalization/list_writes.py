"""In-place ops writing a list of tensors (``_foreach_add_``, ``_foreach_copy_``, the
fused optimizers, AMP's unscale) whose positions depend on one another, split into one op
per position before the rewrite.

Eager runs such an op one position after the other (the CPU kernels loop over the list):
``_foreach_add_([a, b], [x, a])`` is ``a.add_(x)`` then ``b.add_(a)``, so ``b`` gets the
*new* ``a``, and ``_foreach_add_([a, a], [x, y])`` adds both. One functional call
(``_foreach_add``) reads every old value and writes ``a`` twice, the second write losing
the first: silently wrong (torch's ``run_decompositions({})`` is wrong there too). Split
into one op per position, in order, each position reads what the earlier ones wrote, as
in eager; the rewrite then handles each piece as any other write. An op whose positions
touch disjoint tensors keeps its single call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .._analysis.aliasing import Alias
from .._analysis.op_schema import argument_value, facts_of
from .element_overlap import may_share

__all__ = ["split_order_dependent_list_writes"]


@dataclass(frozen=True)
class _Position:
    """One list position of the op: its arguments (each list cut to that position) and
    the tensors it writes and touches."""

    args: tuple
    kwargs: dict
    written: list[Node]
    touched: list[Node]
    shared: frozenset[Node]  # given to every position (a non-list argument)


def split_order_dependent_list_writes(gm: GraphModule, candidates: Iterable[Node],
                                      aliases: dict[Node, Alias]) -> list[Node]:
    """Replace each list-writing op among ``candidates`` (the scan's nodes that may write)
    whose positions depend on one another by one op per position, in order; the replaced
    nodes are erased. Returns the new nodes (empty: nothing was split)."""
    added: list[Node] = []
    for node in list(candidates):
        positions = _positions(node)
        if positions is None or not _order_dependent(positions, aliases):
            continue
        with gm.graph.inserting_before(node):
            for position in positions:
                piece = gm.graph.call_function(node.target, position.args, position.kwargs)
                piece.meta.update(node.meta)  # the op returns nothing: its meta holds as is
                added.append(piece)
        gm.graph.erase_node(node)
    return added


def _positions(node: Node) -> list[_Position] | None:
    """The op at each list position, or None unless it writes a list, returns nothing and
    its non-empty list arguments have one length of at least 2: the ops known to run one
    position after the other."""
    facts = facts_of(node)
    if facts is None or facts.schema.returns:
        return None
    schema = facts.schema
    bound = [argument_value(node, schema, i) for i in range(len(schema.arguments))]
    is_list = [isinstance(a.type, torch.ListType) for a in schema.arguments]
    if not any(is_list[i] for i in facts.written):
        return None
    lengths = {len(v) for v, listed in zip(bound, is_list, strict=True) if listed and v}
    if len(lengths) != 1 or (n := lengths.pop()) < 2:
        return None
    positions = []
    for k in range(n):
        values = [v[k:k + 1] if listed and v else v
                  for v, listed in zip(bound, is_list, strict=True)]
        args, kwargs = [], {}
        for argument, value in zip(schema.arguments, values, strict=True):
            if argument.kwarg_only:
                kwargs[argument.name] = value
            else:
                args.append(value)
        positions.append(_Position(
            tuple(args), kwargs, [t for i in facts.written for t in _nodes(values[i])],
            [t for v in values for t in _nodes(v)],
            frozenset(t for v, listed in zip(values, is_list, strict=True) if not listed
                      for t in _nodes(v))))
    return positions


def _order_dependent(positions: list[_Position], aliases: dict[Node, Alias]) -> bool:
    """Whether a tensor one position writes may share an element with one that another
    position reads or writes (a tensor given to every position, too). A written tensor
    given to every position (AMP's ``found_inf``) is the op's own across positions: one
    call updates it as the positions in turn do."""
    return any(
        _may_share(w, t, aliases)
        for k, position in enumerate(positions) for w in position.written
        for j, other in enumerate(positions) if j != k for t in other.touched
        if not (t is w and w in position.shared)
    )


def _may_share(a: Node, b: Node, aliases: dict[Node, Alias]) -> bool:
    alias_a, alias_b = aliases.get(a), aliases.get(b)
    if alias_a is None or alias_b is None:
        return a is b
    return alias_a.root is alias_b.root and may_share(a, b)


def _nodes(value: Any) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, Node)]
    return []
