"""The whole mutable-buffer flow on one model, as the main job (``python -m passes run``) runs it.

export -> MarkMutableBuffers -> InplaceToFunctional -> pt2e quantization through
PassQuantizer (SkipAnnotateDataMovementOps) -> calibrate -> reset_mutable_buffers ->
convert -> UnfreezeMutableBuffer -> to_delegate + ConsumeBufferMutationsInDelegate ->
decode, next to the same model quantized without the passes, both compared with fp32 eager.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pass_manager import PassManager, Report, run_program
from pass_manager.validation import Trace, first_difference

from .consume_buffer_mutations_in_delegate import ConsumeBufferMutationsInDelegate
from .delegation import AllNodePartitioner, delegates, to_delegate
from .delegation.ownership import program_state
from .examples import xnnpack_quantizer
from .inplace_to_functional import InplaceToFunctional
from .mark_mutable_buffers import MarkMutableBuffers
from .skip_annotate_data_movement_ops import SkipAnnotateDataMovementOps
from .unfreeze_mutable_buffer import UnfreezeMutableBuffer

__all__ = ["Check", "FlowResult", "run_flow"]

Log = Callable[[str], None]
# A quantized buffer within 5% of its fp32 magnitude is within 8-bit quantization error
# accumulated over a decode (one uint8 step of a min/max range is ~0.4% of it).
BUFFER_TOLERANCE = 0.05


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class FlowResult:
    plan: str = ""
    dot: str = ""
    reports: list[tuple[str, Report]] = field(default_factory=list)
    delegate_summary: list[str] = field(default_factory=list)
    step_errors: dict[str, list[float]] = field(default_factory=dict)
    buffer_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks)

    def pass_table(self) -> str:
        merged = Report()
        for stage, report in self.reports:
            for record in report.records:
                merged.records.append(copy.copy(record))
                merged.records[-1].name = f"{stage}: {record.name}"
            merged.warnings += report.warnings
        return merged.table()

    def decode_table(self) -> str:
        names = list(self.step_errors)
        header = "step  " + "  ".join(f"{n:>28}" for n in names)
        steps = max((len(v) for v in self.step_errors.values()), default=0)
        rows = [
            f"{s:>4}  " + "  ".join(f"{self.step_errors[n][s]:>28.6f}" for n in names)
            for s in range(steps)
        ]
        lines = ["max abs output error vs fp32 eager, per decode step", header, *rows]
        for name, errors in self.buffer_errors.items():
            worst = max(errors, key=errors.get, default=None)
            if worst is not None:
                lines.append(
                    f"{name}: worst buffer error {errors[worst]:.2%} of the fp32 value ({worst})"
                )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "plan": self.plan,
            "passes": {stage: report.to_dict() for stage, report in self.reports},
            "delegates": self.delegate_summary,
            "step_errors": self.step_errors,
            "buffer_errors": self.buffer_errors,
            "checks": [c.__dict__ for c in self.checks],
            "ok": self.ok,
        }


def _step_errors(reference: Trace, trace: Trace) -> list[float]:
    errors = []
    for expected, actual in zip(reference.outputs, trace.outputs):
        worst = 0.0
        for e, a in zip(expected, actual):
            if isinstance(e, torch.Tensor):
                worst = max(worst, (e.double() - a.double()).abs().max().item())
        errors.append(worst)
    return errors


def _buffer_errors(reference: Trace, trace: Trace) -> dict[str, float]:
    """Per buffer: worst abs error over all calls, relative to the fp32 buffer's largest value."""
    worst: dict[str, float] = {}
    for expected, actual in zip(reference.buffers, trace.buffers):
        for name, value in expected.items():
            if name not in actual or not value.is_floating_point():
                continue
            scale = max(value.abs().max().item(), 1e-12)
            error = (value.double() - actual[name].double()).abs().max().item() / scale
            worst[name] = max(worst.get(name, 0.0), error)
    return worst


def _calibrate(prepared: torch.nn.Module, steps: Sequence[tuple]) -> None:
    with torch.no_grad():
        for args in steps:
            prepared(*copy.deepcopy(args))


class _Stages:
    """Runs the stages in order, logging each with its duration so long steps show progress."""

    def __init__(self, log: Log):
        self.log = log

    def __call__(self, title: str, fn: Callable[[], Any]) -> Any:
        self.log(f"[{title}] ...")
        start = time.perf_counter()
        value = fn()
        self.log(f"[{title}] done in {time.perf_counter() - start:.2f} s")
        return value


def run_flow(
    model: torch.nn.Module,
    example_inputs: tuple,
    steps: Sequence[tuple],
    *,
    quantize: bool = True,
    delegate: bool = True,
    quantizer_factory: Callable[[], Any] = xnnpack_quantizer,
    calibration: Sequence[tuple] | None = None,
    log: Log = print,
    pipeline: PassManager | None = None,
) -> FlowResult:
    """Run the flow; ``steps`` holds one argument tuple per decode call.

    ``calibration`` (default: ``steps``) is what the quantized programs are calibrated on.
    ``pipeline`` replaces the functionalization stage (MarkMutableBuffers,
    InplaceToFunctional), e.g. ``parse_pipeline(text)`` from ``--pipeline``.
    The program quantized without the passes is the one users get today: the functional
    form from ``run_decompositions({})``, quantized by the same quantizer.
    """
    calibration = list(steps) if calibration is None else list(calibration)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from . import reset_mutable_buffers
    from .quantization import PassQuantizer

    stage = _Stages(log)
    result = FlowResult()
    functionalize = pipeline or PassManager([MarkMutableBuffers(), InplaceToFunctional()])
    # The stages run as separate pipelines around torchao's calls; their union is the DAG
    # that fixes the order, which is what the plan shows.
    every_pass = PassManager(
        [
            MarkMutableBuffers(),
            InplaceToFunctional(),
            SkipAnnotateDataMovementOps(),
            UnfreezeMutableBuffer(),
            ConsumeBufferMutationsInDelegate(),
        ]
    )
    result.plan = every_pass.explain()
    result.dot = every_pass.to_dot()

    eager = stage("fp32 eager decode", lambda: run_program(model, steps))
    exported = stage(
        "export", lambda: torch.export.export(copy.deepcopy(model), copy.deepcopy(example_inputs))
    )
    functional = stage("functionalize", lambda: functionalize.run(exported))
    result.reports.append(("functionalize", functional.report))
    program: Any = functional.program
    _check_same(result, "functional program matches fp32 eager", eager, run_program(program, steps))

    if quantize:

        def quantize_without_passes() -> torch.nn.Module:
            ep = torch.export.export(copy.deepcopy(model), copy.deepcopy(example_inputs))
            prepared = prepare_pt2e(ep.run_decompositions({}).module(), quantizer_factory())
            _calibrate(prepared, calibration)
            return convert_pt2e(prepared)

        plain = stage("quantize without the passes", quantize_without_passes)
        plain_trace = run_program(plain, steps)
        result.step_errors["quantized, no passes"] = _step_errors(eager, plain_trace)
        result.buffer_errors["quantized, no passes"] = _buffer_errors(eager, plain_trace)

        def quantize_with_passes() -> torch.nn.Module:
            quantizer = PassQuantizer(
                quantizer_factory(),
                transform=[MarkMutableBuffers()],
                after_annotate=[SkipAnnotateDataMovementOps()],
            )
            prepared = prepare_pt2e(functional.program.module(), quantizer)
            for title, report in zip(("before annotation", "after annotation"), quantizer.reports):
                result.reports.append((title, report))
            _calibrate(prepared, calibration)
            reset_mutable_buffers(prepared)
            converted = convert_pt2e(prepared)
            unfrozen = PassManager([UnfreezeMutableBuffer()]).run(converted)
            result.reports.append(("after convert", unfrozen.report))
            return unfrozen.program

        quantized = stage("quantize with the passes", quantize_with_passes)
        quantized_trace = run_program(quantized, steps)
        errors = _step_errors(eager, quantized_trace)
        result.step_errors["quantized, with passes"] = errors
        buffer_errors = _buffer_errors(eager, quantized_trace)
        result.buffer_errors["quantized, with passes"] = buffer_errors
        worst_name = max(buffer_errors, key=buffer_errors.get, default="")
        worst = buffer_errors.get(worst_name, 0.0)
        result.checks.append(
            Check(
                f"quantized buffers track fp32 within {BUFFER_TOLERANCE:.0%}",
                worst <= BUFFER_TOLERANCE,
                f"worst {worst_name or 'buffer'}: {worst:.2%} of its fp32 magnitude",
            )
        )
        plain_worst = max(result.step_errors["quantized, no passes"])
        result.checks.append(
            Check(
                "the passes do not make the quantized decode worse",
                max(errors) <= plain_worst + 1e-6,
                f"worst step error {max(errors):.6f} with the passes, {plain_worst:.6f} without",
            )
        )
        if delegate:
            reexported = stage(
                "re-export the quantized program",
                lambda: torch.export.export(quantized, copy.deepcopy(example_inputs)),
            )
            refunctional = stage("functionalize again", lambda: functionalize.run(reexported))
            result.reports.append(("functionalize quantized", refunctional.report))
            program = refunctional.program
        else:
            program = quantized
        reference = quantized_trace
    else:
        reference = eager

    if delegate:
        lowered = stage("to_delegate", lambda: to_delegate(program, AllNodePartitioner()))
        consumed = stage(
            "consume buffer mutations",
            lambda: PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered),
        )
        result.reports.append(("delegation", consumed.report))
        program = consumed.program
        for info in delegates(program):
            owned = ", ".join(sorted(info.owned_buffers)) or "none"
            result.delegate_summary.append(f"{info.tag}: owns {owned}")
        final = stage(
            "decode the lowered program", lambda: run_program(program, steps, state=program_state)
        )
        _check_same(result, "delegated program matches its input program", reference, final)
        name = "full pipeline" if quantize else "fp32 pipeline"
        result.step_errors[name] = _step_errors(eager, final)
        result.buffer_errors[name] = _buffer_errors(eager, final)
    elif not quantize:
        result.step_errors["fp32 pipeline"] = _step_errors(eager, run_program(program, steps))
    return result


def _check_same(result: FlowResult, name: str, expected: Trace, actual: Trace) -> None:
    difference = first_difference(expected, actual)
    result.checks.append(Check(name, difference is None, difference or "outputs and buffers equal"))
