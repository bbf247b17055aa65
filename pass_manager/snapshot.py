"""Snapshot: what a rollback needs, and the measure of whether a pass changed anything.

A snapshot is taken before every pass. It records the nodes (by reference, with a copy of
their meta's mutable containers), every module's attributes, every tensor's identity and
version counter (its data only when the pass declares ``writes_state``), the graph
module's meta and, for an ExportedProgram, its signature, state, constants and call
graph. After the pass, :meth:`Snapshot.compare` tells whether the structure changed
(a recompile is needed) and whether anything changed at all, by identity checks against
those records: no node is printed or hashed. :meth:`Snapshot.restore` undoes the pass.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature

from .program import graph_module_of

__all__ = ["Change", "Snapshot"]

# Meta entries that hold values or provenance: kept by reference (the meta dict itself
# is copied, so replacing them is still undone). Passes replace these, never edit them in
# place; copying the module stacks of every node was most of a snapshot's cost.
_SHARED_META = frozenset(
    {
        "val",
        "nn_module_stack",
        "source_fn_stack",
        "fwd_nn_module_stack",
        "fwd_source_fn_stack",
        "tensor_meta",
        "example_value",
        "stack_trace",
        "from_node",
        "seq_nr",
        "torch_fn",
        "original_aten",
        "unbacked_bindings",
    }
)
# Kept by reference: immutable values, and objects a pass replaces but does not edit.
_IMMUTABLE = (
    str, int, float, bool, tuple, frozenset, type(None), torch.Tensor, torch.fx.Node,
    pytree.TreeSpec,
)
_MISSING = object()


def _mutable_fields(value: Any) -> tuple[str, ...] | None:
    """The field names of a mutable dataclass instance; None for anything else (a frozen
    dataclass, such as a quantization spec, cannot be edited in place: kept by reference)."""
    cls = type(value)
    names = _FIELDS.get(cls, _MISSING)
    if names is _MISSING:
        params = getattr(cls, "__dataclass_params__", None)
        mutable = params is not None and not params.frozen and cls is not type
        names = tuple(f.name for f in dataclasses.fields(cls)) if mutable else None
        _FIELDS[cls] = names
    return names


_FIELDS: dict[type, Any] = {}


def _frozen(value: Any) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return params is not None and params.frozen


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, set)) or _mutable_fields(value) is not None


def _copy_value(value: Any, depth: int = 0) -> Any:
    """Copy containers and mutable dataclasses; keep everything else by reference."""
    if depth > 4 or isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, dict):
        if all(isinstance(v, _IMMUTABLE) or _frozen(v) for v in value.values()):
            return value.copy()
        return type(value)((k, _copy_value(v, depth + 1)) for k, v in value.items())
    if isinstance(value, list):
        return [_copy_value(v, depth + 1) for v in value]
    if isinstance(value, set):
        return set(value)
    names = _mutable_fields(value)
    if names is not None:
        clone = copy.copy(value) if not hasattr(value, "__dict__") else _shallow(value)
        for name in names:
            field_value = getattr(value, name, _MISSING)
            if field_value is not _MISSING and not isinstance(field_value, _IMMUTABLE):
                object.__setattr__(clone, name, _copy_value(field_value, depth + 1))
        return clone
    return value


def _same(value: Any, recorded: Any, depth: int = 0) -> bool:
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
        return all(_same(v, recorded.get(k, _MISSING), depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return len(value) == len(recorded) and all(
            _same(a, b, depth + 1) for a, b in zip(value, recorded, strict=True)
        )
    if isinstance(value, set):
        return value == recorded
    names = _mutable_fields(value)
    if names is not None:
        return all(
            _same(getattr(value, n, _MISSING), getattr(recorded, n, _MISSING), depth + 1)
            for n in names
        )
    if isinstance(value, (torch.Tensor, torch.fx.Node)):
        return False
    try:
        return bool(value == recorded)
    except Exception:  # noqa: BLE001 - an object that cannot compare counts as changed
        return False


def _equal(a: Any, b: Any) -> bool:
    """Equal values assigned anew (``node.args = tuple(node.args)``) are no change."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot compare (tensors) count as changed
        return False


class _Meta:
    """A meta dict: its entries by reference, and copies of its mutable containers."""

    __slots__ = ("copies", "refs")

    def __init__(self, meta: dict, shared: frozenset = _SHARED_META):
        self.refs = dict(meta)
        self.copies = {
            k: _copy_value(v) for k, v in self.refs.items() if k not in shared and _is_container(v)
        }

    def same_as(self, meta: dict) -> bool:
        refs = self.refs
        # Same keys in the same order with the same objects (a re-inserted key counts as a
        # change: conservative), then the copied containers compared by content.
        if len(meta) != len(refs) or not all(map(operator.is_, meta.values(), refs.values())):
            return False
        return list(meta) == list(refs) and all(
            _same(meta[k], c) for k, c in self.copies.items()
        )

    def rebuilt(self) -> dict:
        meta = dict(self.refs)
        meta.update((k, _copy_value(v)) for k, v in self.copies.items())
        return meta


class _GraphRecord:
    """The nodes of a graph as plain records; a graph is rebuilt from them only on demand."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self._tracer_cls = graph._tracer_cls
        self._codegen = copy.copy(graph._codegen)
        self._nodes = [
            (node, node.name, node.op, node.target, node.args, node.kwargs, node.type,
             _Meta(node.meta))
            for node in graph.nodes
        ]

    def structure_changed(self, graph: torch.fx.Graph) -> bool:
        if graph is not self.graph or len(graph.nodes) != len(self._nodes):
            return True
        if graph._codegen.__dict__ != self._codegen.__dict__:
            return True
        for node, (old, name, op, target, args, kwargs, type_, _) in zip(
            graph.nodes, self._nodes, strict=True
        ):
            if (
                node is not old
                or (node._args is not args and not _equal(node._args, args))
                or (node._kwargs is not kwargs and not _equal(node._kwargs, kwargs))
                or (node.target is not target and not _equal(node.target, target))
                or node.name != name
                or node.op != op
                or node.type is not type_
            ):
                return True
        return False

    def meta_changed(self) -> bool:
        return any(not meta.same_as(node.meta) for node, *_, meta in self._nodes)

    def rebuild(self) -> torch.fx.Graph:
        graph = torch.fx.Graph(tracer_cls=self._tracer_cls)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for old, name, op, target, args, kwargs, type_, meta in self._nodes:
            new = graph.create_node(
                op,
                target,
                torch.fx.node.map_arg(args, env.__getitem__),
                torch.fx.node.map_arg(kwargs, env.__getitem__),
                name=name,
                type_expr=type_,
            )
            new.meta = meta.rebuilt()
            env[old] = new
        graph._codegen = copy.copy(self._codegen)
        return graph


def _shallow(obj: Any) -> Any:
    """A shallow copy of a plain (``__dict__``) object, without ``copy.copy``'s overhead."""
    clone = object.__new__(type(obj))
    clone.__dict__.update(obj.__dict__)
    return clone


def _copy_signature(signature: ExportGraphSignature) -> ExportGraphSignature:
    # Specs and their arguments are mutable dataclasses: copy them, share the rest.
    def spec(s: Any) -> Any:
        clone = _shallow(s)
        clone.arg = _shallow(s.arg)
        return clone

    return ExportGraphSignature(
        [spec(s) for s in signature.input_specs], [spec(s) for s in signature.output_specs]
    )


def _copy_call_graph(entries: list) -> list:
    copied = []
    for entry in entries:
        clone = _shallow(entry)
        if entry.signature is not None:
            clone.signature = _copy_value(entry.signature)
        copied.append(clone)
    return copied


def _tensor_ids(mapping: dict) -> list[tuple[str, int]]:
    return [(k, id(v)) for k, v in mapping.items()]


class Change(NamedTuple):
    """What a pass changed: ``structure`` (nodes, so the code) and ``anything`` at all."""

    structure: bool
    anything: bool


class Snapshot:
    """Everything a pass can change, captured so that :meth:`restore` undoes it exactly.

    Tensor *contents* are copied only with ``copy_state=True`` (a pass declaring
    ``writes_state``): a KV cache is not cloned before every pass. A tensor whose version
    counter moved without a copy is listed by :meth:`written` and
    :meth:`unrestorable_changes`, never silently kept.
    """

    def __init__(self, program: Any, copy_state: bool = True):
        self.program = program
        gm = graph_module_of(program)
        self._gm = gm
        self._graph = _GraphRecord(gm.graph)
        self._modules = []
        # id -> (name, tensor, copy of its data or None, version)
        self._tensors: dict[int, tuple[str, torch.Tensor, torch.Tensor | None, int]] = {}

        def record(name: str, tensor: torch.Tensor, copy_data: bool) -> None:
            if id(tensor) not in self._tensors:
                data = tensor.detach().clone() if copy_data else None
                self._tensors[id(tensor)] = (name, tensor, data, tensor._version)

        for name, module in gm.named_modules():
            attrs = dict(module.__dict__)
            tensor_attrs = {k: v for k, v in attrs.items() if isinstance(v, torch.Tensor)}
            buffers, params = dict(module._buffers), dict(module._parameters)
            self._modules.append(
                (module, attrs, tensor_attrs, buffers, params, dict(module._modules))
            )
            prefix = f"{name}." if name else ""
            for key, buf in buffers.items():
                if buf is not None:
                    record(prefix + key, buf, copy_state)
            for key, value in tensor_attrs.items():
                if not isinstance(value, torch.nn.Parameter):
                    record(prefix + key, value, copy_state)
            # Parameters are never copied (they are the bulk of a model): a pass that
            # writes one in place cannot be rolled back, and the error says so.
            for key, param in params.items():
                if param is not None:
                    record(prefix + key, param, False)
        self._gm_meta = _Meta(gm.meta, shared=frozenset())
        self._ep_state = None
        if isinstance(program, ExportedProgram):
            self._ep_state = {
                "_graph_signature": _copy_signature(program._graph_signature),
                "_state_dict": dict(program._state_dict),
                "_constants": dict(program._constants),
                "_module_call_graph": _copy_call_graph(program._module_call_graph),
                "_range_constraints": dict(program._range_constraints),
                "_verifiers": list(program._verifiers),
            }
            for key, value in program._state_dict.items():
                if isinstance(value, torch.Tensor):
                    record(key, value, copy_state and not isinstance(value, torch.nn.Parameter))
            for key, value in program._constants.items():
                if isinstance(value, torch.Tensor):
                    record(key, value, copy_state)

    # -- what changed ------------------------------------------------------------------
    def compare(self, program: Any) -> Change:
        """What differs between ``program`` (the pass's result) and the snapshot."""
        gm = graph_module_of(program)
        if gm is not self._gm or self._graph.structure_changed(gm.graph):
            return Change(True, True)
        return Change(False, self._state_changed(program))

    def _state_changed(self, program: Any) -> bool:
        if self.written() or self._graph.meta_changed() or not self._gm_meta.same_as(
            self._gm.meta
        ):
            return True
        modules = dict(self._gm.named_modules())
        if len(modules) != len(self._modules):
            return True
        for module, _, tensor_attrs, buffers, params, submodules in self._modules:
            current = {k: v for k, v in module.__dict__.items() if isinstance(v, torch.Tensor)}
            if (
                _tensor_ids(current) != _tensor_ids(tensor_attrs)
                or _tensor_ids(module._buffers) != _tensor_ids(buffers)
                or _tensor_ids(module._parameters) != _tensor_ids(params)
                or _tensor_ids(module._modules) != _tensor_ids(submodules)
            ):
                return True
        if self._ep_state is None:
            return program is not self.program
        state = self._ep_state
        return not (
            _same(program._graph_signature, state["_graph_signature"])
            and _tensor_ids(program._state_dict) == _tensor_ids(state["_state_dict"])
            and _tensor_ids(program._constants) == _tensor_ids(state["_constants"])
            and _same(program._module_call_graph, state["_module_call_graph"])
            and program._range_constraints == state["_range_constraints"]
            and program._verifiers == state["_verifiers"]
        )

    def written(self) -> list[str]:
        """Tensors whose data was written in place since the snapshot (version counter)."""
        return sorted(
            name for name, tensor, _, version in self._tensors.values()
            if tensor._version != version
        )

    def unrestorable_changes(self) -> list[str]:
        """Tensors written in place whose old data was not copied, so cannot come back."""
        return sorted(
            name for name, tensor, data, version in self._tensors.values()
            if data is None and tensor._version != version
        )

    # -- undo ----------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The program as it was, as text (rendered only when a diff is asked for)."""
        text = str(self._graph.rebuild())
        if self._ep_state is not None:
            text += "\n" + str(self._ep_state["_graph_signature"])
        return text

    def restore(self) -> None:
        gm = self._gm
        for module, attrs, _, buffers, params, modules in self._modules:
            module.__dict__.clear()
            module.__dict__.update(attrs)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._parameters.clear()
            module._parameters.update(params)
            module._modules.clear()
            module._modules.update(modules)
        for _, tensor, data, version in self._tensors.values():
            if data is not None and tensor._version != version:
                with torch.no_grad():
                    tensor.copy_(data)
        gm.graph = self._graph.rebuild()
        gm.meta.clear()
        gm.meta.update(self._gm_meta.rebuilt())
        gm.recompile()
        if self._ep_state is not None:
            program = self.program
            state = self._ep_state
            program._graph_signature = _copy_signature(state["_graph_signature"])
            program._module_call_graph = _copy_call_graph(state["_module_call_graph"])
            for key in ("_state_dict", "_constants", "_range_constraints", "_verifiers"):
                setattr(program, key, copy.copy(state[key]))
            program._graph_module = gm
