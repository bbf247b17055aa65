"""The main job's checks on quantized programs, and the buffer errors they read.

The passes must do no worse than torchao's flow with the caches reset by hand: both are
compared with fp32 eager, and may differ by one step of the grid the compared values live on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from pass_manager.validation import Trace, buffer_errors

from .._analysis.buffers import USER_INPUT, find_mutations
from .._analysis.non_finite_observations import NON_FINITE_MEANING
from .quantization import RESET, WITH_PASSES
from .quantized_graphs import buffer_grid, describe_op_difference, output_grid, quantized_ops
from .result import Check, FlowResult

__all__ = ["NO_OUTPUT", "non_finite_notes", "quantization_checks", "relative_buffer_errors",
           "returns_no_tensor"]

NO_OUTPUT = "the model returns no tensor: no output compared"


def returns_no_tensor(trace: Trace) -> bool:
    """Whether no call of ``trace`` returned a tensor with an element: a check on the
    outputs then compares nothing, and says so instead of an error of 0."""
    return not any(isinstance(value, torch.Tensor) and value.numel()
                   for outputs in trace.outputs for value in outputs)


def relative_buffer_errors(reference: Trace, trace: Trace) -> dict[str, float]:
    """Per buffer: worst abs error over all calls, relative to the fp32 buffer's largest value."""
    worst: dict[str, float] = {}
    for call, errors in enumerate(buffer_errors(reference, trace)):
        for name, error in errors.items():
            fp32 = reference.buffers[call][name]
            # An empty buffer (a cache of zero positions) has no largest value.
            scale = max(fp32.abs().max().item() if fp32.numel() else 0.0, 1e-12)
            worst[name] = max(worst.get(name, 0.0), error / scale)
    return worst


def non_finite_notes(non_finite_reads: list[str]) -> list[str]:
    """A note on the quantized values that held inf, NaN or a value at +-65504 or beyond in
    calibration (``quantize_program``'s report): quantized, each reads a finite value, and the
    comparisons between quantized flows, which all did so, pass while both may be off (a
    -inf mask: off by 1.48). A note, not a failing check: a value a later ``where`` drops
    where it is infinite (T5's ``log`` of relative position 0) is harmless quantized."""
    if not non_finite_reads:
        return []
    return [f"quantized values that held inf, NaN or an extreme value in calibration: "
            f"{'; '.join(non_finite_reads)}: {NON_FINITE_MEANING}; if one reaches the "
            "output (a mask), leave it unquantized (--quantizer every-op does) or keep it "
            "finite"]


def _graph_module(program: Any) -> GraphModule:
    return program.module() if isinstance(program, ExportedProgram) else program


def _worst_abs(reference: Trace, trace: Trace) -> dict[str, float]:
    worst: dict[str, float] = {}
    for errors in buffer_errors(reference, trace):
        for name, error in errors.items():
            worst[name] = max(worst.get(name, 0.0), error)
    return worst


def _no_float_state(eager: Trace, program: Any) -> str:
    """What the buffer check says with no floating-point buffer to compare."""
    integers = sorted(name for name, value in (eager.buffers or [{}])[0].items()
                      if not (value.is_floating_point() or value.is_complex()))
    carried = sorted(state.name for state in find_mutations(program).writers
                     if state.kind == USER_INPUT)
    if carried:  # not "no buffers": the state is in the caller's tensors
        return (f"the model keeps its state in the inputs it writes ({', '.join(carried)}), "
                "not in buffers: the outputs compared below are what measure it")
    if not integers:
        return "the model writes no buffer: nothing to compare"  # it may read some
    return (f"the model's buffers are integers ({', '.join(integers)}): no quantization grid "
            "to compare them on; their values reach the outputs compared below")


def quantization_checks(
    result: FlowResult, eager: Trace, traces: dict[str, Trace], converted: dict[str, Any]
) -> None:
    """The passes must do no worse than torchao's flow with the caches reset by hand.

    Both are compared with fp32 eager; the passes may differ from it by one step of the
    quantization grid the compared values live on (the buffer's or the output's qparams),
    which is the resolution at which two quantized programs can be told apart.
    """
    with_passes, by_hand = _worst_abs(eager, traces[WITH_PASSES]), _worst_abs(eager, traces[RESET])
    # quantize_program's ExportedProgram, read as the module it unlifts to (state as get_attr).
    mine = _graph_module(converted[WITH_PASSES])
    grids = buffer_grid(mine)
    worse = {
        name: (error, by_hand[name], grids.get(name, 0.0))
        for name, error in with_passes.items()
        if name in by_hand and error > by_hand[name] + grids.get(name, 0.0) + 1e-6
    }
    relative = result.buffer_errors[WITH_PASSES]
    worst_name = max(relative, key=relative.get, default="")
    detail = (
        f"8-bit error itself (information): worst {worst_name} "
        f"{relative.get(worst_name, 0.0):.2%} of its fp32 magnitude with the passes, "
        f"{result.buffer_errors[RESET].get(worst_name, 0.0):.2%} without"
    ) if relative else _no_float_state(eager, converted[WITH_PASSES])
    if worse:
        name, (error, theirs, grid) = next(iter(worse.items()))
        detail = (
            f"{name}: worst abs error {error:.6g} with the passes vs {theirs:.6g} without "
            f"(grid step {grid:.3g}); " + detail
        )
    result.checks.append(
        Check(
            "quantized buffers: the passes do no worse than torchao's flow with the caches "
            "reset by hand",
            not worse,
            detail,
        )
    )

    worst, theirs = max(result.step_errors[WITH_PASSES]), max(result.step_errors[RESET])
    grid = output_grid(mine)
    detail = (
        f"worst step error {worst:.6f} with the passes, {theirs:.6f} without "
        f"(caches reset by hand in both; output grid step {grid:.3g})"
    ) if not returns_no_tensor(eager) else f"{NO_OUTPUT} (the buffers are, above)"
    differences = describe_op_difference(
        quantized_ops(mine), quantized_ops(_graph_module(converted[RESET]))
    )
    if differences:
        detail += (
            f"; the two flows quantized different graphs ({differences}), so part of the "
            "difference comes from what was quantized, not from the state"
        )
    result.checks.append(
        Check(
            "the passes do not make the quantized decode worse",
            worst <= theirs + grid + 1e-6,
            detail,
        )
    )
