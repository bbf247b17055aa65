"""The pickled format: a program of either form, node meta included, in a Python pickle.

Reading it runs whatever the pickle says (``torch.load(weights_only=False)``): only
:func:`pass_manager.archive.load_program` with ``trusted=True`` calls :func:`load`.

``torch.save`` of a GraphModule stores its generated code and re-traces it on load, which
loses all node meta. So a program is written with ``torch.save`` and a pickler that knows
fx: a GraphModule is stored as its module state plus one record per node (name, op,
target, args, kwargs, meta); operators by their qualified name; a node named in another
node's meta (``quantization_annotation`` keys) by its name; a fake tensor
(``meta["val"]``) by its shape, strides, dtype, device and storage, re-created under one
``FakeTensorMode`` on load. Tensor data is written by ``torch.save`` straight from each
tensor's memory: no second copy of the program's state is made. A meta entry or module
attribute that cannot be pickled is left out and listed in what :func:`save` returns.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import dataclasses
import importlib
import io
import pickle
import types
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule, Node
from torch.fx.immutable_collections import immutable_dict, immutable_list

__all__ = ["PICKLE_MODULE", "PROTOCOL", "load", "save"]

# GraphModule attributes rebuilt from the graph rather than stored.
_GENERATED = frozenset({"_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls"})
PROTOCOL = 4  # protocol 2 (torch.save's default) cannot pickle torch.memory_format
_loading: contextvars.ContextVar[dict] = contextvars.ContextVar("_loading")


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    """A node, pickled by name; resolved in the graph being rebuilt."""

    name: str


class _Dropped:
    """Stands for a meta value that could not be stored (removed again on load)."""


def _op_overload(namespace: str, name: str, overload: str) -> Any:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _op_packet(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(module: str, name: str) -> Any:
    importlib.import_module(module)  # defining the operator registers it
    return getattr(torch.ops.higher_order, name)


def _fake_tensor(key: int, nbytes: int, shape: tuple, stride: tuple, offset: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fake tensor; those that shared a storage when saved share one again."""
    state = _loading.get()
    with state["mode"]:
        base = state["storages"].get(key)
        if base is None:
            base = torch.empty(nbytes, dtype=torch.uint8, device=device)
            state["storages"][key] = base
        typed = base if dtype == torch.uint8 else base.view(dtype)
        return typed.as_strided(shape, stride, offset)


def _static(values: Any) -> bool:
    return all(isinstance(v, int) for v in values)


def _reduce_fake(t: FakeTensor) -> tuple:
    if not (_static(t.shape) and _static(t.stride()) and isinstance(t.storage_offset(), int)):
        return _Dropped, ()  # symbolic shapes: re-inferred by whoever needs them
    storage = t.untyped_storage()
    if not isinstance(storage.nbytes(), int):
        return _Dropped, ()
    # Storage offsets count elements of the tensor's dtype, sizes bytes.
    return _fake_tensor, (storage._cdata, storage.nbytes(), tuple(t.shape), tuple(t.stride()),
                          t.storage_offset(), t.dtype, t.device)


class _NullPickler(pickle.Pickler):
    """Checks that a value pickles, without serializing tensor data."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) and not (
            isinstance(obj, FakeTensor)
        ):
            return id(obj)
        return None

    def reducer_override(self, obj: Any) -> Any:
        return _reduce(obj, self)


def _picklable(value: Any) -> bool:
    try:
        _NullPickler(io.BytesIO(), protocol=PROTOCOL).dump(value)
    except Exception:  # noqa: BLE001 - any failure means "cannot be stored"
        return False
    return True


_MISSING = object()


def _storable(value: Any, where: str, dropped: list[str], depth: int = 0) -> Any:
    """``value``, or a copy without the parts that cannot be pickled, or _MISSING."""
    if _picklable(value):
        return value
    if depth < 3 and isinstance(value, dict):
        return _kept(value, where, dropped, depth + 1)
    if depth < 3 and isinstance(value, torch.nn.Module) and not isinstance(value, GraphModule):
        # e.g. export's GuardsFn, whose forward is generated code: keep the module, drop that.
        clone = copy.copy(value)
        clone.__dict__ = _kept(value.__dict__, where, dropped, depth + 1)
        return clone
    dropped.append(f"{where} ({type(value).__name__})")
    return _MISSING


def _kept(items: dict, where: str, dropped: list[str], depth: int = 0) -> dict:
    kept = type(items)() if type(items) in (dict, collections.OrderedDict) else {}
    for key, value in items.items():
        value = _storable(value, f"{where}[{key!r}]", dropped, depth)
        if value is not _MISSING:
            kept[key] = value
    return kept


def _reduce_graph_module(gm: GraphModule, dropped: list[str]) -> tuple:
    body = {}
    for key, value in gm.__dict__.items():
        if key in _GENERATED:
            continue
        if isinstance(value, types.MethodType) and value.__self__ is gm:
            # ep.module() binds train/eval to the module: a cycle pickle cannot store.
            dropped.append(f"GraphModule attribute[{key!r}] (method bound to the module)")
            continue
        body[key] = value
    body = _kept(body, "GraphModule attribute", dropped)
    codegen = gm.graph._codegen if _picklable(gm.graph._codegen) else None
    records = [
        (node.name, node.op, node.target, node.args, node.kwargs,
         _kept(node.meta, f"{node.name}.meta", dropped))
        for node in gm.graph.nodes
    ]
    class_name = gm.__dict__.get("_graphmodule_cls_name", "GraphModule")
    return _rebuild_graph_module, (body, records, codegen, class_name)


def _reduce(obj: Any, pickler: Any) -> Any:
    if isinstance(obj, Node):
        return _NodeRef, (obj.name,)
    if isinstance(obj, FakeTensor):
        return _reduce_fake(obj)
    if isinstance(obj, torch._ops.OpOverload):
        return _op_overload, (obj.namespace, obj._opname, obj._overloadname)
    if isinstance(obj, torch._ops.OpOverloadPacket):
        namespace, _, name = obj._qualified_op_name.partition("::")
        return _op_packet, (namespace, name)
    if isinstance(obj, torch._ops.HigherOrderOperator):
        return _higher_order, (type(obj).__module__, obj.name())
    if isinstance(obj, GraphModule):
        return _reduce_graph_module(obj, getattr(pickler, "dropped", []))
    return NotImplemented


class _Pickler(pickle.Pickler):
    """torch.save subclasses this (adding its persistent_id for tensor data)."""

    # torch.save builds the pickler itself: save_program hands it the list through the class.
    dropped: ClassVar[list[str]] = []

    def reducer_override(self, obj: Any) -> Any:
        return _reduce(obj, self)


def _resolve(value: Any, nodes: dict[str, Node], seen: set[int]) -> Any:
    """``value`` with every _NodeRef replaced by the node of that name (in place where
    the container is mutable; meta holds dicts, lists, tuples and dataclasses)."""
    if isinstance(value, _NodeRef):
        # Meta may name a node no longer in the graph (torchao leaves annotations naming
        # nodes convert_pt2e erased): that reference stays a _NodeRef, stale as it was.
        return nodes.get(value.name, value)
    if isinstance(value, (str, int, float, bool, type(None), torch.Tensor)) or id(value) in seen:
        return value
    seen.add(id(value))
    if isinstance(value, dict):
        items = [(_resolve(k, nodes, seen), _resolve(v, nodes, seen)) for k, v in value.items()]
        if isinstance(value, immutable_dict):
            return immutable_dict(items)
        value.clear()
        value.update(items)
    elif isinstance(value, list):
        items = [_resolve(v, nodes, seen) for v in value]
        if isinstance(value, immutable_list):
            return immutable_list(items)
        value[:] = items
    elif isinstance(value, tuple):
        items = [_resolve(v, nodes, seen) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    elif isinstance(value, set):
        items = {_resolve(v, nodes, seen) for v in value}
        value.clear()
        value.update(items)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            try:
                object.__setattr__(value, f.name, _resolve(getattr(value, f.name), nodes, seen))
            except AttributeError:
                continue
    return value


def _rebuild_graph_module(body: dict, records: list, codegen: Any, class_name: str) -> GraphModule:
    graph = torch.fx.Graph()
    if codegen is not None:
        graph._codegen = codegen
    nodes: dict[str, Node] = {}
    for name, op, target, args, kwargs, _ in records:
        args, kwargs = _resolve((args, kwargs), nodes, set())
        nodes[name] = graph.create_node(op, target, args, kwargs, name=name)
    for name, *_, meta in records:
        meta = _resolve(meta, nodes, set())
        nodes[name].meta = {k: v for k, v in meta.items() if not isinstance(v, _Dropped)}
    gm = GraphModule(torch.nn.Module(), torch.fx.Graph(), class_name)
    gm.__dict__.update(body)
    gm.graph = graph  # generates the code
    return gm


PICKLE_MODULE = types.SimpleNamespace(
    Pickler=_Pickler, Unpickler=pickle.Unpickler, load=pickle.load, dump=pickle.dump,
    __name__="pass_manager._archive.pickled",
)


def save(value: Any, path: str | Path) -> list[str]:
    """Write ``value`` (a program, or data holding programs, nodes, fake tensors) to ``path``.

    Returns what could not be stored ("node.meta['key'] (type)"): those entries are
    missing from the loaded value. Tensor data is written from the tensors' memory.
    """
    dropped: list[str] = []
    _Pickler.dropped = dropped
    try:
        torch.save(value, str(path), pickle_module=PICKLE_MODULE, pickle_protocol=PROTOCOL)
    finally:
        _Pickler.dropped = []
    return dropped


def load(path: str | Path) -> Any:
    """Read what :func:`save` wrote (tensors on the CPU as saved). Runs the pickle's code."""
    token = _loading.set({"mode": FakeTensorMode(allow_non_fake_inputs=True), "storages": {}})
    try:
        return torch.load(str(path), weights_only=False, pickle_module=PICKLE_MODULE)
    finally:
        _loading.reset(token)
