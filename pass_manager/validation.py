"""Run programs for several calls and compare what they compute.

A program (``nn.Module``, ``GraphModule`` or ``ExportedProgram``) is deep-copied and called
once per call's inputs; after every call its outputs, buffers (by fully-qualified name) and
inputs are recorded. Two traces compare exactly (:func:`first_difference`) or by size of
the error (:func:`output_errors`, :func:`buffer_errors`).
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

__all__ = [
    "Call",
    "StateReader",
    "Trace",
    "as_call",
    "assert_same_behaviour",
    "buffer_errors",
    "call_inputs",
    "copy_program",
    "default_state",
    "first_difference",
    "output_errors",
    "run_program",
    "snapshot",
]

StateReader = Callable[[torch.nn.Module], dict[str, torch.Tensor]]
# One call's inputs, normalized: positional arguments and keyword arguments.
Call = tuple[tuple, dict[str, Any]]


@dataclass
class Trace:
    """What a program computed: one entry per call."""

    outputs: list[list[Any]] = field(default_factory=list)
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    inputs: list[list[Any]] = field(default_factory=list)


def as_call(inputs: Any) -> Call:
    """One call's inputs as ``(args, kwargs)``.

    ``inputs`` is an argument tuple, an ``(args, kwargs)`` pair (a 2-tuple of a tuple or list
    and a mapping), a mapping of keyword arguments, or a single argument. A call whose two
    positional arguments really are a tuple and a mapping is written as a pair:
    ``((t, m), {})``.
    """
    if (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list))
            and isinstance(inputs[1], Mapping)):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_inputs(inputs: Any, calls: int | None = None) -> list[Call]:
    """Normalize to one ``(args, kwargs)`` pair per call.

    ``inputs`` is either one call's inputs (an argument tuple, an ``(args, kwargs)`` pair or a
    keyword mapping; repeated ``calls`` times) or a list of them (one per call).
    """
    if isinstance(inputs, (tuple, Mapping)):
        return [as_call(inputs)] * (calls or 1)
    per_call = [as_call(entry) for entry in inputs]
    if calls is not None:
        if calls > len(per_call):
            raise ValueError(f"asked for {calls} calls but got inputs for {len(per_call)}")
        per_call = per_call[:calls]
    return per_call


def copy_program(program: Any) -> Any:
    """``copy.deepcopy`` that also copies, detached, the non-leaf tensors it refuses (lifted
    constants of a program exported outside ``torch.no_grad()``, a computed tensor a model
    keeps in a plain attribute)."""
    try:
        return copy.deepcopy(program)
    except RuntimeError:
        memo: dict[int, Any] = {}
        for tensor in _held_tensors(program):
            if not tensor.is_leaf and id(tensor) not in memo:
                memo[id(tensor)] = tensor.detach().clone()
        if not memo:
            raise
        return copy.deepcopy(program, memo)


# Objects whose attributes are code or fx metadata (fake tensors), never a program's state.
_NOT_STATE = (
    type,
    types.FunctionType,
    types.MethodType,
    types.ModuleType,
    torch.fx.Graph,
    torch.fx.Node,
)


def _held_tensors(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes and containers."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif hasattr(value, "__dict__") and not isinstance(value, _NOT_STATE):
            stack.extend(vars(value).values())
    return found


def default_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state a trace records by default: a copy of every buffer, by name."""
    return {name: buf.detach().clone() for name, buf in module.named_buffers()}


def _runnable(program: Any) -> torch.nn.Module:
    program = copy_program(program)
    if isinstance(program, ExportedProgram):
        return program.module()
    if isinstance(program, torch.nn.Module):
        return program
    raise TypeError(f"cannot run a {type(program).__name__}")


def snapshot(values: Any) -> list[Any]:
    flat, _ = pytree.tree_flatten(values)
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in flat]


def run_program(
    program: Any,
    inputs: Any,
    calls: int | None = None,
    state: StateReader = default_state,
    on_call: Callable[[int], None] | None = None,
) -> Trace:
    """Call a deep copy of ``program`` once per call's inputs (see :func:`call_inputs`); the
    caller's state is untouched. ``on_call(index)`` runs after each call. The inputs of all
    calls are copied together, so a tensor several calls pass (state a program writes in
    place, as Hugging Face's exporter passes its caches) stays one tensor across them."""
    module = _runnable(program)
    trace = Trace()
    for index, (args, kwargs) in enumerate(copy.deepcopy(call_inputs(inputs, calls))):
        with torch.no_grad():
            out = module(*args, **kwargs)
        trace.outputs.append(snapshot(out))
        trace.buffers.append(state(module))
        trace.inputs.append(snapshot((args, kwargs)))
        if on_call is not None:
            on_call(index)
    return trace


def _difference(a: Any, b: Any, atol: float, rtol: float) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None if a == b else f"{a!r} vs {b!r}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.is_floating_point() or a.is_complex():
        close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = a == b
    if bool(close.all()):
        return None
    where = tuple((~close).nonzero()[0].tolist())
    return (f"max abs diff {_abs_error(a, b):.6g}, first at index {where}: "
            f"{a[where].item()} vs {b[where].item()}")


def first_difference(
    expected: Trace, actual: Trace, atol: float = 0.0, rtol: float = 0.0
) -> str | None:
    """Describe the first output, buffer or input that differs, or None if all agree."""
    if len(expected.outputs) != len(actual.outputs):
        return f"{len(expected.outputs)} calls vs {len(actual.outputs)}"
    for call, (exp_out, act_out) in enumerate(zip(expected.outputs, actual.outputs, strict=True)):
        if len(exp_out) != len(act_out):
            return f"call {call}: {len(exp_out)} outputs vs {len(act_out)}"
        for i, (a, b) in enumerate(zip(exp_out, act_out, strict=True)):
            diff = _difference(a, b, atol, rtol)
            if diff:
                return f"call {call}: output {i}: {diff}"
        exp_buf, act_buf = expected.buffers[call], actual.buffers[call]
        missing = sorted(set(exp_buf) - set(act_buf))
        if missing:
            return f"call {call}: buffers missing: {', '.join(missing)}"
        for name in exp_buf:
            diff = _difference(exp_buf[name], act_buf[name], atol, rtol)
            if diff:
                return f"call {call}: buffer {name!r}: {diff}"
        for i, (a, b) in enumerate(zip(expected.inputs[call], actual.inputs[call], strict=True)):
            diff = _difference(a, b, atol, rtol)
            if diff:
                return f"call {call}: input {i} after the call: {diff}"
    return None


def output_errors(expected: Trace, actual: Trace) -> list[float]:
    """Per call, the largest absolute difference over every output tensor (an integer one
    by value: a token id that differs is an error, not an output left out)."""
    return [
        max([_abs_error(a, b) for a, b in zip(exp_out, act_out, strict=True)
             if isinstance(a, torch.Tensor)], default=0.0)
        for exp_out, act_out in zip(expected.outputs, actual.outputs, strict=True)
    ]


def buffer_errors(expected: Trace, actual: Trace) -> list[dict[str, float]]:
    """Per call, the largest absolute difference of each float or complex buffer both traces
    have (a quantized program can hold extra state: observers', delegates'), by name."""
    return [
        {name: _abs_error(value, act_buf[name]) for name, value in exp_buf.items()
         if name in act_buf and (value.is_floating_point() or value.is_complex())}
        for exp_buf, act_buf in zip(expected.buffers, actual.buffers, strict=True)
    ]


def _abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float64)  # complex
    return (a.to(wide) - b.to(wide)).abs().nan_to_num(nan=math.inf, posinf=math.inf).max().item()


def assert_same_behaviour(
    expected: Any,
    actual: Any,
    inputs: Any,
    calls: int | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    state: StateReader = default_state,
) -> None:
    """Raise AssertionError naming the first difference between two programs' behaviour."""
    diff = first_difference(
        run_program(expected, inputs, calls, state),
        run_program(actual, inputs, calls, state),
        atol,
        rtol,
    )
    if diff:
        raise AssertionError(diff)
