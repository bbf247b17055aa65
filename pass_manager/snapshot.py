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
from typing import Any, NamedTuple

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature

from .copying import MISSING, copy_value, equal, is_container, same, shallow
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
def _fields(node: torch.fx.Node) -> tuple:
    return (node, node.name, node.op, node.target, node._args, node._kwargs, node.type)


def _equal_lists(a: list, b: list) -> bool:
    """``a == b`` compared in C (identity first); values that cannot compare: not equal."""
    try:
        return a == b
    except Exception:  # noqa: BLE001 - e.g. fake tensors, whose truth value is undefined
        return False


class _GraphRecord:
    """The nodes of a graph as plain records; a graph is rebuilt from them only on demand.

    Per node: its fields and its meta entries, by reference (built and compared in C
    loops), and copies of the mutable containers in its meta, if any.
    """

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self._tracer_cls = graph._tracer_cls
        self._codegen = copy.copy(graph._codegen)
        nodes = list(graph.nodes)
        self._fields = [_fields(n) for n in nodes]
        self._meta = [dict(n.meta) for n in nodes]
        # Most nodes hold only shared entries (values, provenance): nothing to copy.
        self._copies = {
            n: {k: copy_value(v) for k, v in n.meta.items()
                if k not in _SHARED_META and is_container(v)}
            for n in nodes if not _SHARED_META.issuperset(n.meta)
        }

    def structure_changed(self, graph: torch.fx.Graph) -> bool:
        if graph is not self.graph or len(graph.nodes) != len(self._fields):
            return True
        if graph._codegen.__dict__ != self._codegen.__dict__:
            return True
        current = [_fields(n) for n in graph.nodes]
        if _equal_lists(current, self._fields):
            return False
        # Equal values assigned anew (``node.args = tuple(node.args)``) are no change.
        return not all(
            now[0] is old[0] and all(a is b or equal(a, b) for a, b in zip(now, old, strict=True))
            for now, old in zip(current, self._fields, strict=True)
        )

    def meta_changed(self) -> bool:
        nodes = [f[0] for f in self._fields]
        if not _equal_lists([n.meta for n in nodes], self._meta):
            return True
        return not all(
            same(n.meta.get(k, MISSING), c)
            for n, copies in self._copies.items() for k, c in copies.items()
        )

    def rebuild(self) -> torch.fx.Graph:
        graph = torch.fx.Graph(tracer_cls=self._tracer_cls)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for (old, name, op, target, args, kwargs, type_), items in zip(
            self._fields, self._meta, strict=True
        ):
            new = graph.create_node(
                op,
                target,
                torch.fx.node.map_arg(args, env.__getitem__),
                torch.fx.node.map_arg(kwargs, env.__getitem__),
                name=name,
                type_expr=type_,
            )
            new.meta = dict(items)  # a copy: the record may be restored again
            new.meta.update((k, copy_value(v)) for k, v in self._copies.get(old, {}).items())
            env[old] = new
        graph._codegen = copy.copy(self._codegen)
        return graph


def _copy_signature(signature: ExportGraphSignature) -> ExportGraphSignature:
    # Specs and their arguments are mutable dataclasses: copy them, share the rest.
    def spec(s: Any) -> Any:
        clone = shallow(s)
        clone.arg = shallow(s.arg)
        return clone

    return ExportGraphSignature(
        [spec(s) for s in signature.input_specs], [spec(s) for s in signature.output_specs]
    )


def _copy_call_graph(entries: list) -> list:
    copied = []
    for entry in entries:
        clone = shallow(entry)
        if entry.signature is not None:
            clone.signature = copy_value(entry.signature)
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
        self._gm_meta = (
            tuple(gm.meta.items()),
            {k: copy_value(v) for k, v in gm.meta.items() if is_container(v)},
        )
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
        items, copies = self._gm_meta
        if (
            self.written()
            or self._graph.meta_changed()
            or not _equal_lists(list(self._gm.meta.items()), list(items))
            or not all(same(self._gm.meta.get(k, MISSING), c) for k, c in copies.items())
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
            same(program._graph_signature, state["_graph_signature"])
            and _tensor_ids(program._state_dict) == _tensor_ids(state["_state_dict"])
            and _tensor_ids(program._constants) == _tensor_ids(state["_constants"])
            and same(program._module_call_graph, state["_module_call_graph"])
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
        items, copies = self._gm_meta
        gm.meta.update(items)
        gm.meta.update((k, copy_value(v)) for k, v in copies.items())
        gm.recompile()
        if self._ep_state is not None:
            program = self.program
            state = self._ep_state
            program._graph_signature = _copy_signature(state["_graph_signature"])
            program._module_call_graph = _copy_call_graph(state["_module_call_graph"])
            for key in ("_state_dict", "_constants", "_range_constraints", "_verifiers"):
                setattr(program, key, copy.copy(state[key]))
            program._graph_module = gm
