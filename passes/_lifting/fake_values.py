"""Fake tensor values for the nodes that lack one: an ExportedProgram needs ``val`` on every
node, and torchao's convert inserts (de)quantize nodes and frozen constants without it.

Only those nodes are propagated, each from its inputs' recorded values, in the graph's fake
mode (its shape environment included): a program from ``ep.module()`` has values everywhere
else, and re-running them would be a trace.

A fresh-result op (torchao's quantize / dequantize) has a result whose layout its Meta
kernel computes from its inputs' layouts and its other arguments alone, so the kernel runs
once per distinct such key (on the inputs' fake values, as the fake mode runs it) and each
node gets a new fake tensor of that layout, built as the fake mode's converter wraps a
kernel's result: about 0.01 ms a node, against 0.1 ms for a kernel run per node and
0.4-1 ms through the mode's dispatch. The scale and zero point of a per-tensor
(de)quantize, different at every node, are left out of the key: its Meta kernel never
reads them. Anything else goes through torch's ``FakeTensorProp``.

Symbolic sizes (a dynamic token dimension) key by their expressions. Their new fake tensor
takes the kernel's storage size as it is instead of computing it again from the symbolic
sizes and strides (``empty_strided`` does, in Python ``SymNode`` arithmetic: 0.3 ms a
node against 0.03 ms), the way torch's nested tensors build theirs
(``_make_wrapper_subclass(..., storage_size=)``); each still gets a storage of its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch._export.utils import _detect_fake_mode_from_gm
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    in_kernel_invocation_manager,
)
from torch.fx import GraphModule, Node, map_arg
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .._analysis.op_schema import facts_of
from ..errors import LiftError

__all__ = ["fake_mode_of", "fake_state_value", "fill_missing_values", "storage_key"]


def fake_mode_of(gm: GraphModule) -> FakeTensorMode:
    """The fake mode the graph's values were made in (a fresh one if it has none): its
    inputs' (``_detect_fake_mode_from_gm``'s answer when they have one, without its walk
    over every node), else its other values'."""
    inputs = [v for p in gm.graph.find_nodes(op="placeholder")
              if isinstance(v := p.meta.get("val"), torch.Tensor)]
    mode = detect_fake_mode(inputs) if inputs else _detect_fake_mode_from_gm(gm)
    return mode if mode is not None else FakeTensorMode(shape_env=ShapeEnv())


def fake_state_value(mode: FakeTensorMode, tensor: torch.Tensor, shares_storage: bool) -> Any:
    """A fake value for a lifted tensor that has none (a frozen constant): static shapes,
    as export gives parameters and buffers.

    A plain tensor owning its whole storage alone (``shares_storage`` False: no other
    lifted tensor uses it) is one new fake tensor of its layout, as the mode's converter
    would make it (0.01 ms against 0.12 ms: the converter describes every tensor for its
    memo of storages and views, which such a tensor does not need); any other tensor goes
    through ``from_tensor``, which keeps views and shared storages shared.
    """
    if not shares_storage and _plain(tensor):
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device="meta")
        if meta.untyped_storage().nbytes() == tensor.untyped_storage().nbytes():
            return FakeTensor(mode, meta, tensor.device)
    return mode.from_tensor(tensor, static_shapes=True)


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """What identifies ``tensor``'s storage among tensors on its device (None for a
    tensor subclass or a tensor without one: it is then taken as sharing)."""
    if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type == "meta"
            or tensor.layout != torch.strided or tensor.untyped_storage().nbytes() == 0):
        return None
    return tensor.device, tensor.untyped_storage().data_ptr()


def _plain(tensor: torch.Tensor) -> bool:
    """A dense tensor at the start of its own storage, with nothing the converter would
    carry over besides its layout (autograd, a subclass, a view's base, lazy bits)."""
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided
            and not tensor.requires_grad and not tensor.is_quantized
            and not tensor.is_inference() and not tensor.is_conj() and not tensor.is_neg()
            and tensor._base is None and tensor.storage_offset() == 0)


def fill_missing_values(missing: list[Node], gm: GraphModule, mode: FakeTensorMode) -> int:
    """Give each node of ``missing`` (call_function nodes without a ``val``, in graph order)
    one, from its inputs'.

    ``gm`` holds the subgraphs the nodes' ``get_attr`` inputs name. Returns how many nodes
    were propagated.
    """
    if not missing:
        return 0
    layouts = _ResultLayouts(mode)
    prop: FakeTensorProp | None = None
    for node in missing:
        value = layouts.value_of(node)
        if value is not None:
            node.meta["val"] = value
            continue
        if prop is None:
            prop = FakeTensorProp(gm, mode)
        with mode:
            inputs = {}
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":  # a subgraph: FakeTensorProp fetches it from gm
                    inputs[arg] = prop.fetch_attr(str(arg.target))
                elif "val" in arg.meta:
                    inputs[arg] = arg.meta["val"]
                else:
                    raise LiftError(f"its input {arg.name} has no fake value", node.name)
            prop.env = inputs
            try:
                prop.run_node(node)
            except Exception as e:  # any failure of the op on fake values is this error
                raise LiftError(f"cannot compute its fake value ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})", node.name) from e
    if prop is not None:
        prop.env = {}
    return len(missing)


# Per-tensor (de)quantize ops whose Meta kernel reads neither the scale nor the zero point
# (torch/ao/quantization/fx/_decomposed.py: an ``empty_like`` of the input in the output
# dtype, after checks on dtypes and bounds only); by (qualified name, overload).
_UNREAD_BY_META = {
    ("quantized_decomposed::quantize_per_tensor", "default"): frozenset({"scale", "zero_point"}),
    ("quantized_decomposed::dequantize_per_tensor", "default"): frozenset(
        {"scale", "zero_point"}),
}

# op -> None (no fast path) or, per positional argument, whether the key leaves it out, and
# the keyword arguments it leaves out
_OP_PLANS: dict[Any, tuple[tuple[bool, ...], frozenset[str]] | None] = {}


def _plan(op: Any, node: Node) -> tuple[tuple[bool, ...], frozenset[str]] | None:
    if op in _OP_PLANS:
        return _OP_PLANS[op]
    plan = None
    if isinstance(op, torch._ops.OpOverload):
        facts = facts_of(node)
        if (facts is not None and facts.fresh and not facts.may_write and not facts.maybe_view
                and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")):
            unread = _UNREAD_BY_META.get((op.name(), op._overloadname), frozenset())
            plan = tuple(a.name in unread for a in op._schema.arguments), unread
    _OP_PLANS[op] = plan
    return plan


class _Unkeyable(Exception):
    """An argument the layout key cannot hold (a symbolic or foreign value)."""


class _Layout(NamedTuple):
    """A kernel result's layout; sizes are ints or SymInts of the graph's shape env."""

    shape: torch.Size
    stride: tuple[Any, ...]
    dtype: torch.dtype
    nbytes: Any  # its storage's size in bytes


class _ResultLayouts:
    """Fake values of fresh-result nodes, from their op's Meta kernel run once per (op,
    input layouts, other arguments)."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.known: dict[tuple, _Layout | None] = {}

    def value_of(self, node: Node) -> FakeTensor | None:
        """``node``'s fake value, or None where the fast path does not apply."""
        keyed = self.key_of(node)
        if keyed is None:
            return None
        key, device = keyed
        try:
            layout = self.known[key]
        except KeyError:
            layout = self.known[key] = _run_meta_kernel(node, self.mode)
        except TypeError:  # an unhashable argument: the kernel runs for this node alone
            layout = _run_meta_kernel(node, self.mode)
        if layout is None:
            return None
        return _fresh_fake_tensor(self.mode, layout, device)

    def key_of(self, node: Node) -> tuple[tuple, torch.device] | None:
        """What ``node``'s result layout depends on (op, input layouts, other arguments)
        and the device of its inputs, or None where the fast path does not apply."""
        plan = _plan(node.target, node)
        if plan is None:
            return None
        left_out, unread = plan
        devices: set[torch.device] = set()
        key: list[Any] = [node.target]
        try:
            for i, arg in enumerate(node.args):
                key.append(None if i < len(left_out) and left_out[i]
                           else self._key(arg, devices))
            for name, arg in node.kwargs.items():
                key.append((name, None if name in unread else self._key(arg, devices)))
        except _Unkeyable:
            return None
        if len(devices) != 1:
            return None
        return tuple(key), devices.pop()

    def _key(self, value: Any, devices: set[torch.device]) -> Any:
        if isinstance(value, Node):
            v = value.meta.get("val")
            if not isinstance(v, FakeTensor) or v.fake_mode is not self.mode:
                raise _Unkeyable
            devices.add(v.fake_device)
            if not v._has_symbolic_sizes_strides:
                return v.shape, v.stride(), v.storage_offset(), v.dtype, v.fake_device
            return (tuple(map(_size_key, v.shape)), tuple(map(_size_key, v.stride())),
                    _size_key(v.storage_offset()), v.dtype, v.fake_device)
        if isinstance(value, (list, tuple)):
            return type(value), tuple(self._key(v, devices) for v in value)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
            raise _Unkeyable
        return type(value), value  # 1, 1.0 and True key apart


def _size_key(size: Any) -> Any:
    """A size as a key: an int, or a symbolic size's expression (equal expressions are
    equal sizes)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _run_meta_kernel(node: Node, mode: FakeTensorMode) -> _Layout | None:
    """The layout of ``node``'s result as its op's Meta kernel gives it on the inputs'
    fake values (as the fake mode runs kernels), or None if the kernel fails or gives no
    single meta tensor at offset 0 (the general path then reports or handles it)."""
    args, kwargs = map_arg((node.args, node.kwargs), lambda arg: arg.meta["val"])
    try:
        with in_kernel_invocation_manager(mode):
            result = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the general path reports the failure
        return None
    if (type(result) is not torch.Tensor or result.device.type != "meta"
            or result.storage_offset() != 0):
        return None
    return _Layout(result.shape, result.stride(), result.dtype,
                   result.untyped_storage().nbytes())


class _MetaLayout(torch.Tensor):
    """The type ``_make_wrapper_subclass`` needs to build a meta tensor of a given layout
    and storage size; only ever wrapped at once into a FakeTensor."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        raise LiftError(f"{func} reached a layout carrier, which runs no op")


def _fresh_fake_tensor(mode: FakeTensorMode, layout: _Layout, device: torch.device
                       ) -> FakeTensor:
    """A new fake tensor of ``layout`` on a storage of its own, as the fake mode wraps a
    kernel's result. On static sizes ``empty_strided`` gives the meta tensor when its
    storage is the layout's size (2 us less than the carrier); otherwise the meta tensor is
    built with its storage size given, so symbolic sizes cost no arithmetic, then wrapped
    (its ``detach`` below the Python key: the carrier dispatches nothing)."""
    if isinstance(layout.nbytes, int):
        meta = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype,
                                   device="meta")
        if meta.untyped_storage().nbytes() == layout.nbytes:
            return FakeTensor(mode, meta, device)
    meta = torch.Tensor._make_wrapper_subclass(
        _MetaLayout, layout.shape, layout.stride, 0, dtype=layout.dtype, device="meta",
        storage_size=layout.nbytes)
    with torch._C._DisableTorchDispatch():
        return FakeTensor(mode, meta, device)
