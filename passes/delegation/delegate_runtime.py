"""The delegate at run time: the ``call_delegate`` operator, the lowered module, a backend.

The transform that creates delegate calls is :mod:`passes.delegation.partitions_to_delegates`.

A lowered partition appears in the top-level graph as::

    lowered_module_0 = get_attr[target=lowered_module_0]
    call_delegate = torch.ops.higher_order.call_delegate(lowered_module_0, x, k_cache)
    getitem = call_delegate[0]

``call_delegate`` is a :class:`~torch._ops.HigherOrderOperator`, the one kind of
non-aten callable the export verifier admits, like ExecuTorch's
``executorch_call_delegate``. Its first argument is a :class:`LoweredBackendModule`
registered on the graph module. The class carries that name and the fields
``backend_id``, ``processed_bytes``, ``compile_specs``, ``original_module`` because
torch's export verifier recognises exactly that shape as a backend delegate on a
``get_attr`` node; with it the top level stays a valid ``ExportedProgram`` that
``ep.module()`` unlifts and runs.

The delegate holds its partition as a sub-``ExportedProgram``. The reference CPU
backend executes that program's graph with its lifted state: parameters and buffers
it owns come from the sub-program's state dict, and each ``BUFFER_MUTATION`` output
is written back into that state after the call, so state the delegate owns persists
across calls. Several unlifted copies of one program (``ep.module()``) share one
lowered module, as they share buffer tensors.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._higher_order_ops.utils import register_fake
from torch._ops import HigherOrderOperator
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    get_proxy_slot,
    track_tensor_tree,
)

from .errors import DelegationError

__all__ = [
    "REFERENCE_BACKEND",
    "CallDelegate",
    "LoweredBackendModule",
    "call_delegate",
    "is_delegate_call",
    "is_delegate_output",
    "lowered_module_name",
    "run_subprogram",
]

REFERENCE_BACKEND = "reference_cpu"


def lowered_module_name(root: torch.nn.Module, index: int = 0) -> str:
    """The first free attribute name ``lowered_module_{i}`` on ``root``, from ``i = index``."""
    while hasattr(root, f"lowered_module_{index}"):
        index += 1
    return f"lowered_module_{index}"


def run_subprogram(program: ExportedProgram, args: Sequence[Any]) -> tuple[Any, ...]:
    """Execute ``program``'s graph once on ``args`` with its own state; return the user outputs.

    Lifted inputs are read from the program's state dict (parameters, persistent
    buffers) or constants (non-persistent buffers, constant tensors). Buffer mutations
    are written back in place after the graph ran, so the state dict holds the new values.
    """
    signature = program.graph_signature
    user_args = iter(args)
    flat: list[Any] = []
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            flat.append(next(user_args))
        elif spec.target in program.state_dict:
            flat.append(program.state_dict[spec.target])
        else:
            flat.append(program.constants[spec.target])
    outputs = program.graph_module(*flat)
    user_outputs = []
    with torch.no_grad():
        for spec, value in zip(signature.output_specs, outputs, strict=True):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                state = program.state_dict.get(spec.target)
                if state is None:
                    state = program.constants[spec.target]
                state.copy_(value)
            else:
                user_outputs.append(value)
    return tuple(user_outputs)


class LoweredBackendModule(torch.nn.Module):
    """A lowered partition: its sub-ExportedProgram and the backend that runs it.

    Attributes:
        tag: the partition's ``delegation_tag``.
        program: the partition as an ExportedProgram (also ``original_module``).
        backend_id: which backend executes it (``"reference_cpu"``: :func:`run_subprogram`).
        processed_bytes: the backend's compiled payload; the reference backend has none.
        compile_specs: backend options.
    """

    def __init__(
        self,
        program: ExportedProgram,
        tag: str,
        backend_id: str = REFERENCE_BACKEND,
        compile_specs: list | None = None,
    ):
        super().__init__()
        self.program = program
        self.tag = tag
        self.backend_id = backend_id
        self.processed_bytes = b""
        self.compile_specs = list(compile_specs or [])

    @property
    def original_module(self) -> ExportedProgram:
        return self.program

    def owned_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers this delegate owns (consumed from the top level), by FQN."""
        owned = {}
        for spec in self.program.graph_signature.input_specs:
            if spec.kind == InputKind.BUFFER:
                store = self.program.state_dict if spec.persistent else self.program.constants
                owned[spec.target] = store[spec.target]
        return owned

    def forward(self, *args: Any) -> tuple[Any, ...]:
        if self.backend_id != REFERENCE_BACKEND:
            raise DelegationError(
                f"delegate {self.tag!r} was lowered for backend {self.backend_id!r}, which has "
                f"no runtime here; only {REFERENCE_BACKEND!r} delegates run on this host",
                pass_name="call_delegate",
            )
        return run_subprogram(self.program, args)

    def extra_repr(self) -> str:
        return f"tag={self.tag!r}, backend_id={self.backend_id!r}"


class CallDelegate(HigherOrderOperator):
    """``call_delegate(lowered_module, *args) -> tuple``: run a lowered partition."""

    def __init__(self):
        super().__init__("call_delegate")

    def __call__(self, lowered_module: LoweredBackendModule, *args: Any) -> tuple[Any, ...]:
        return super().__call__(lowered_module, *args)


call_delegate = CallDelegate()


def is_delegate_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is call_delegate


def is_delegate_output(node: torch.fx.Node) -> bool:
    """A ``getitem`` reading one result of a delegate call."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and is_delegate_call(node.args[0])
    )


@call_delegate.py_impl(torch._C.DispatchKey.CompositeExplicitAutograd)
def _call_delegate_eager(lowered_module: LoweredBackendModule, *args: Any) -> tuple[Any, ...]:
    return lowered_module(*args)


@call_delegate.py_autograd_impl
def _call_delegate_autograd(lowered_module: LoweredBackendModule, *args: Any) -> tuple[Any, ...]:
    # A backend computes forward values only; gradients do not flow through delegates.
    with torch._C._AutoDispatchBelowAutograd():
        return call_delegate(lowered_module, *args)


def _output_values(lowered_module: LoweredBackendModule) -> list[Any]:
    program = lowered_module.program
    output = program.graph.output_node()
    values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in output.args[0]]
    return [
        value
        for value, spec in zip(values, program.graph_signature.output_specs, strict=True)
        if spec.kind != OutputKind.BUFFER_MUTATION
    ]


@register_fake(call_delegate)
def _call_delegate_fake(lowered_module: LoweredBackendModule, *args: Any) -> tuple[Any, ...]:
    # Shapes are static per lowered program: fresh tensors shaped like the recorded outputs.
    return tuple(
        torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        if isinstance(v, torch.Tensor) else v
        for v in _output_values(lowered_module)
    )


@call_delegate.py_impl(ProxyTorchDispatchMode)
def _call_delegate_trace(mode: ProxyTorchDispatchMode, lowered_module: LoweredBackendModule, *args):
    with disable_proxy_modes_tracing():
        out = _call_delegate_fake(lowered_module, *args)
    root = mode.tracer.root
    name = next(
        (n for n, m in root.named_children() if m is lowered_module), None
    )
    if name is None:
        name = lowered_module_name(root)
        root.register_module(name, lowered_module)

    def unwrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return get_proxy_slot(value, mode.tracer, value, lambda slot: slot.proxy)
        return value

    proxy_args = pytree.tree_map(unwrap, (lowered_module, *args))
    out_proxy = mode.tracer.create_proxy(
        "call_function", call_delegate, proxy_args, {}, name="call_delegate"
    )
    return track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)


@call_delegate.py_functionalize_impl
def _call_delegate_functionalize(ctx, lowered_module: LoweredBackendModule, *args: Any):
    unwrapped = tuple(ctx.unwrap_tensors(arg) for arg in args)
    with ctx.redispatch_to_next():
        return ctx.wrap_tensors(call_delegate(lowered_module, *unwrapped))
