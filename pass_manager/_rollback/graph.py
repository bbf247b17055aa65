"""A graph module's nodes and meta as a rollback record holds them.

Nodes, their fields and their meta entries are held by reference and compared by identity
in C loops; only the mutable objects a pass may edit in place (dicts, lists, sets, mutable
dataclasses such as a quantization annotation) are copied, and only when asked. A graph is
rebuilt from the records only to restore it or to print it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..analysis import equal, node_fields

__all__ = ["MISSING", "GraphRecord"]

MISSING = object()

# Kept by reference: immutable values, and objects a pass replaces but does not edit.
# (torch._C.TensorBase: every tensor, checked without torch.Tensor's slower Python instance check.)
_IMMUTABLE = (
    str, int, float, bool, tuple, frozenset, type(None), torch._C.TensorBase, torch.fx.Node,
    pytree.TreeSpec,
)
# Meta entries of values or provenance: passes replace them, never edit them in place, so
# they are kept by reference (copying every node's module stacks cost most of a record).
_SHARED_META = frozenset({
    "val", "nn_module_stack", "source_fn_stack", "fwd_nn_module_stack", "fwd_source_fn_stack",
    "tensor_meta", "example_value", "stack_trace", "from_node", "seq_nr", "torch_fn",
    "original_aten", "unbacked_bindings",
})


@functools.cache
def _mutable_fields(cls: type) -> tuple[str, ...] | None:
    """The field names of a mutable dataclass; None for any other type (a frozen
    dataclass, such as a quantization spec, cannot be edited in place: kept by reference)."""
    params = getattr(cls, "__dataclass_params__", None)
    mutable = params is not None and not params.frozen and cls is not type
    return tuple(f.name for f in dataclasses.fields(cls)) if mutable else None


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, set)) or _mutable_fields(type(value)) is not None


def copy_value(value: Any, depth: int = 0) -> Any:
    """Copy containers and mutable dataclasses; keep everything else by reference."""
    if depth > 4 or isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, dict):
        if all(isinstance(v, _IMMUTABLE) or not _is_container(v) for v in value.values()):
            return value.copy()  # nothing in it to copy
        return type(value)((k, copy_value(v, depth + 1)) for k, v in value.items())
    if isinstance(value, list):
        return [copy_value(v, depth + 1) for v in value]
    if isinstance(value, set):
        return set(value)
    names = _mutable_fields(type(value))
    if names is None:
        return value
    if hasattr(value, "__dict__"):  # a shallow copy without copy.copy's overhead
        clone = object.__new__(type(value))
        clone.__dict__.update(value.__dict__)
    else:
        clone = copy.copy(value)
    for name in names:
        field_value = getattr(value, name, MISSING)
        if field_value is not MISSING and not isinstance(field_value, _IMMUTABLE):
            object.__setattr__(clone, name, copy_value(field_value, depth + 1))
    return clone


def same(value: Any, recorded: Any, depth: int = 0) -> bool:
    """Whether ``value`` still equals the copy ``recorded`` (identity first, then structure)."""
    if value is recorded:
        return True
    if type(value) is not type(recorded) or depth > 4:
        return False
    if isinstance(value, dict):
        if len(value) != len(recorded):
            return False
        # Fast path (C loops): same keys, same objects in the same order.
        if all(map(operator.is_, value.values(), recorded.values())):
            return list(value) == list(recorded)
        return all(same(v, recorded.get(k, MISSING), depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return len(value) == len(recorded) and all(map(same, value, recorded,
                                                       itertools.repeat(depth + 1)))
    if isinstance(value, set):
        return value == recorded
    names = _mutable_fields(type(value))
    if names is not None:
        return all(same(getattr(value, n, MISSING), getattr(recorded, n, MISSING), depth + 1)
                   for n in names)
    if isinstance(value, (torch._C.TensorBase, torch.fx.Node)):
        return False
    return equal(value, recorded)  # an object that cannot compare counts as changed


def _entries(metas: list[dict], key: str) -> list[Any]:
    """Each meta's entry ``key`` (MISSING where absent), by reference."""
    try:  # dict.get mapped in C: a third of methodcaller's cost, which looks the method up
        return list(map(dict.get, metas, itertools.repeat(key), itertools.repeat(MISSING)))
    except TypeError:  # a meta that is some other mapping
        return [meta.get(key, MISSING) for meta in metas]


def _put_back(metas: list[dict], entries: dict[str, list]) -> None:
    for key, values in entries.items():
        for meta, value in zip(metas, values, strict=True):
            if value is MISSING:
                meta.pop(key, None)
            else:
                meta[key] = value


class GraphRecord:
    """A graph module's nodes as plain records, its meta and its nodes' meta.

    Per node: the node, its fields and a shallow copy of its meta; with ``meta_keys`` (the
    only keys a pass may change on existing nodes), the live meta dicts and only those
    entries. With ``copy_values``, also copies of the mutable objects the metas hold, but
    for the value and provenance entries passes replace (``_SHARED_META``), unless
    ``copy_shared`` (``strict``: an in-place edit of a module stack is restored and named too).
    """

    def __init__(self, gm: torch.fx.GraphModule, copy_values: bool,
                 meta_keys: frozenset[str] | None, copy_shared: bool = False):
        graph = gm.graph
        self.gm = gm
        self.graph = graph
        self.after: tuple[list, list] | None = None  # the nodes and fields compared last
        self._tracer_cls = graph._tracer_cls
        self._codegen = copy.copy(graph._codegen)
        self.nodes = nodes = list(graph.nodes)
        self.fields = node_fields(nodes)
        metas = [n.meta for n in nodes]
        self.entries: dict[str, list] | None = None
        if meta_keys is None:
            self.metas = list(map(dict.copy, metas))
        else:
            self.metas = metas
            self.entries = {key: _entries(metas, key) for key in meta_keys}
        # Most nodes hold only shared entries (values, provenance): nothing to copy.
        shared = frozenset() if copy_shared else _SHARED_META
        self._copies = {
            i: {k: copy_value(v) for k, v in n.meta.items() if k not in shared
                and _is_container(v) and (meta_keys is None or k in meta_keys)}
            for i, n in enumerate(nodes) if not shared.issuperset(n.meta)
        } if copy_values else {}
        self.gm_meta = dict(gm.meta)
        self._gm_copies = {k: copy_value(v) for k, v in gm.meta.items()
                           if _is_container(v)} if copy_values else {}

    def nodes_changed(self, graph: torch.fx.Graph) -> bool:
        """Nodes added, removed or reordered, or the graph replaced (not their fields)."""
        return graph is not self.graph or list(graph.nodes) != self.nodes  # identity: a C loop

    def structure_changed(self, graph: torch.fx.Graph) -> bool:
        """Nodes, their fields or the code generator changed: the code needs a recompile."""
        if self.nodes_changed(graph) or graph._codegen.__dict__ != self._codegen.__dict__:
            return True
        current = node_fields(self.nodes)  # the graph's nodes, the very objects recorded
        self.after = (self.nodes, current)
        # Equal values assigned anew (``node.args = tuple(node.args)``) are no change: the
        # records compare field by field, identity first.
        return not equal(current, self.fields)

    def module_meta_changed(self) -> bool:
        meta = self.gm.meta
        return not equal(meta, self.gm_meta) or not all(
            same(meta.get(k, MISSING), c) for k, c in self._gm_copies.items())

    def meta_changed(self) -> bool:
        """Any node's meta or the graph module's meta changed (the nodes being the same)."""
        nodes = self.nodes
        if self.entries is not None:
            if not all(map(operator.is_, map(operator.attrgetter("meta"), nodes), self.metas)):
                return True  # a node's meta dict replaced
            if any(_entries(self.metas, k) != v for k, v in self.entries.items()):
                return True
        elif not equal([n.meta for n in nodes], self.metas):
            return True
        return self.module_meta_changed() or not all(
            same(nodes[i].meta.get(k, MISSING), c)
            for i, copies in self._copies.items() for k, c in copies.items()
        )

    def edited_in_place(self) -> list[str]:
        """``node: key`` of each meta object (as it was before) whose contents changed."""
        metas = self._recorded_metas()
        return [
            f"{self.nodes[i].name}: meta[{k!r}]"
            for i, copies in self._copies.items() for k, c in copies.items()
            if not same(metas[i].get(k, MISSING), c)
        ] + [f"graph module meta[{k!r}]" for k, c in self._gm_copies.items()
             if not same(self.gm_meta[k], c)]

    def other_meta_edits(self, keys: frozenset[str], present: set | None) -> list[str]:
        """Nodes (of those ``present``, if given) whose meta changed outside ``keys``."""
        found = []
        for node, recorded in zip(self.nodes, self.metas, strict=True):
            if present is not None and node not in present:
                continue
            now = node.meta
            if any(now.get(k, MISSING) is not recorded.get(k, MISSING)
                   for k in (now.keys() | recorded.keys()) - keys):
                found.append(f"{node.name}: meta keys other than {sorted(keys)}")
        return found

    def _recorded_metas(self) -> list[dict]:
        """Each node's meta as recorded (with ``meta_keys``: copies of the live dicts with
        the recorded entries put back)."""
        if self.entries is None:
            return self.metas
        metas = list(map(dict.copy, self.metas))
        _put_back(metas, self.entries)
        return metas

    def rebuild(self) -> torch.fx.Graph:
        """A new graph of the recorded nodes, fields and (copies of their) meta."""
        graph = torch.fx.Graph(tracer_cls=self._tracer_cls)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for i, (old, (name, op, target, args, kwargs, type_), items) in enumerate(
            zip(self.nodes, self.fields, self._recorded_metas(), strict=True)
        ):
            new = graph.create_node(
                op, target, torch.fx.node.map_arg(args, env.__getitem__),
                torch.fx.node.map_arg(kwargs, env.__getitem__), name=name, type_expr=type_,
            )
            # The graph's namespace renames a name Python reserves (torch.export names an
            # input ``list`` or ``input``): the recorded name is put back as torch.export
            # sets it, else signatures naming it no longer find it.
            new.name = name
            new.meta = dict(items)  # a copy: the record may be restored again
            for key, recorded in self._copies.get(i, {}).items():
                # An object the pass did not edit stays itself (nodes may share it).
                original = items.get(key, MISSING)
                if not same(original, recorded):
                    new.meta[key] = copy_value(recorded)
            env[old] = new
        graph._codegen = copy.copy(self._codegen)
        return graph

    def restore(self, rebuild: bool) -> None:
        """Put the metas back; rebuild the graph if asked or if its nodes or their fields
        changed."""
        gm = self.gm
        rebuild = rebuild or self.structure_changed(gm.graph)  # fields: an instrument's edit
        if self.entries is not None:  # the live dicts: each back on its node, as recorded
            for node, meta in zip(self.nodes, self.metas, strict=True):
                if node.meta is not meta:
                    node.meta = meta
            _put_back(self.metas, self.entries)
        gm.meta.clear()
        gm.meta.update(self.gm_meta)
        gm.meta.update((k, copy_value(v)) for k, v in self._gm_copies.items())
        if rebuild:  # after the metas: the rebuilt nodes get copies of them as restored
            gm.graph = self.rebuild()
            gm.recompile()
