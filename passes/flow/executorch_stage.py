"""The main job's runtime stage (``--runtime executorch``): decode on ExecuTorch's runtime.

Needs the ``executorch`` extra; :mod:`passes.flow.run` imports this only for that stage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from pass_manager.validation import Trace, run_program

from ..executorch.plan import planned_memory
from ..executorch.runtime import decode_on_runtime, lower_to_pte, output_grid
from .result import Check

__all__ = ["flow_stage"]

FP32_TOLERANCE = 1e-5


def _worst_per_step(reference: Trace, trace: Trace) -> list[float]:
    return [
        max((float((e.double() - a.double()).abs().max())
             for e, a in zip(expected, actual, strict=True) if isinstance(e, torch.Tensor)),
            default=0.0)
        for expected, actual in zip(reference.outputs, trace.outputs, strict=True)
    ]


def flow_stage(
    result: Any,
    stage: Any,
    programs: Sequence[tuple[str, Any]],
    example_inputs: tuple,
    steps: Sequence[Any],
    eager: Trace,
) -> None:
    """Lower each ``(name, program)`` to a ``.pte``, decode it on the runtime and add it to
    the flow's report.

    Adds a ``"<name> on executorch"`` column to the per-step error table (vs fp32 eager),
    a line per program to the delegate summary (delegates, .pte size, planned mutable-buffer
    bytes read from its execution plan, the wrapper's notes) and a check that the runtime's
    outputs match the Python program's at every step: within 1e-5 in fp32, within one step
    of the output's quantization grid when quantized. With ``--quantize-state`` the planned
    bytes of the quantized programs also go to ``result.state_storage``.
    """
    for name, program in programs:
        python = run_program(program, list(steps))

        def lower(program: Any = program) -> tuple[bytes, Any, int, float]:
            start = time.perf_counter()
            pte, wrapper, delegates = lower_to_pte(program, example_inputs)
            return pte, wrapper, delegates, time.perf_counter() - start

        pte, wrapper, delegates, seconds = stage(f"lower the {name} program to a .pte", lower)
        # Read from the .pte before it runs: the plan is in the report even if the run fails.
        planned = planned_memory(pte).mutable_buffer_bytes
        if result.state_storage and name != "fp32":
            result.state_storage["planned_mutable_buffer_bytes"][name] = planned
        decoded = stage(f"decode the {name} program on ExecuTorch's runtime",
                        lambda pte=pte: decode_on_runtime(pte, None, steps))
        result.step_errors[f"{name} on executorch"] = _worst_per_step(eager, decoded.trace)
        grid = output_grid(program)
        tolerance = FP32_TOLERANCE if grid is None else grid
        worst = max(_worst_per_step(python, decoded.trace), default=0.0)
        bound = "1e-5" if grid is None else f"one quantization step ({grid:.3g})"
        result.checks.append(Check(
            f"ExecuTorch runtime decodes the {name} program like Python (within {bound})",
            len(decoded.trace.outputs) == len(python.outputs) and worst <= tolerance,
            f"worst step difference {worst:.3g} over {len(python.outputs)} steps",
        ))
        result.delegate_summary.append(
            f"executorch {name}: {delegates} XNNPACK delegate(s), .pte {len(pte) / 1024:.0f} "
            f"KiB, planned mutable buffers {planned:,} B, lowered in {seconds:.1f} s"
        )
        notes = wrapper.notes if wrapper is not None else []
        result.delegate_summary += [f"  {note}" for note in notes]
