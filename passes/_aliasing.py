"""Which tensors of an FX graph share storage, and which nodes write to their arguments.

Everything here is read from operator schemas (``Tensor(a!)`` = written, ``Tensor(a)`` =
aliased) and, for ops that only *may* return a view (``reshape``, ``to``, ``contiguous``),
from the storages of the fake tensors in ``node.meta["val"]``. Nothing runs the program.

A value's :class:`Alias` is its storage root (a node producing fresh memory, or the
canonical node of a buffer/input) and the chain of view nodes leading from the root to it.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.fx import Node
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "HIDDEN_WRITES",
    "MAYBE_VIEWS",
    "METADATA_QUERIES",
    "NO_WRITE_UNLESS",
    "STORAGE_READERS",
    "STORAGE_VIEWS",
    "Alias",
    "OpaqueNode",
    "alias_map",
    "aliased_argument",
    "argument_value",
    "aten_op",
    "in_dialect_of",
    "list_view_argument",
    "may_write",
    "schema_of",
    "target_of",
    "view_base_index",
    "written_arguments",
    "written_nodes",
]


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


def aten_op(node: Node) -> torch._ops.OpOverload | None:
    """The ATen op a ``call_function`` node runs, also under a dialect that wraps it.

    ExecuTorch's Edge dialect calls ``EdgeOpOverload`` objects: not OpOverloads, but each
    holds the ATen op it runs in ``_op``, whose schema says what it writes and aliases.
    """
    if node.op != "call_function":
        return None
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        target = getattr(target, "_op", None)
    return target if isinstance(target, torch._ops.OpOverload) else None


def target_of(node: Node) -> Any:
    """What a node calls, an Edge-dialect op read as the ATen op it wraps: compare this,
    not ``node.target``, against sets of ATen ops, so programs after ``to_edge`` match."""
    target = node.target
    if node.op == "call_function" and not isinstance(target, torch._ops.OpOverload):
        wrapped = getattr(target, "_op", None)
        if isinstance(wrapped, torch._ops.OpOverload):
            return wrapped
    return target


def in_dialect_of(like: Node, target: Any) -> Any:
    """``target`` (an ATen op) as the dialect of ``like`` calls it: the Edge op wrapping it
    when ``like`` calls an Edge op, so a rewrite keeps an ExecuTorch program in its dialect."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" or (
        target_of(like) is like.target
    ):
        return target
    from executorch.exir.dialects._ops import ops as exir_ops  # only Edge programs get here

    return getattr(getattr(exir_ops.edge.aten, target._opname), target._overloadname)


def schema_of(node: Node) -> torch.FunctionSchema | None:
    op = aten_op(node)
    return None if op is None else op._schema


_aten = torch.ops.aten
_DROPOUTS = frozenset({_aten.dropout.default, _aten.feature_dropout.default,
                       _aten.alpha_dropout.default, _aten.feature_alpha_dropout.default})
UNANNOTATED_MAYBE_VIEWS = frozenset({
    _aten.type_as.default, _aten.sum_to_size.default, _aten.atleast_1d.default,
    _aten.atleast_2d.default, _aten.atleast_3d.default, *_DROPOUTS,
})
"""Ops whose schema declares no alias but that return ``self`` (or a view of it) when
they have nothing to do: ``type_as`` of the same dtype, ``atleast_2d`` of a 2-D tensor, a
dropout with ``train=False`` or ``p=0``. Eager writes through such a result write
``self``; read as views of their first argument when they share its storage."""
MAYBE_VIEWS = frozenset({
    _aten.reshape.default, _aten.reshape_as.default, _aten.flatten.using_ints,
    _aten.to.dtype, _aten.to.device, _aten.to.dtype_layout, _aten.to.other,
    _aten.contiguous.default, *UNANNOTATED_MAYBE_VIEWS,
})
"""Ops that return a view only sometimes (a copy otherwise)."""

STORAGE_VIEWS = frozenset({_aten.as_strided.default, _aten._reshape_alias.default})
"""Views addressed in their input's *storage* (sizes, strides, an absolute offset), so
their value depends on elements outside their input: they are views of the storage root."""
STORAGE_READERS = frozenset({_aten.as_strided_copy.default})
"""Non-view ops that read their input's storage likewise."""
METADATA_QUERIES = frozenset({_aten.sym_stride.int, _aten.sym_storage_offset.default})
"""Ops reading a tensor's layout, which a write never changes, rather than its values."""


@dataclass(frozen=True)
class _OpFacts:
    """What an operator's schema says about aliasing, computed once per overload."""

    schema: torch.FunctionSchema
    written: tuple[int, ...]  # indices of written arguments
    result_of: int | None  # the argument a single result aliases
    result_written: bool  # ... and whether that argument is written (an in-place op)
    list_views_of: int | None  # the argument a list of views aliases (split, unbind)
    results_alias: tuple[int | None, ...]  # per result of a multi-result op
    maybe_view: bool  # in MAYBE_VIEWS
    hidden_writes: tuple[int, tuple[int, ...]] | None  # an entry of HIDDEN_WRITES
    no_write_unless: int | None  # an entry of NO_WRITE_UNLESS
    fresh: bool  # no result aliases an argument: the op's value is new storage
    may_write: bool  # writes an argument (annotated or hidden), read from the schema


@functools.cache
def _facts(op: torch._ops.OpOverload) -> _OpFacts:
    schema = op._schema
    args = schema.arguments

    def aliased_by(info) -> int | None:
        if info is None or not info.before_set:
            return None
        return next((i for i, a in enumerate(args) if a.alias_info is not None
                     and a.alias_info.before_set & info.before_set), None)

    result_of = aliased_by(schema.returns[0].alias_info) if len(schema.returns) == 1 else None
    if op in UNANNOTATED_MAYBE_VIEWS:
        result_of = 0
    list_views_of = next((i for i, a in enumerate(args) if a.alias_info is not None
                          and "*" in a.alias_info.after_set and not a.alias_info.is_write), None)
    results_alias = tuple(aliased_by(r.alias_info) for r in schema.returns) if len(
        schema.returns) > 1 else ()
    written = tuple(i for i, a in enumerate(args)
                    if a.alias_info is not None and a.alias_info.is_write)
    return _OpFacts(
        schema=schema,
        written=written,
        result_of=result_of,
        result_written=result_of is not None and args[result_of].alias_info is not None
        and args[result_of].alias_info.is_write,
        list_views_of=list_views_of,
        results_alias=results_alias,
        maybe_view=op in MAYBE_VIEWS,
        hidden_writes=HIDDEN_WRITES.get(op),
        no_write_unless=NO_WRITE_UNLESS.get(op),
        fresh=result_of is None and list_views_of is None
        and all(i is None for i in results_alias),
        may_write=bool(written) or op in HIDDEN_WRITES,
    )


# Facts by the operator's id: an OpOverload hashes in Python, and the scans ask for the
# facts of every node several times. The op itself is kept so that its id stays its own.
_FACTS_BY_ID: dict[int, tuple[torch._ops.OpOverload, _OpFacts]] = {}


def _facts_of(node: Node) -> _OpFacts | None:
    if node.op != "call_function":
        return None
    target = node.target
    entry = _FACTS_BY_ID.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1]
    op = aten_op(node)  # also an Edge op's ATen op
    if op is None:
        return None
    facts = _facts(op)
    _FACTS_BY_ID[id(target)] = (target, facts)
    return facts


def argument_value(node: Node, schema: torch.FunctionSchema, i: int) -> Any:
    """The value bound to schema argument ``i`` (positional, keyword or default)."""
    name, kwarg_only, default = _arguments(schema)[i]
    if i < len(node.args) and not kwarg_only:
        return node.args[i]
    if name in node.kwargs:
        return node.kwargs[name]
    return list(default) if isinstance(default, list) else default


# (name, kwarg_only, default) of each argument, by the schema's id: ``schema.arguments``
# builds new Argument objects on every access. The schema is kept so its id stays its own.
_ARGUMENTS: dict[int, tuple[torch.FunctionSchema, tuple[tuple[str, bool, Any], ...]]] = {}


def _arguments(schema: torch.FunctionSchema) -> tuple[tuple[str, bool, Any], ...]:
    entry = _ARGUMENTS.get(id(schema))
    if entry is None or entry[0] is not schema:
        entry = (schema, tuple(
            (a.name, a.kwarg_only, a.default_value if a.has_default_value() else None)
            for a in schema.arguments))
        _ARGUMENTS[id(schema)] = entry
    return entry[1]


def _nodes_in(value) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, Node)]
    return []


HIDDEN_WRITES = {
    _aten.batch_norm.default: (5, (3, 4)),
    _aten.instance_norm.default: (5, (3, 4)),
    _aten.native_batch_norm.default: (5, (3, 4)),
    _aten._batch_norm_impl_index.default: (5, (3, 4)),
    _aten.cudnn_batch_norm.default: (5, (3, 4)),
    _aten.miopen_batch_norm.default: (5, (3, 4)),
}
"""Ops whose schema hides a write: with their training flag set they update the running
statistics they are given, though no argument is annotated ``(a!)``. op -> (index of the
training flag, indices written). torch's own export special-cases the same ops (it
force-decomposes ``native_batch_norm`` for its "wrong schema" and the CompositeImplicit ops
tagged ``maybe_aliasing_or_mutating``); functional_variants maps the first three to
``_native_batch_norm_legit_functional``, the backend-specific ones stay refused."""


NO_WRITE_UNLESS = {
    _aten.dropout_.default: 2,
    _aten.feature_dropout_.default: 2,
    _aten.alpha_dropout_.default: 2,
    _aten.feature_alpha_dropout_.default: 2,
}
"""In-place ops that leave their argument as it is when a flag is False (``dropout_(x, p,
train=False)``): op -> index of the flag. Like torch's functionalization, no write."""


def written_arguments(node: Node) -> list[tuple[int, Node]]:
    """``(schema argument index, node)`` for every tensor the node writes, in schema order."""
    facts = _facts_of(node)
    if facts is None:
        return []
    written = facts.written
    flag = facts.no_write_unless
    if flag is not None and argument_value(node, facts.schema, flag) is False:
        return []
    hidden = facts.hidden_writes
    if hidden is not None and argument_value(node, facts.schema, hidden[0]) is True:
        written = hidden[1]
    if not written:
        return []
    return [(i, n) for i in written for n in _nodes_in(argument_value(node, facts.schema, i))]


def may_write(node: Node) -> bool:
    """Whether the node's op may write an argument, read from its schema alone: False
    for most nodes, without binding any argument (a quick filter before
    :func:`written_arguments`). Higher-order ops are not covered (their subgraphs write)."""
    facts = _facts_of(node)
    return facts is not None and facts.may_write


def written_nodes(node: Node) -> list[Node]:
    return [n for _, n in written_arguments(node)]


def _shares_storage(a: Node, b: Node) -> bool | None:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return None
    try:
        return StorageWeakRef(va.untyped_storage()) == StorageWeakRef(vb.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def aliased_argument(node: Node) -> tuple[int, Node, bool] | None:
    """For an op whose single tensor result aliases an argument: (index, argument, written).

    ``written`` is True for an in-place op (the result *is* the written argument) and
    False for a view. Ops that only may alias (``reshape``, ``to``) count as views when the
    fake tensors say they share storage, or when there is no fake tensor to ask.
    """
    return _aliased(node, _facts_of(node))


def _aliased(node: Node, facts: _OpFacts | None) -> tuple[int, Node, bool] | None:
    if facts is None or facts.result_of is None:
        return None
    value = argument_value(node, facts.schema, facts.result_of)
    if not isinstance(value, Node):
        return None
    if facts.maybe_view and _shares_storage(node, value) is False and not (
            _dropout_is_identity(node)):
        return None
    return facts.result_of, value, facts.result_written


def _dropout_is_identity(node: Node) -> bool:
    """A dropout that returns its input itself (``train=False`` or ``p=0``); its fake
    result is a copy, so storage sharing does not tell."""
    if aten_op(node) not in _DROPOUTS:
        return False
    _, p, train = (argument_value(node, _aten.dropout.default._schema, i) for i in range(3))
    return train is False or (isinstance(p, (int, float)) and p == 0)


def list_view_argument(node: Node) -> int | None:
    """For a list-of-views op (split, unbind): the index of the argument it views."""
    facts = _facts_of(node)
    return None if facts is None else facts.list_views_of


def view_base_index(node: Node) -> int | None:
    """The schema index of the argument a view op's result(s) may alias, from the schema only."""
    facts = _facts_of(node)
    if facts is None or facts.result_written:
        return None
    return facts.result_of if facts.result_of is not None else facts.list_views_of


def _multi_alias(node: Node, facts: _OpFacts | None) -> tuple[str, list] | None:
    """Ops with several results aliasing arguments.

    ``("views", [arg])`` for list-of-views ops (split, unbind: ``Tensor(a -> *)``) and
    ``("returns", [arg or None per result])`` for tuple results that alias written args.
    """
    if facts is None:
        return None
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
        facts = _facts_of(node)
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
