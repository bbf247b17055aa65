"""Semantic validation: run programs for several calls and compare what they compute.

The same comparison serves the manager's ``validate`` option and the test suite: a
program (eager ``nn.Module``, ``GraphModule`` or ``ExportedProgram``) is deep-copied,
called with each input tuple in turn, and after every call its outputs, its buffers
(by fully-qualified name) and its (possibly mutated) inputs are recorded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

__all__ = [
    "StateReader",
    "Trace",
    "assert_same_behaviour",
    "call_inputs",
    "first_difference",
    "run_program",
]

StateReader = Callable[[torch.nn.Module], dict[str, torch.Tensor]]


@dataclass
class Trace:
    """What a program computed: one entry per call."""

    outputs: list[list[Any]] = field(default_factory=list)
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    inputs: list[list[Any]] = field(default_factory=list)


def call_inputs(inputs: Sequence[Any] | tuple, calls: int | None = None) -> list[tuple]:
    """Normalize to one argument tuple per call.

    ``inputs`` is either one argument tuple (repeated ``calls`` times) or a list of
    argument tuples (one per call).
    """
    if isinstance(inputs, tuple):
        return [inputs] * (calls or 1)
    per_call = [tuple(args) if isinstance(args, (list, tuple)) else (args,) for args in inputs]
    if calls is not None:
        if calls > len(per_call):
            raise ValueError(f"asked for {calls} calls but got inputs for {len(per_call)}")
        per_call = per_call[:calls]
    return per_call


def _default_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: buf.detach().clone() for name, buf in module.named_buffers()}


def _runnable(program: Any) -> torch.nn.Module:
    program = copy.deepcopy(program)
    if isinstance(program, ExportedProgram):
        return program.module()
    if isinstance(program, torch.nn.Module):
        return program
    raise TypeError(f"cannot run a {type(program).__name__}")


def _snapshot(values: Any) -> list[Any]:
    flat, _ = pytree.tree_flatten(values)
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in flat]


def run_program(
    program: Any,
    inputs: Sequence[Any] | tuple,
    calls: int | None = None,
    state: StateReader = _default_state,
) -> Trace:
    """Call a deep copy of ``program`` once per input tuple; the caller's state is untouched."""
    module = _runnable(program)
    trace = Trace()
    for args in call_inputs(inputs, calls):
        args = copy.deepcopy(args)
        with torch.no_grad():
            out = module(*args)
        trace.outputs.append(_snapshot(out))
        trace.buffers.append(state(module))
        trace.inputs.append(_snapshot(args))
    return trace


def _tensor_difference(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> str | None:
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
    bad = (~close).nonzero()[0].tolist()
    diff = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
    where = tuple(bad)
    return (
        f"max abs diff {diff:.6g}, first at index {where}: {a[where].item()} vs {b[where].item()}"
    )


def _value_difference(a: Any, b: Any, atol: float, rtol: float) -> str | None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, atol, rtol)
    return None if a == b else f"{a!r} vs {b!r}"


def first_difference(
    expected: Trace, actual: Trace, atol: float = 0.0, rtol: float = 0.0
) -> str | None:
    """Describe the first output, buffer or input that differs, or None if all agree."""
    if len(expected.outputs) != len(actual.outputs):
        return f"{len(expected.outputs)} calls vs {len(actual.outputs)}"
    for call, (exp_out, act_out) in enumerate(zip(expected.outputs, actual.outputs)):
        if len(exp_out) != len(act_out):
            return f"call {call}: {len(exp_out)} outputs vs {len(act_out)}"
        for i, (a, b) in enumerate(zip(exp_out, act_out)):
            diff = _value_difference(a, b, atol, rtol)
            if diff:
                return f"call {call}: output {i}: {diff}"
        exp_buf, act_buf = expected.buffers[call], actual.buffers[call]
        missing = sorted(set(exp_buf) - set(act_buf))
        if missing:
            return f"call {call}: buffers missing: {', '.join(missing)}"
        for name in exp_buf:
            diff = _tensor_difference(exp_buf[name], act_buf[name], atol, rtol)
            if diff:
                return f"call {call}: buffer {name!r}: {diff}"
        for i, (a, b) in enumerate(zip(expected.inputs[call], actual.inputs[call])):
            diff = _value_difference(a, b, atol, rtol)
            if diff:
                return f"call {call}: input {i} after the call: {diff}"
    return None


def assert_same_behaviour(
    expected: Any,
    actual: Any,
    inputs: Sequence[Any] | tuple,
    calls: int | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    state: StateReader = _default_state,
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
