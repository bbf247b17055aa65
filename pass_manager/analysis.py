"""Analyses cached per program, valid while what they read of the program is unchanged.

:func:`cached` computes an analysis once and returns it again while a :class:`Stamp` of
what it depends on still matches: every node in order (the node, its fields and
``meta["val"]``, held by reference, compared identity first, then by value) and the
signature (an ExportedProgram's specs and state names; a GraphModule's buffer and
parameter names). What else an analysis reads (other meta, tensor data) it names with
``depends``. The stamp holds what it compares, so no identity is recycled while it lives.
A cached value is shared: treat it as read-only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
from torch.export import ExportedProgram

from .program import graph_module_of, modules_of

__all__ = ["Same", "Stamp", "cached", "edited_fields", "equal", "node_fields", "unchanged"]

T = TypeVar("T")

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def node_fields(nodes: list[torch.fx.Node]) -> list[tuple]:
    """Per node, the fields that make the program's code: name, op, target, args, kwargs and
    type (the rollback record compares the same records)."""
    return [(n.name, n.op, n.target, n._args, n._kwargs, n.type) for n in nodes]


# torch.fx's per-graph index of nodes by op and target.
_Table = torch.fx.graph._FindNodesLookupTable


class _Watch(_Table):
    """A graph's lookup table (its own state, shared) noting each node's fields when it is
    first taken out: torch.fx's ``Node.__setattr__`` takes a node out and puts it back
    around every attribute it sets, so this sees an edit of a node's target or arguments
    without a pass over every node (a check comparing every node's fields costs 0.23 ms on
    1,740 nodes, 1.3 ms on 4,960; this, 2-4 us)."""

    def remove(self, node: torch.fx.Node) -> None:
        self.before.setdefault(node, node_fields([node])[0])
        super().remove(node)


@contextmanager
def edited_fields(graph: torch.fx.Graph, exact: bool = False) -> Iterator[Callable[[], bool]]:
    """Inside the block, watch ``graph``'s nodes; yields a function telling (after the block)
    whether a node's fields (:func:`node_fields`) differ from before it. Nodes added, removed
    or reordered are not its business. ``exact`` compares every node's fields instead, which
    also sees a write bypassing ``Node.__setattr__`` (so does a block inside another's)."""
    table = graph._find_nodes_lookup_table
    if exact or type(table) is not _Table:
        nodes = list(graph.nodes)
        fields = node_fields(nodes)
        yield lambda: not equal(node_fields(nodes), fields)
        return
    watch = _Watch.__new__(_Watch)
    watch.__dict__.update(vars(table), before={})
    graph._find_nodes_lookup_table = watch
    try:
        yield lambda: any(not equal(node_fields([n])[0], old) for n, old in watch.before.items())
    finally:
        graph._find_nodes_lookup_table = table  # the watch's state is the table's own dicts


def equal(a: Any, b: Any) -> bool:
    """``a == b`` (lists compare in C, identity first); values that cannot compare (fake
    tensors, whose truth value is undefined) are not equal."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. a replaced fake tensor: counted as a change
        return False


def _signature_token(program: Any) -> tuple:
    if not isinstance(program, ExportedProgram):
        return tuple([(name, tuple(m._buffers), tuple(m._parameters))
                      for name, m in modules_of(program)])
    signature = program.graph_signature
    # The argument's name, or (an argument without one) its repr, rendered only then.
    specs = [(s.kind, s.arg.name if hasattr(s.arg, "name") else repr(s.arg), s.target)
             for s in (*signature.input_specs, *signature.output_specs)]
    return tuple(specs), tuple(program.state_dict), tuple(program.constants)


class _Measure:
    """One measurement of a program's graph: its nodes, then (when first asked for) their
    fields, their fake values and the program's signature token."""

    def __init__(self, graph: torch.fx.Graph, nodes: list | None = None,
                 fields: list | None = None):
        self.graph = graph
        self.nodes = list(graph.nodes) if nodes is None else nodes
        self._parts = None if fields is None else [fields, None, None]

    def parts(self, program: Any) -> tuple:
        parts = self._parts = self._parts or [node_fields(self.nodes), None, None]
        if parts[1] is None:
            parts[1] = [n.meta.get("val") for n in self.nodes]
            parts[2] = _signature_token(program)
        return tuple(parts)


# The measurement of the graph the manager declared unchanged (see ``unchanged``).
_UNCHANGED: ContextVar[_Measure | None] = ContextVar("unchanged_graph", default=None)


@contextmanager
def unchanged(graph: torch.fx.Graph, nodes: list | None = None,
              fields: list | None = None) -> Iterator[None]:
    """Declare that ``graph`` (and its program) does not change inside the block: stamps
    made or matched inside share one measurement of it. The core loop wraps its condition
    checks in this, passing the nodes and their fields (:func:`node_fields`) its rollback
    record has just taken; without them they are measured once, when first needed."""
    token = _UNCHANGED.set(_Measure(graph, nodes, fields))
    try:
        yield
    finally:
        _UNCHANGED.reset(token)


def _measure(program: Any) -> _Measure:
    graph = graph_module_of(program).graph
    shared = _UNCHANGED.get()
    return shared if shared is not None and shared.graph is graph else _Measure(graph)


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

    __slots__ = ("_depends", "_extra", "_graph", "_nodes", "_parts")

    def __init__(self, program: Any, depends: Callable[[Any], Any] | None = None):
        measure = _measure(program)
        self._graph = measure.graph
        self._nodes = measure.nodes
        self._parts = measure.parts(program)
        self._depends = depends
        self._extra = depends(program) if depends is not None else None

    def matches(self, program: Any) -> bool:
        measure = _measure(program)
        return (
            measure.graph is self._graph
            and measure.nodes == self._nodes  # Node equality is identity: a C loop
            and equal(measure.parts(program), self._parts)
            and (self._depends is None or self._depends(program) == self._extra)
        )


def cached(program: Any, key: str, compute: Callable[[Any], T],
           depends: Callable[[Any], Any] | None = None) -> T:
    """``compute(program)``, or the value computed earlier if its stamp still matches.

    ``depends(program)`` (optional) returns a token of what else the analysis reads
    (node meta, tensor data; wrap objects in :class:`Same` to compare them by identity):
    the cached value is reused only while it compares equal.
    """
    entries = _cache.setdefault(graph_module_of(program), {})
    hit = entries.get(key)
    if hit is not None and hit[0].matches(program):
        return hit[1]
    stamp = Stamp(program, depends)
    value = compute(program)
    entries[key] = (stamp, value)
    return value
