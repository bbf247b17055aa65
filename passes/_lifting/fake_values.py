"""Fake tensor values for the nodes that lack one: an ExportedProgram needs ``val`` on every
node, and torchao's convert inserts (de)quantize nodes and frozen constants without it.

Only those nodes are propagated, each from its inputs' recorded values, in the graph's fake
mode (its shape environment included): a program from ``ep.module()`` has values everywhere
else, and re-running them would be a trace. A fresh-result op on static shapes (torchao's
quantize / dequantize) runs its Meta kernel on meta tensors, and the fake mode's converter
wraps the result, as the mode's own dispatch does: about 0.1 ms against 0.4-1 ms a node through
the mode's dispatch (its cache keys on the scale, which differs at every node). Anything
else goes through torch's ``FakeTensorProp``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._export.utils import _detect_fake_mode_from_gm
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Graph, GraphModule, Node, map_arg
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .._analysis.op_schema import facts_of
from ..errors import LiftError

__all__ = ["fake_mode_of", "fill_missing_values"]


def fake_mode_of(gm: GraphModule) -> FakeTensorMode:
    """The fake mode the graph's values were made in (a fresh one if it has none)."""
    mode = _detect_fake_mode_from_gm(gm)
    return mode if mode is not None else FakeTensorMode(shape_env=ShapeEnv())


def fake_state_value(mode: FakeTensorMode, tensor: torch.Tensor) -> Any:
    """A fake value for a lifted tensor that has none (a frozen constant): static shapes,
    as export gives parameters and buffers."""
    return mode.from_tensor(tensor, static_shapes=True)


def fill_missing_values(graph: Graph, gm: GraphModule, mode: FakeTensorMode) -> int:
    """Give each call_function node of ``graph`` without a ``val`` one, from its inputs'.

    ``gm`` holds the subgraphs ``graph``'s ``get_attr`` nodes name. Returns how many nodes
    were propagated.
    """
    missing = [n for n in graph.nodes if n.op == "call_function" and "val" not in n.meta]
    if not missing:
        return 0
    prop: FakeTensorProp | None = None
    for node in missing:
        if _meta_kernel_value(node, mode):
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


_HAS_META: dict[Any, bool] = {}


def _static_fake(value: Any, mode: FakeTensorMode) -> bool:
    return isinstance(value, FakeTensor) and value.fake_mode is mode and all(
        isinstance(d, int) for d in (*value.shape, *value.stride()))


def _meta_kernel_value(node: Node, mode: FakeTensorMode) -> bool:
    """Set ``node``'s value from its op's Meta kernel, if the fast path applies."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return False
    facts = facts_of(node)
    if facts is None or not facts.fresh or facts.may_write or facts.maybe_view:
        return False
    has_meta = _HAS_META.get(op)
    if has_meta is None:
        has_meta = _HAS_META[op] = torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "Meta")
    values = [a.meta.get("val") for a in node.all_input_nodes]
    if not has_meta or not values or not all(_static_fake(v, mode) for v in values):
        return False
    devices = {v.device for v in values}
    if len(devices) != 1:
        return False

    def as_meta(arg: Node) -> torch.Tensor:
        v = arg.meta["val"]
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

    args, kwargs = map_arg((node.args, node.kwargs), as_meta)
    try:
        result = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the general path below reports the failure
        return False
    if not isinstance(result, torch.Tensor) or result.device.type != "meta":
        return False
    node.meta["val"] = mode.fake_tensor_converter.from_meta_and_device(
        mode, result, devices.pop())
    return True
