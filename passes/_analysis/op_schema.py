"""What an operator's schema says about its arguments: which it writes, which its results
alias, read once per operator (``Tensor(a!)`` = written, ``Tensor(a)`` = aliased).

Also the ATen op behind an ExecuTorch Edge op (:func:`aten_op`, :func:`target_of`), so the
same facts hold after ``to_edge``, and the sets of ops that need more than their schema
(views only sometimes, views addressed in storage, hidden writes). :mod:`passes._analysis.aliasing`
builds the storage roots of a graph's values from these facts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

__all__ = [
    "DROPOUTS",
    "ELEMENT_VIEWS",
    "HIDDEN_WRITES",
    "MAYBE_VIEWS",
    "METADATA_QUERIES",
    "NO_WRITE_UNLESS",
    "STORAGE_READERS",
    "STORAGE_VIEWS",
    "UNANNOTATED_LIST_VIEWS",
    "OpFacts",
    "argument_value",
    "aten_op",
    "facts_of",
    "in_dialect_of",
    "is_maybe_view",
    "may_write",
    "schema_of",
    "shared_input",
    "shares_storage",
    "target_of",
    "view_base_index",
    "written_arguments",
    "written_nodes",
]


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
DROPOUTS = frozenset({_aten.dropout.default, _aten.feature_dropout.default,
                       _aten.alpha_dropout.default, _aten.feature_alpha_dropout.default})
UNANNOTATED_LIST_VIEWS = frozenset({
    _aten.unsafe_split.Tensor, _aten.unsafe_split_with_sizes.default, _aten.unsafe_chunk.default,
})
"""Ops returning views of their first argument, as ``split`` / ``split_with_sizes`` /
``chunk`` do (``unsafe`` only for autograd), though their schema declares no alias."""
ELEMENT_VIEWS = frozenset({
    _aten.broadcast_tensors.default, _aten.meshgrid.default, _aten.meshgrid.indexing,
    _aten.atleast_1d.Sequence, _aten.atleast_2d.Sequence, _aten.atleast_3d.Sequence,
})
"""Ops taking a list of tensors whose i-th result is a view of the i-th (expanded or
reshaped), though their schema declares no alias: a write through a result writes that
input, and a result read after a write to its input reads the new value."""
UNANNOTATED_MAYBE_VIEWS = frozenset({
    _aten.type_as.default, _aten.sum_to_size.default, _aten.atleast_1d.default,
    _aten.atleast_2d.default, _aten.atleast_3d.default, *DROPOUTS,
})
"""Ops whose schema declares no alias but that return ``self`` (or a view of it) when
they have nothing to do (any other CompositeImplicitAutograd op declaring no alias is
read as a view of the tensor argument, or tensor list element, whose storage its fake
value shares, see ``OpFacts.self_if_shared`` and :func:`shared_input`): ``type_as`` of
the same dtype, ``atleast_2d`` of a 2-D tensor, a dropout with ``train=False`` or
``p=0``. Eager writes through such a result write ``self``; read as views of their first
argument when they share its storage."""
MAYBE_VIEWS = frozenset({
    _aten.reshape.default, _aten.reshape_as.default, _aten.flatten.using_ints,
    _aten.to.dtype, _aten.to.device, _aten.to.dtype_layout, _aten.to.other,
    _aten.contiguous.default, *UNANNOTATED_MAYBE_VIEWS,
})
"""Ops that return a view only sometimes (a copy otherwise), named. Every other op whose
schema says its result aliases an argument and that is CompositeImplicitAutograd is one too
(:func:`is_maybe_view`): its schema only says what its decomposition *may* do (``ravel`` of
a non-contiguous tensor, ``resolve_conj`` of a conjugated one return copies)."""


def _composite(op: torch._ops.OpOverload) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # an op the dispatcher does not know by that name
        return False

STORAGE_VIEWS = frozenset({_aten.as_strided.default, _aten._reshape_alias.default})
"""Views addressed in their input's *storage* (sizes, strides, an absolute offset), so
their value depends on elements outside their input: they are views of the storage root."""
STORAGE_READERS = frozenset({_aten.as_strided_copy.default})
"""Non-view ops that read their input's storage likewise."""
METADATA_QUERIES = frozenset({_aten.sym_stride.int, _aten.sym_storage_offset.default})
"""Ops reading a tensor's layout, which a write never changes, rather than its values."""


@dataclass(frozen=True)
class OpFacts:
    """What an operator's schema says about aliasing, computed once per overload."""

    schema: torch.FunctionSchema
    written: tuple[int, ...]  # indices of written arguments
    result_of: int | None  # the argument a single result aliases
    result_written: bool  # ... and whether that argument is written (an in-place op)
    list_views_of: int | None  # the argument a list of views aliases (split, unbind)
    results_alias: tuple[int | None, ...]  # per result of a multi-result op
    maybe_view: bool  # a view only sometimes: see MAYBE_VIEWS
    element_views: bool  # result i is a view of list element i: see ELEMENT_VIEWS
    # A composite op declaring no alias: a view of the tensor argument (or element of a
    # tensor list argument) whose storage its fake value shares (``to_dense`` of a strided
    # tensor returns ``self``; ``einsum("ij->ji", [b])`` a transpose of ``b``, and
    # ``cartesian_prod([v])`` ``v`` itself): see :func:`shared_input`.
    self_if_shared: bool
    hidden_writes: tuple[int, tuple[int, ...]] | None  # an entry of HIDDEN_WRITES
    no_write_unless: int | None  # an entry of NO_WRITE_UNLESS
    fresh: bool  # no result aliases an argument: the op's value is new storage
    may_write: bool  # writes an argument (annotated or hidden), read from the schema


@functools.cache
def _facts(op: torch._ops.OpOverload) -> OpFacts:
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
    if op in UNANNOTATED_LIST_VIEWS:
        list_views_of = 0
    results_alias = tuple(aliased_by(r.alias_info) for r in schema.returns) if len(
        schema.returns) > 1 else ()
    written = tuple(i for i, a in enumerate(args)
                    if a.alias_info is not None and a.alias_info.is_write)
    tensor = torch._C.TensorType.get()
    self_if_shared = (
        result_of is None and list_views_of is None and not written
        and op not in ELEMENT_VIEWS and len(schema.returns) == 1
        and schema.returns[0].type == tensor and bool(_tensor_arguments(schema))
        and _composite(op))
    return OpFacts(
        schema=schema,
        written=written,
        result_of=result_of,
        result_written=result_of is not None and args[result_of].alias_info is not None
        and args[result_of].alias_info.is_write,
        list_views_of=list_views_of,
        results_alias=results_alias,
        maybe_view=op in MAYBE_VIEWS or self_if_shared or (
            result_of is not None and args[result_of].alias_info is not None
            and not args[result_of].alias_info.is_write and _composite(op)),
        hidden_writes=HIDDEN_WRITES.get(op),
        no_write_unless=NO_WRITE_UNLESS.get(op),
        element_views=op in ELEMENT_VIEWS,
        self_if_shared=self_if_shared,
        fresh=result_of is None and list_views_of is None and op not in ELEMENT_VIEWS
        and not self_if_shared and all(i is None for i in results_alias),
        may_write=bool(written) or op in HIDDEN_WRITES,
    )


_TENSOR_LIST = torch._C.ListType(torch._C.TensorType.get())


def _tensor_arguments(schema: torch.FunctionSchema) -> tuple[tuple[int, bool], ...]:
    """``(index, is a list)`` of each argument taking a tensor or a list of tensors."""
    tensor = torch._C.TensorType.get()
    return tuple((i, a.type == _TENSOR_LIST) for i, a in enumerate(schema.arguments)
                 if a.type == tensor or a.type == _TENSOR_LIST)


# Facts by the operator's id: an OpOverload hashes in Python, and the scans ask for the
# facts of every node several times. The op itself is kept so that its id stays its own.
_FACTS_BY_ID: dict[int, tuple[torch._ops.OpOverload, OpFacts]] = {}


def facts_of(node: Node) -> OpFacts | None:
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
    facts = facts_of(node)
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
    facts = facts_of(node)
    return facts is not None and facts.may_write


def written_nodes(node: Node) -> list[Node]:
    return [n for _, n in written_arguments(node)]


def is_maybe_view(node: Node) -> bool:
    """Whether the node's op returns a view of an argument only sometimes (see
    :data:`MAYBE_VIEWS`): whether it did is read from storage sharing of fake values."""
    facts = facts_of(node)
    return facts is not None and facts.maybe_view


def shares_storage(a: Node, b: Node) -> bool | None:
    """Whether the fake values of two nodes share storage; None when one has none."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return None
    try:  # the storages' C pointers, as StorageWeakRef compares them, without weak refs
        return va.untyped_storage()._cdata == vb.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def shared_input(node: Node) -> tuple[int, int | None, Node] | None:
    """For a composite op declaring no alias (``OpFacts.self_if_shared``): the input its
    result is a view of, read from storage sharing of fake values, as ``(schema index,
    position in that list argument or None, the input's node)``; None when it shares no
    input's storage (a copy). ``einsum`` takes its operands as a list after the equation,
    so the viewed input need not be the first argument."""
    facts = facts_of(node)
    if facts is None or not facts.self_if_shared:
        return None
    for index, is_list in _tensor_arguments(facts.schema):
        value = argument_value(node, facts.schema, index)
        items = list(enumerate(value)) if is_list and isinstance(value, (list, tuple)) else (
            [(None, value)])
        for position, item in items:
            if isinstance(item, Node) and shares_storage(node, item) is True:
                return index, position, item
    return None


def view_base_index(node: Node) -> int | None:
    """The schema index of the argument a view op's result(s) may alias, from the schema
    (for an op declaring no alias but returning an input, from storage sharing)."""
    facts = facts_of(node)
    if facts is None or facts.result_written:
        return None
    if facts.self_if_shared:
        shared = shared_input(node)
        return None if shared is None else shared[0]
    return facts.result_of if facts.result_of is not None else facts.list_views_of
