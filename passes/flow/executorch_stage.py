"""The main job's runtime stage (``--runtime executorch``): decode on ExecuTorch's runtime.

Needs the ``executorch`` extra; :mod:`passes.flow.run` imports this only for that stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pass_manager.validation import Trace, run_program

from .._analysis.buffers import find_mutations
from .._analysis.write_bounds import check_writes_within_state
from ..executorch.plan import planned_memory
from ..executorch.runtime import (
    LoweredProgram,
    decode_on_runtime,
    lower_for_runtime,
    output_grid,
    refuse_missing_operators,
    runtime_steps,
    within_grid_steps_per_call,
)
from .checks import NO_OUTPUT, returns_no_tensor
from .result import Check

__all__ = ["check_runtime_steps", "flow_stage", "lower_checked"]

FP32_TOLERANCE = 1e-5


def _worst_per_step(reference: Trace, trace: Trace) -> list[float]:
    return [
        max((float((e.double() - a.double()).abs().max())
             for e, a in zip(expected, actual, strict=True)
             if isinstance(e, torch.Tensor) and e.numel()),  # an empty output: no error
            default=0.0)
        for expected, actual in zip(reference.outputs, trace.outputs, strict=True)
    ]


def check_runtime_steps(programs: Sequence[tuple[str, Any]], steps: Sequence[Any]) -> None:
    """Check ``steps`` against every program the stage will lower, in a moment: a step the
    runtime cannot take fails here, naming the step and the input, before the lowerings
    (seconds to a minute each). :func:`flow_stage` runs it first; a flow may run it
    earlier still.

    Raises:
        ExecuTorchInputError: a step does not fit a program's inputs.
        StatePastEndError: a step writes a buffer past its end (more steps than the cache
            holds), where the runtime would fail with an untyped error 0x12.
    """
    for _, program in programs:
        flat = runtime_steps("decode_on_runtime", program, steps)
        check_writes_within_state("decode_on_runtime", {"forward": program},
                                  [("forward", step) for step in flat],
                                  lambda step, _: f"steps[{step}]")


def lower_checked(program: Any, example_inputs: tuple) -> LoweredProgram:
    """``program`` lowered for the runtime, and refused now if the runtime could not load
    it (an operator it has no kernel for, named with its node and line) or would not keep
    its state (a written parameter, refused before lowering): the flow lowers its fp32
    program so before quantizing, which these refusals would otherwise wait for.

    Raises:
        ExecuTorchInputError: the program calls an operator this runtime lacks.
        ParameterMutationOnExecuTorchError: the program writes a parameter.
    """
    lowered = lower_for_runtime(program, example_inputs)
    refuse_missing_operators("lower_for_runtime", lowered.pte,
                             {} if lowered.program is None else {"forward": lowered.program})
    return lowered


def flow_stage(
    result: Any,
    stage: Any,
    programs: Sequence[tuple[str, Any]],
    example_inputs: tuple,
    steps: Sequence[Any],
    eager: Trace,
    lowered_before: Mapping[str, LoweredProgram] | None = None,
) -> None:
    """Lower each ``(name, program)`` to a ``.pte``, decode it on the runtime and add it to
    the flow's report.

    ``steps`` are the flow's calls as the program takes them in Python (argument tuples or
    ``(args, kwargs)`` pairs); they are checked against every program before the first
    lowering. Adds a ``"<name> on executorch"`` column to the per-step error table (vs fp32
    eager), a line per program to the delegate summary (delegates, .pte size, planned
    mutable-buffer bytes read from its execution plan, the wrapper's notes) and a check that
    the runtime's outputs match the Python program's at every step: within 1e-5 in fp32,
    within one step of the output's quantization grid when quantized, one more per call
    before it when the program writes state
    (:func:`~passes.executorch.runtime.within_grid_steps_per_call`). With ``--quantize-state`` the
    planned bytes of the quantized programs also go to ``result.state_storage``.
    ``lowered_before`` holds programs (by name) the flow lowered already
    (:func:`lower_checked`), decoded as they are.
    """
    stage("check the steps against the programs' inputs",
          lambda: check_runtime_steps(programs, steps))
    for name, program in programs:
        python = run_program(program, list(steps))
        lowered = (lowered_before or {}).get(name) or stage(
            f"lower the {name} program to a .pte",
            lambda program=program: lower_for_runtime(program, example_inputs))
        # Read from the .pte before it runs: the plan is in the report even if the run fails.
        planned = planned_memory(lowered.pte).mutable_buffer_bytes
        if result.state_storage and name != "fp32":
            result.state_storage["planned_mutable_buffer_bytes"][name] = planned
        decoded = stage(f"decode the {name} program on ExecuTorch's runtime",
                        lambda lowered=lowered: decode_on_runtime(lowered, None, steps))
        result.step_errors[f"{name} on executorch"] = _worst_per_step(eager, decoded.trace)
        grid = output_grid(program)
        differences = _worst_per_step(python, decoded.trace)
        worst = max(differences, default=0.0)
        stateful = bool(find_mutations(program).writers)
        close = (worst <= FP32_TOLERANCE if grid is None else
                 within_grid_steps_per_call(differences, grid, stateful))
        bound = ("1e-5" if grid is None else f"one quantization step ({grid:.3g})"
                 + (" per call so far: the state carries each call's rounding" if stateful
                    else ""))
        result.checks.append(Check(
            f"ExecuTorch runtime decodes the {name} program like Python (within {bound})",
            len(decoded.trace.outputs) == len(python.outputs) and close,
            f"worst step difference {worst:.3g} over {len(python.outputs)} steps"
            if not returns_no_tensor(python) else
            f"{NO_OUTPUT} (the runtime's buffers are not read back)",
        ))
        result.delegate_summary.append(
            f"executorch {name}: {lowered.delegates} XNNPACK delegate(s), .pte "
            f"{len(lowered.pte) / 1024:.0f} KiB, planned mutable buffers {planned:,} B, "
            f"lowered in {lowered.lower_seconds:.1f} s"
        )
        # The wrapper's notes on buffer ownership, and any on state a step did not carry.
        result.delegate_summary += [f"  {note}" for note in decoded.notes]
