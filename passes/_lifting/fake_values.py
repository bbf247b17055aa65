"""Fake tensor values for the nodes that lack one: an ExportedProgram needs ``val`` on every
node, and torchao's convert inserts (de)quantize nodes and frozen constants without it.

Only those nodes are propagated, each from its inputs' recorded values, in the graph's fake
mode (its shape environment included): a program from ``ep.module()`` has values everywhere
else, and re-running them would be a trace.

A fresh-result op on static shapes (torchao's quantize / dequantize) has a result whose
layout its Meta kernel computes from its inputs' layouts and its other arguments alone, so
the kernel runs once per distinct such key (on meta tensors) and each node gets a new fake
tensor of that layout, built as the fake mode's converter wraps a kernel's result: about
0.01 ms a node, against 0.1 ms for a kernel run per node and 0.4-1 ms through the mode's
dispatch. The scale and zero point of a per-tensor (de)quantize, different at every node,
are left out of the key: its Meta kernel never reads them. Anything else goes through
torch's ``FakeTensorProp``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._export.utils import _detect_fake_mode_from_gm
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
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


class _ResultLayouts:
    """Fake values of fresh-result nodes on static shapes, from their op's Meta kernel run
    once per (op, input layouts, other arguments)."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.known: dict[tuple, tuple[torch.Size, tuple[int, ...], torch.dtype] | None] = {}

    def value_of(self, node: Node) -> FakeTensor | None:
        """``node``'s fake value, or None where the fast path does not apply."""
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
        try:
            layout = self.known[tuple(key)]
        except KeyError:
            layout = self.known[tuple(key)] = _run_meta_kernel(node)
        except TypeError:  # an unhashable argument: the kernel runs for this node alone
            layout = _run_meta_kernel(node)
        if layout is None:
            return None
        shape, stride, dtype = layout
        return FakeTensor(self.mode, torch.empty_strided(shape, stride, dtype=dtype,
                                                         device="meta"), devices.pop())

    def _key(self, value: Any, devices: set[torch.device]) -> Any:
        if isinstance(value, Node):
            v = value.meta.get("val")
            if (not isinstance(v, FakeTensor) or v.fake_mode is not self.mode
                    or v._has_symbolic_sizes_strides):
                raise _Unkeyable
            devices.add(v.fake_device)
            return v.shape, v.stride(), v.dtype, v.fake_device  # the kernel sees no offset
        if isinstance(value, (list, tuple)):
            return type(value), tuple(self._key(v, devices) for v in value)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
            raise _Unkeyable
        return type(value), value  # 1, 1.0 and True key apart


def _run_meta_kernel(node: Node) -> tuple[torch.Size, tuple[int, ...], torch.dtype] | None:
    """The layout of ``node``'s result as its op's Meta kernel gives it, or None if the
    kernel fails or gives no single meta tensor (the general path then reports or handles
    it)."""

    def as_meta(arg: Node) -> torch.Tensor:
        v = arg.meta["val"]
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

    args, kwargs = map_arg((node.args, node.kwargs), as_meta)
    try:
        result = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the general path reports the failure
        return None
    if not isinstance(result, torch.Tensor) or result.device.type != "meta":
        return None
    if result.storage_offset() != 0:
        return None
    return result.shape, result.stride(), result.dtype
