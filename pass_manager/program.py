"""The two program forms a pass works on, and what the manager needs to know of them.

* ``GraphModule`` (``ep.module()``, ``symbolic_trace``, the graph torchao quantizes).
* ``ExportedProgram`` (``torch.export.export``): a graph module plus a graph signature
  and a state dict.

This module fingerprints a program (to measure whether a pass changed it), snapshots
and restores it (to roll back a failing pass), and renders it as text for diffs.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
from typing import Any, NamedTuple

import torch
from torch.export import ExportedProgram

__all__ = [
    "EXPORTED_PROGRAM",
    "GRAPH_MODULE",
    "Fingerprint",
    "Snapshot",
    "fingerprint",
    "graph_module_of",
    "graph_of",
    "node_count",
    "program_form",
    "program_text",
    "text_diff",
]

GRAPH_MODULE = "GraphModule"
EXPORTED_PROGRAM = "ExportedProgram"

# Meta entries that describe values or provenance rather than program structure; they
# are costly to hash and no pass's correctness claim depends on their identity.
_UNHASHED_META = frozenset(
    {
        "val",
        "tensor_meta",
        "example_value",
        "stack_trace",
        "nn_module_stack",
        "source_fn_stack",
        "from_node",
        "seq_nr",
        "original_aten",
        "torch_fn",
        "unbacked_bindings",
        "custom",
        "fwd_nn_module_stack",
        "fwd_source_fn_stack",
    }
)


def program_form(program: Any) -> str:
    if isinstance(program, ExportedProgram):
        return EXPORTED_PROGRAM
    if isinstance(program, torch.fx.GraphModule):
        return GRAPH_MODULE
    raise TypeError(
        "expected a torch.fx.GraphModule or torch.export.ExportedProgram, "
        f"got {type(program).__name__}"
    )


def graph_module_of(program: Any) -> torch.fx.GraphModule:
    return program.graph_module if isinstance(program, ExportedProgram) else program


def graph_of(program: Any) -> torch.fx.Graph:
    return graph_module_of(program).graph


def node_count(program: Any) -> int:
    return len(graph_of(program).nodes)


def _meta_token(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor@{id(value)}"
    if isinstance(value, (list, tuple)) and len(value) <= 16:
        return "(" + ",".join(_meta_token(v) for v in value) + ")"
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a meta value whose repr fails still counts as "some object"
        return f"{type(value).__name__}@{id(value)}"


def _tensor_token(t: torch.Tensor) -> str:
    return f"{id(t)}:{t._version}:{tuple(t.shape)}:{t.dtype}"


class Fingerprint(NamedTuple):
    """Digests of a program: ``code`` covers what recompile() depends on, ``state`` the rest."""

    code: str
    state: str


def fingerprint(program: Any) -> Fingerprint:
    """A structural digest: graph (ops, targets, args, meta), module state, signature.

    Two programs with equal fingerprints run the same code on the same state objects.
    Tensor *contents* enter through identity and the in-place version counter, so an
    in-place update of a buffer by a pass is seen without hashing its data.
    """
    gm = graph_module_of(program)
    code = hashlib.blake2b(digest_size=16)
    h = hashlib.blake2b(digest_size=16)
    for node in gm.graph.nodes:
        code.update(f"{node.op}|{node.name}|{node.target}|{node.args}|{node.kwargs}\n".encode())
        meta = ";".join(
            f"{k}={_meta_token(v)}" for k, v in node.meta.items() if k not in _UNHASHED_META
        )
        h.update(f"{node.name}|{meta}\n".encode())
    for name, module in gm.named_modules():
        for key, value in module.__dict__.items():
            if isinstance(value, torch.Tensor):
                h.update(f"{name}.{key}={_tensor_token(value)}\n".encode())
        for kind in ("_buffers", "_parameters"):
            for key, value in getattr(module, kind, {}).items():
                token = _tensor_token(value) if value is not None else "None"
                h.update(f"{name}.{kind}.{key}={token}\n".encode())
        h.update(f"{name}:{type(module).__name__}\n".encode())
    if isinstance(program, ExportedProgram):
        h.update(repr(program.graph_signature).encode())
        for key, value in program.state_dict.items():
            h.update(f"state.{key}={_tensor_token(value)}\n".encode())
        for key, value in program.constants.items():
            token = _tensor_token(value) if isinstance(value, torch.Tensor) else id(value)
            h.update(f"const.{key}={token}\n".encode())
    return Fingerprint(code.hexdigest(), h.hexdigest())


def program_text(program: Any) -> str:
    """The program as readable text: the graph, and for an ExportedProgram its signature."""
    text = str(graph_of(program))
    if isinstance(program, ExportedProgram):
        text += "\n" + str(program.graph_signature)
    return text


def text_diff(
    before: str, after: str, before_name: str = "before", after_name: str = "after"
) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=before_name,
            tofile=after_name,
        )
    )


# Meta entries that hold values or immutable provenance: kept by reference in snapshots
# (the meta dict itself is copied, so replacing them is still undone).
_SHARED_META = frozenset(
    {
        "val",
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


def _snapshot_meta(meta: dict) -> dict:
    return {k: (v if k in _SHARED_META else _snapshot_value(v, 1)) for k, v in meta.items()}


def _snapshot_value(value: Any, depth: int = 0) -> Any:
    """Copy containers and dataclasses in node meta; keep tensors and opaque objects as is."""
    if depth > 4 or isinstance(value, (torch.Tensor, torch.fx.Node)):
        return value
    if isinstance(value, dict):
        return type(value)((k, _snapshot_value(v, depth + 1)) for k, v in value.items())
    if isinstance(value, list):
        return [_snapshot_value(v, depth + 1) for v in value]
    if isinstance(value, set):
        return set(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        clone = copy.copy(value)
        for f in dataclasses.fields(value):
            try:
                object.__setattr__(
                    clone, f.name, _snapshot_value(getattr(value, f.name), depth + 1)
                )
            except AttributeError:
                continue
        return clone
    return value


class _GraphRecord:
    """The nodes of a graph as plain records; a graph is rebuilt from them only on demand.

    Recording reads each node's fields (args are immutable containers of nodes, kept by
    reference); rebuilding maps the old nodes to new ones. Recording is cheap because a
    rollback is rare, and rebuilding is only paid when one happens.
    """

    def __init__(self, graph: torch.fx.Graph):
        self._tracer_cls = graph._tracer_cls
        self._codegen = copy.deepcopy(graph._codegen)
        self._nodes = [
            (
                node,
                node.name,
                node.op,
                node.target,
                node.args,
                node.kwargs,
                node.type,
                _snapshot_meta(node.meta),
            )
            for node in graph.nodes
        ]

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
            new.meta = _snapshot_meta(meta)
            env[old] = new
        graph._codegen = copy.deepcopy(self._codegen)
        return graph


class Snapshot:
    """Everything a pass can change, captured so that :meth:`restore` undoes it exactly.

    Captured: the graph (nodes, args, node meta), every submodule's attributes, the
    identity and version counter of every tensor (buffers, tensor attributes, parameters,
    an ExportedProgram's state), the graph module's ``meta`` and, for an ExportedProgram,
    its graph signature, state dict, constants and call graph. Tensor *contents* are
    copied only with ``copy_state=True`` (a pass declaring ``writes_state``): a KV cache
    is not cloned before every pass. A tensor whose version counter moved without a copy
    is listed by :meth:`written` and :meth:`unrestorable_changes`, never silently kept.
    """

    def __init__(self, program: Any, copy_state: bool = True):
        self.program = program
        gm = graph_module_of(program)
        self._gm = gm
        self._graph = _GraphRecord(gm.graph)
        self._module_dicts = {}
        # id -> (name, tensor, copy of its data or None, version)
        self._tensors: dict[int, tuple[str, torch.Tensor, torch.Tensor | None, int]] = {}

        def record(name: str, tensor: torch.Tensor, copy_data: bool) -> None:
            if id(tensor) not in self._tensors:
                data = tensor.detach().clone() if copy_data else None
                self._tensors[id(tensor)] = (name, tensor, data, tensor._version)

        for name, module in gm.named_modules():
            self._module_dicts[name] = (
                module,
                dict(module.__dict__),
                dict(getattr(module, "_buffers", {})),
                dict(getattr(module, "_parameters", {})),
                dict(getattr(module, "_modules", {})),
            )
            prefix = f"{name}." if name else ""
            for key, buf in getattr(module, "_buffers", {}).items():
                if buf is not None:
                    record(prefix + key, buf, copy_state)
            for key, value in module.__dict__.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    record(prefix + key, value, copy_state)
            # Parameters are never copied (they are the bulk of a model): a pass that
            # writes one in place cannot be rolled back, and the error says so.
            for key, param in getattr(module, "_parameters", {}).items():
                if param is not None:
                    record(prefix + key, param, False)
        self._gm_meta = _snapshot_value(dict(gm.meta))
        self._ep_state = None
        if isinstance(program, ExportedProgram):
            self._ep_state = {
                "_graph_signature": copy.deepcopy(program._graph_signature),
                "_state_dict": dict(program._state_dict),
                "_constants": dict(program._constants),
                "_module_call_graph": copy.deepcopy(program._module_call_graph),
                "_range_constraints": dict(program._range_constraints),
                "_verifiers": list(program._verifiers),
            }
            for key, value in program._state_dict.items():
                if isinstance(value, torch.Tensor):
                    record(key, value, copy_state and not isinstance(value, torch.nn.Parameter))
            for key, value in program._constants.items():
                if isinstance(value, torch.Tensor):
                    record(key, value, copy_state)

    @property
    def text(self) -> str:
        """The program as it was, as text (rendered only when a diff is asked for)."""
        text = str(self._graph.rebuild())
        if self._ep_state is not None:
            text += "\n" + str(self._ep_state["_graph_signature"])
        return text

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

    def restore(self) -> None:
        gm = self._gm
        for module, attrs, buffers, params, modules in self._module_dicts.values():
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
        gm.meta.update(_snapshot_value(self._gm_meta))
        gm.recompile()
        if self._ep_state is not None:
            program = self.program
            for key, value in self._ep_state.items():
                setattr(
                    program, key, copy.copy(value) if isinstance(value, (dict, list)) else value
                )
            program._graph_module = gm
