"""Analyses cached per program, valid while what they read of the program is unchanged.

A pass and the conditions around it often compute the same analysis: MarkMutableBuffers
scans the graph for writes, and its guarantee MutableBuffersMarked scans again to check
the marks; InplaceToFunctional's requirement scans what the pass then scans. With
:func:`cached` the analysis is computed once and returned again while a :class:`Stamp` of
what it depends on still matches (LLVM's analysis manager, with invalidation measured
rather than declared):

* every node of the graph, in order: the node object, its op, name, target, args, kwargs
  and ``meta["val"]`` (held by reference, compared identity first, then by value);
* for an ExportedProgram, its graph signature (kind, argument and target of every spec)
  and the names in its state dict and constants; for a GraphModule, the buffer and
  parameter names of every submodule.

Node meta other than ``val`` and tensor data are not stamped: an analysis that reads
them passes ``depends``, a function returning a token of what it reads (wrap objects in
:class:`Same` to compare them by identity). The stamp holds what it compares, so no
identity is recycled while it lives. A cached value is shared: treat it as read-only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.export import ExportedProgram

from .program import graph_module_of, modules_of

__all__ = ["Same", "Stamp", "cached", "equal", "invalidate", "node_fields", "unchanged"]

T = TypeVar("T")

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def node_fields(nodes: list[torch.fx.Node]) -> list[tuple]:
    """Per node, the fields that make the program's code: name, op, target, args, kwargs and
    type (the manager's snapshot compares the same records)."""
    return [(n.name, n.op, n.target, n._args, n._kwargs, n.type) for n in nodes]


class _Measure:
    """One measurement of a graph's nodes: the nodes, their fields, their fake values, and
    the program's signature token (the last three taken when first asked for)."""

    __slots__ = ("_fields", "graph", "nodes", "signature", "vals")

    def __init__(self, graph: torch.fx.Graph, nodes: list | None = None,
                 fields: list | None = None):
        self.graph = graph
        self.nodes = list(graph.nodes) if nodes is None else nodes
        self._fields = fields
        self.vals: list | None = None
        self.signature: tuple | None = None

    @property
    def fields(self) -> list[tuple]:
        if self._fields is None:
            self._fields = node_fields(self.nodes)
        return self._fields

    def values(self) -> list:
        if self.vals is None:
            self.vals = [n.meta.get("val") for n in self.nodes]
        return self.vals

    def signature_token(self, program: Any) -> tuple:
        if self.signature is None:
            self.signature = _signature_token(program)
        return self.signature


# Graphs the manager declared unchanged for a while (checking conditions): their nodes
# are measured once for every stamp made or matched meanwhile (see ``unchanged``).
_unchanged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextmanager
def unchanged(graph: torch.fx.Graph, nodes: list | None = None,
              fields: list | None = None) -> Iterator[None]:
    """Declare that ``graph`` (and its program) does not change inside the block.

    Stamps made or matched inside share one measurement of its nodes instead of taking
    one each. The core loop wraps its condition checks in this, passing the node records
    the rollback record has just taken (``nodes`` and ``fields``, as :func:`node_fields`);
    without them the nodes are measured once, when first needed. A condition's check must
    not change the program.
    """
    previous = _unchanged.get(graph)
    _unchanged[graph] = _Measure(graph, nodes, fields)
    try:
        yield
    finally:
        if previous is None:
            del _unchanged[graph]
        else:
            _unchanged[graph] = previous


def _measure(graph: torch.fx.Graph) -> _Measure:
    found = _unchanged.get(graph)
    return found if found is not None else _Measure(graph)


def equal(a: Any, b: Any) -> bool:
    """``a == b`` (lists compare in C, identity first); values that cannot compare (fake
    tensors, whose truth value is undefined) are not equal."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. a replaced fake tensor: counted as a change
        return False


def _signature_token(program: Any) -> tuple:
    if not isinstance(program, ExportedProgram):
        gm = program
        return tuple(
            (name, tuple(m._buffers), tuple(m._parameters)) for name, m in modules_of(gm)
        )
    signature = program.graph_signature
    # The argument's name, or (an argument without one) its repr, rendered only then.
    specs = tuple(
        (s.kind, s.arg.name if hasattr(s.arg, "name") else repr(s.arg), s.target)
        for s in (*signature.input_specs, *signature.output_specs)
    )
    return specs, tuple(program.state_dict), tuple(program.constants)


class Same:
    """A token part equal only to a token holding the very same object (kept alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class Stamp:
    """What an analysis of ``program`` depends on, to tell later whether it still holds."""

    __slots__ = ("_depends", "_extra", "_graph", "_nodes", "_records", "_signature", "_vals")

    def __init__(self, program: Any, depends: Callable[[Any], Any] | None = None):
        graph = graph_module_of(program).graph
        measure = _measure(graph)
        self._graph = graph
        self._nodes = measure.nodes
        self._records = measure.fields
        self._vals = measure.values()
        self._signature = measure.signature_token(program)
        self._depends = depends
        self._extra = depends(program) if depends is not None else None

    def nodes_match(self, graph: torch.fx.Graph) -> bool:
        """Whether ``graph`` has the stamped nodes, in order, with the same fields."""
        if graph is not self._graph:
            return False
        measure = _measure(graph)
        return (
            measure.nodes == self._nodes  # Node equality is identity: a C loop
            and equal(measure.fields, self._records)
            and equal(measure.values(), self._vals)
        )

    def matches(self, program: Any) -> bool:
        return (
            self.nodes_match(graph_module_of(program).graph)
            and _measure(graph_module_of(program).graph).signature_token(program)
            == self._signature
            and (self._depends is None or self._depends(program) == self._extra)
        )


def cached(
    program: Any,
    key: str,
    compute: Callable[[Any], T],
    depends: Callable[[Any], Any] | None = None,
) -> T:
    """``compute(program)``, or the value computed earlier if its stamp still matches.

    ``depends(program)`` (optional) returns a token of what else the analysis reads
    (node meta, tensor data); the cached value is reused only while it compares equal.
    """
    gm = graph_module_of(program)
    entries = _cache.setdefault(gm, {})
    hit = entries.get(key)
    if hit is not None and hit[0].matches(program):
        return hit[1]
    stamp = Stamp(program, depends)
    value = compute(program)
    entries[key] = (stamp, value)
    return value


def invalidate(program: Any) -> None:
    """Forget every analysis of ``program`` (e.g. after changing what no stamp covers)."""
    _cache.pop(graph_module_of(program), None)
