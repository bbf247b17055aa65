"""Metadata mutations (``unsqueeze_``, ``t_``, ``as_strided_``, ``resize_``, ``set_``)
turned into the views, renames or fresh values they amount to, before the rewrite.

An in-place metadata change gives the *tensor object* new sizes, strides or storage; every
later use of that object (the op's result, and the nodes naming the object before it)
then reads it with the new metadata. As a value, that is a view of what the object held:
``t.unsqueeze_(0)`` is ``unsqueeze(t, 0)``, ``t.as_strided_(...)`` is ``as_strided(t,
...)``, ``t.resize_(size)`` within the storage is ``as_strided(t, size, contiguous
strides)``; ``t.set_(src)`` makes it ``alias(src)``. Written that way, later writes go
through the ordinary view write-backs, and views taken before the change keep reading the
same storage. A ``resize_`` growing past the storage is a fresh ``resize`` (torch's own
functional form) when nothing else views that storage.

Program state (a user input or buffer itself) is different: its caller keeps the changed
object. When its shape is unchanged in the end (``transpose_`` of a square input,
``resize_`` to its own size) the rewrite writes back its logical value, as torch's
functionalization does; otherwise a mutation output cannot carry it and the node is left
for the rewrite to refuse (torch fails there too: export or ``run_decompositions`` raises,
or its program fails when called).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node, map_arg

from .._analysis.aliasing import aliased_argument
from .._analysis.buffers import CONSTANT, PARAMETER, State, state_nodes
from .._analysis.fake_values import FakeValues, same_static_layout
from .._analysis.op_schema import (
    argument_value,
    in_dialect_of,
    may_write,
    target_of,
    view_base_index,
)
from ..functional_variants import METADATA_VIEWS

__all__ = ["METADATA_MUTATIONS", "MetadataMutations", "normalize_metadata_mutations"]

aten = torch.ops.aten
_SET = aten.set_.source_Tensor
_SET_AT = aten.set_.source_Tensor_storage_offset
_RESIZES = frozenset({aten.resize_.default, aten.resize_as_.default})
METADATA_MUTATIONS = frozenset({*METADATA_VIEWS, *_RESIZES, aten.as_strided_.default, _SET,
                                _SET_AT})
"""The metadata mutations this module rewrites."""


@dataclass
class MetadataMutations:
    """What the normalization changed and found.

    Attributes:
        dead: the metadata mutations it replaced (erased on the Rewrite's commit).
        forms: each of them -> the node now holding its value.
        state_views: program state whose object ends with new strides but its own shape:
            state node -> the node holding the object's last form (its logical value).
        refused: metadata mutations left in the graph -> why they cannot be rewritten.
    """

    dead: list[Node] = field(default_factory=list)
    forms: dict[Node, Node] = field(default_factory=dict)
    state_views: dict[Node, Node] = field(default_factory=dict)
    refused: dict[Node, str] = field(default_factory=dict)


def normalize_metadata_mutations(program: Any, gm: GraphModule, fake: FakeValues,
                                 candidates: list[Node] | None = None) -> MetadataMutations:
    """Rewrite each metadata mutation of the program's graph ``gm`` into the value it
    amounts to, inferring the fake values of new nodes with ``fake``. ``candidates``: the
    graph's nodes that may write, in graph order (the scan's ``Mutations.candidates``), to
    look at instead of every node."""
    log = MetadataMutations()
    nodes = [n for n in (gm.graph.nodes if candidates is None else candidates)
             if may_write(n) and target_of(n) in METADATA_MUTATIONS]  # each writes its self
    if not nodes:
        return log
    states = state_nodes(program)
    first: dict[State, Node] = {}
    # Two get_attr nodes of one buffer denote one state: its first node stands for it.
    canonical = {node: first.setdefault(state, node) for node, state in states.items()}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    objects = _objects(gm.graph)
    by_object: dict[Node, list[Node]] = {}
    for node in nodes:
        by_object.setdefault(objects[node.args[0]], []).append(node)
    for obj, mutations in by_object.items():
        is_state = obj in canonical
        if is_state:
            reason = _state_reason(obj, mutations, states, canonical, order)
            if reason is not None:
                log.refused.update((m, reason) for m in mutations)
                continue
        for mutation in mutations:
            reason = _normalize(gm, mutation, objects, order, fake, log)
            if reason is not None:
                log.refused[mutation] = reason
                break
        else:
            if is_state and not same_static_layout(obj, log.forms[mutations[-1]]):
                log.state_views[canonical[obj]] = log.forms[mutations[-1]]
    return log


def _objects(graph: torch.fx.Graph) -> dict[Node, Node]:
    """Each node's tensor object: an in-place op's result is its written argument's."""
    objects: dict[Node, Node] = {}
    for node in graph.nodes:
        found = aliased_argument(node) if node.op == "call_function" else None
        objects[node] = objects.get(found[1], found[1]) if found and found[2] else node
    return objects


def _restores_itself(obj: Node, mutations: list[Node], order: dict[Node, int]) -> bool:
    """Whether the last of the mutations is ``set_`` back to the state itself: an alias of
    it taken before the first mutation (``a_old = alias(a); a.set_(b); a.set_(a_old)``), so
    the object ends as it began and is only renamed in between, as torch functionalizes it."""
    last = mutations[-1]
    if target_of(last) is not _SET:
        return False
    source = argument_value(last, _SET._schema, 1)
    while isinstance(source, Node) and target_of(source) in (
            aten.alias.default, aten.detach.default) and order[source] < order[mutations[0]]:
        source = source.args[0]
    return source is obj and same_static_layout(obj, argument_value(last, _SET._schema, 1))


def _state_reason(obj: Node, mutations: list[Node], states: dict[Node, State],
                  canonical: dict[Node, Node], order: dict[Node, int]) -> str | None:
    """Why the metadata change of a user input or buffer cannot be expressed, or None."""
    before, after = obj.meta.get("val"), mutations[-1].meta.get("val")
    if states[obj].kind in (PARAMETER, CONSTANT):
        return f"it changes the {states[obj].kind} {states[obj].name!r}"
    if sum(1 for n in canonical if canonical[n] is canonical[obj]) > 1:
        return f"it changes the metadata of {obj.name}, which the graph reads by several nodes"
    if any(target_of(m) in (_SET, _SET_AT) for m in mutations) and not _restores_itself(
            obj, mutations, order):
        return (f"it makes the program state {obj.name} another tensor; torch's "
                "functionalization refuses set_ on graph inputs as well")
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return f"it changes the metadata of the program state {obj.name}, with no fake values"
    if not _known_equal(before.shape, after.shape) or before.dtype != after.dtype:
        return (f"it changes the shape of the program state {obj.name} from "
                f"{tuple(before.shape)} to {tuple(after.shape)}: a mutation output only "
                "carries new values of its shape, and torch's functionalization fails here "
                "too (export or run_decompositions raises, or its program fails when called)")
    return None


def _known_equal(a: torch.Size, b: torch.Size) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(
        x == y if isinstance(x == y, bool) else statically_known_true(x == y)
        for x, y in zip(a, b, strict=True))


def _normalize(gm: GraphModule, mutation: Node, objects: dict[Node, Node],
               order: dict[Node, int], fake: FakeValues, log: MetadataMutations) -> str | None:
    """Replace one metadata mutation by its value; None when done, else why not."""
    target = target_of(mutation)
    schema = target._schema
    args = [argument_value(mutation, schema, i) for i in range(len(schema.arguments))]
    source = args[0]
    if target in METADATA_VIEWS:
        new = (METADATA_VIEWS[target], (source, *args[1:]))
    elif target is aten.as_strided_.default:
        new = (aten.as_strided.default, (source, *args[1:]))
    elif target is _SET:
        # Another tensor object sharing the source's storage and metadata: a later metadata
        # change of it leaves the source as it is.
        new = (aten.alias.default, (args[1],))
    elif target is _SET_AT:
        _, src, offset, size, stride = args
        if not stride:
            stride = _contiguous_strides(size)
        new = (aten.as_strided.default, (src, size, stride, offset))
    else:  # resize_, resize_as_
        size = args[1]
        if target is aten.resize_as_.default:
            template = size.meta.get("val") if isinstance(size, Node) else None
            if not isinstance(template, torch.Tensor):
                return "resize_as_ to a template with no fake value"
            size = list(template.shape)
        if args[2] not in (None, torch.contiguous_format):
            return f"{target} with memory_format={args[2]}"
        fits = _fits(source, size, objects)
        if fits is None:
            return (f"{target} may grow the storage of {source.name}, whose size is not known "
                    "(a view, or symbolic sizes); torch refuses to grow a view as well")
        val = source.meta.get("val")
        if fits and isinstance(val, torch.Tensor) and val.is_contiguous() and (
            list(val.shape) == list(size)
        ):  # to its own size: no change, and no storage view (they restrict the rewrite)
            new = (aten.alias.default, (source,))
        elif fits:
            new = (aten.as_strided.default, (source, size, _contiguous_strides(size)))
        else:
            reason = _viewed(source, mutation, objects, order)
            if reason is not None:
                return f"{target} grows the storage of {source.name}, {reason}"
            new = (aten.resize.default, (source, size))
    if isinstance(new, tuple):
        with gm.graph.inserting_before(mutation):
            node = gm.graph.call_function(in_dialect_of(mutation, new[0]), new[1])
        node.meta.update((k, v) for k, v in mutation.meta.items()
                         if k not in ("val", "tensor_meta"))
        fake.infer(node)
        new = node
        order[node] = order[mutation] - 0.5  # placed right before the mutation
    log.forms[mutation] = new
    obj = objects[source]
    # The op's result and every later use of the object read the new form.
    for old in [n for n, o in objects.items() if o is obj and order[n] < order[mutation]]:
        for user in list(old.users):
            if user is mutation or order.get(user, -1) <= order[mutation]:
                continue
            user.args, user.kwargs = map_arg(
                (user.args, user.kwargs), lambda a, old=old: new if a is old else a)
    for user in list(mutation.users):
        user.args, user.kwargs = map_arg(
            (user.args, user.kwargs), lambda a: new if a is mutation else a)
    objects.setdefault(new, new)
    for n, o in list(objects.items()):  # later in-place results now extend the new object
        if o is obj and order[n] > order[mutation]:
            objects[n] = objects[new]
    objects[mutation] = objects[new]
    log.dead.append(mutation)
    return None


def _contiguous_strides(size: list) -> list:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step = step * s
    return strides[::-1]


def _fits(node: Node, size: list, objects: dict[Node, Node]) -> bool | None:
    """Whether ``size`` elements (contiguous) from the tensor's offset fit in its storage;
    None when that is not known. A fake tensor's storage has the size of its last resize
    during tracing, so it is not asked: a contiguous fresh allocation holds exactly its
    elements, and any contiguous tensor at least its own."""
    val, obj = node.meta.get("val"), objects[node]
    first = obj.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(first, torch.Tensor):
        return None
    numel = 1
    for s in size:
        numel = numel * s
    need = val.storage_offset() + numel
    if not all(isinstance(x, int) for x in (need, val.numel(), first.numel())):
        return None
    fresh = obj.op == "call_function" and aliased_argument(obj) is None and (
        view_base_index(obj) is None and first.is_contiguous() and val.is_contiguous())
    if fresh:
        return need <= first.numel()
    return True if numel <= val.numel() and val.is_contiguous() else None


def _viewed(node: Node, mutation: Node, objects: dict[Node, Node],
            order: dict[Node, float]) -> str | None:
    """Why a grown storage would not be a fresh value: ``node`` is a view, or views of its
    storage were taken before (they would share the grown storage)."""
    obj = objects[node]
    if view_base_index(obj) is not None or obj.op != "call_function":
        return f"and {obj.name} is a view or program state"
    for member in [n for n, o in objects.items() if o is obj]:
        for user in member.users:
            if view_base_index(user) is not None and order.get(user, -1) < order[mutation]:
                return f"which {user.name} views"
    return None
