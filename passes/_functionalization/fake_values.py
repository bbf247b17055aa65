"""Fake values (``meta["val"]``) for nodes a pass creates, one node at a time.

Evaluating the new node's op on its inputs' fake tensors is not a re-trace: nothing else
of the program runs. Layers of a model repeat the same rewrite on the same shapes, so the
result of a non-view op with static shapes is cached per (op, input metadata) and later
hits get a fresh fake tensor with that metadata instead of a new dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Graph, Node, map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from .._analysis.op_schema import view_base_index

__all__ = [
    "FakeValues",
    "is_contiguous",
    "same_metadata",
    "same_static_layout",
    "same_strides",
    "static_layout",
]

_UNKNOWN = object()


class FakeValues:
    """Computes ``meta["val"]`` / ``meta["tensor_meta"]`` with the graph's own fake mode."""

    def __init__(self, graph: Graph):
        self._graph = graph
        self._mode: Any = _UNKNOWN
        self._cache: dict[tuple, Any] = {}

    @property
    def mode(self) -> Any:
        """The graph's fake mode (None without fake values), found on first use."""
        if self._mode is _UNKNOWN:
            # One fake tensor names the mode (a graph's inputs share one): the first input
            # holding one, found without listing them all (the inputs come first).
            first = next((n.meta["val"] for n in self._graph.nodes
                          if n.op in ("placeholder", "get_attr")
                          and isinstance(n.meta.get("val"), FakeTensor)), None)
            if first is not None:
                self._mode = detect_fake_mode([first])
            else:
                self._mode = detect_fake_mode([
                    n.meta["val"] for n in self._graph.nodes
                    if n.op in ("placeholder", "get_attr") and "val" in n.meta])
        return self._mode

    def infer(self, node: Node) -> None:
        """Set the node's fake value; skipped when the graph carries no fake values.

        Raises whatever the op raises on these fake inputs (the rewrite is then invalid).
        """
        if self.mode is None:
            return
        try:
            args, kwargs = map_arg((node.args, node.kwargs), _value_of)
        except _NoValue:  # an input without a fake value: nothing to infer from
            return
        key = _fake_key(node, args, kwargs)
        if key in self._cache:
            like, tensor_meta = self._cache[key]
            val = _fresh_fake(self.mode, like)
        else:
            with self.mode:
                val = node.target(*args, **kwargs)
            tensor_meta = (_extract_tensor_metadata(val) if isinstance(val, torch.Tensor)
                           else None)
            if key is not None:
                # TensorMetadata is an immutable tuple: nodes with equal metadata share it.
                self._cache[key] = (val, tensor_meta)
        node.meta["val"] = val
        if tensor_meta is not None:
            node.meta["tensor_meta"] = tensor_meta


class _NoValue(Exception):
    """An input node without ``meta["val"]``."""


def _value_of(node: Node) -> Any:
    try:
        return node.meta["val"]
    except KeyError:
        raise _NoValue from None


def _fake_key(node: Node, args: Any, kwargs: Any) -> tuple | None:
    """A cache key for the fake result of a non-view op with static shapes, else None.

    Views are never cached: their result shares its input's storage.
    """
    target = node.target
    if view_base_index(node) is not None or not isinstance(target, torch._ops.OpOverload):
        return None
    try:
        # The op by identity: an OpOverload hashes in Python, the rest of the key in C.
        key = (id(target), _key_of(args), _key_of(kwargs) if kwargs else ())
        hash(key)
    except (TypeError, _Dynamic):
        return None
    return key


class _Dynamic(Exception):
    """A symbolic size, stride or scalar: no static cache key."""


def _key_of(value: Any) -> Any:
    # A hand-rolled flatten: pytree's generic one costs more than the dispatch it saves.
    if isinstance(value, torch.Tensor):
        shape, stride = value.shape, value.stride()
        for d in (*shape, *stride):
            if not isinstance(d, int):
                raise _Dynamic
        return (shape, stride, value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value), *(_key_of(v) for v in value))
    if isinstance(value, dict):
        return (dict, *((k, _key_of(v)) for k, v in value.items()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Dynamic
    return (type(value), value)


def _fresh_fake(mode: Any, like: Any) -> Any:
    """A new fake tensor (or tuple of them) with the metadata of ``like``."""
    if isinstance(like, (tuple, list)):
        return type(like)(_fresh_fake(mode, v) for v in like)
    if not isinstance(like, torch.Tensor):
        return like
    meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
    return FakeTensor(mode, meta, like.device)


def static_layout(node: Node) -> tuple | None:
    """The shape, strides and storage offset of the node's fake tensor, flattened, when it
    has one and all are static integers (else None)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    layout = (*val.shape, *val.stride(), val.storage_offset())
    return layout if all(isinstance(x, int) for x in layout) else None


def same_static_layout(a: Node, b: Node) -> bool:
    """Whether both nodes' fake tensors are known to have one shape, strides and offset
    (False when either is unknown or symbolic)."""
    layout = static_layout(a)
    return layout is not None and layout == static_layout(b)


def same_strides(a: Node, b: Node) -> bool:
    """Same strides (True when unknown: no fake values or symbolic strides)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return True
    strides = (*va.stride(), *vb.stride())
    return not all(isinstance(x, int) for x in strides) or va.stride() == vb.stride()


def same_metadata(old: list[Node], new: list[Node]) -> bool:
    """Inputs whose fake values agree in everything but storage (static shapes only)."""
    return len(old) == len(new) and all(
        same_static_layout(a, b) and _dtype_device(a) == _dtype_device(b)
        for a, b in zip(old, new, strict=True))


def _dtype_device(node: Node) -> tuple:
    val = node.meta["val"]
    return val.dtype, val.device


def is_contiguous(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous()
