"""The main job's two quantized flows: torchao's as users run it, and the one with the passes.

torchao's flow without the passes is the one users get today: the functional form from
``run_decompositions({})``, prepared, calibrated and converted. Its calibration leaves its
state in the buffers, so it is also converted once with the buffers put back by hand, which
is the like-for-like comparison for the flow with the passes (there
``reset_mutable_buffers`` does the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pass_manager import PassManager
from pass_manager.validation import Trace, copy_program

from ..mark_mutable_buffers import MarkMutableBuffers
from ..quantization import PassQuantizer
from ..skip_annotate_data_movement_ops import SkipAnnotateDataMovementOps
from ..unfreeze_mutable_buffer import UnfreezeMutableBuffer
from .result import FlowError

__all__ = ["quantize_both_ways"]

NO_PASSES, RESET, WITH_PASSES = (
    "quantized, no passes",
    "quantized, no passes, caches reset by hand",
    "quantized, with passes",
)


def quantize_both_ways(
    stage: Any,
    exported: torch.export.ExportedProgram,
    functional: torch.export.ExportedProgram,
    quantizer_factory: Callable[[], Any],
    calibration: list,
    steps: list,
    pass_options: dict[str, Any] | None = None,
) -> tuple[dict[str, Trace], dict[str, Any]]:
    """Quantize ``exported`` without the passes and ``functional`` with them; decode each.

    ``stage`` is the flow's stage runner (titles, timing, per-step progress). Returns the
    decode traces and the converted programs by flow name; when torchao's flow fails on
    its own, only the flow with the passes (and a note saying why). ``pass_options`` are
    PassManager options for the passes' pipelines.
    """
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from .. import reset_mutable_buffers

    converted: dict[str, Any] = {}

    def without_passes() -> None:
        gm = copy_program(exported).run_decompositions({}).module()
        initial = {name: b.detach().clone() for name, b in gm.named_buffers()}
        prepared = prepare_pt2e(gm, quantizer_factory())
        stage.calibrate(prepared, calibration)
        converted[NO_PASSES] = convert_pt2e(copy_program(prepared))
        with torch.no_grad():
            for name, value in initial.items():
                prepared.get_buffer(name).copy_(value)
        converted[RESET] = convert_pt2e(prepared)

    def with_passes() -> None:
        quantizer = PassQuantizer(
            quantizer_factory(),
            transform=[MarkMutableBuffers()],
            after_annotate=[SkipAnnotateDataMovementOps()],
            **(pass_options or {}),
        )
        prepared = prepare_pt2e(copy_program(functional).module(), quantizer)
        titles = ("before annotation", "after annotation")
        for title, report in zip(titles, quantizer.reports, strict=True):
            stage.result.reports.append((title, report))
        stage.calibrate(prepared, calibration)
        reset_mutable_buffers(prepared)
        unfrozen = PassManager([UnfreezeMutableBuffer()], **(pass_options or {})).run(
            convert_pt2e(prepared)
        )
        stage.result.reports.append(("after convert", unfrozen.report))
        converted[WITH_PASSES] = unfrozen.program

    try:
        stage("quantize without the passes", without_passes)
    except FlowError as e:
        # torchao's own flow failing on this model is no failure of the passes: the flow
        # goes on with the passes, and the comparisons that need the baseline are skipped.
        stage.result.failure = None
        converted.pop(NO_PASSES, None)
        stage.result.notes.append(
            f"torchao's flow without the passes failed ({'; '.join(e.failure.lines())}); "
            "the checks comparing with it are skipped"
        )
    stage("quantize with the passes", with_passes)
    traces = {
        name: stage(f"decode {name}", lambda program=program: stage.run(program, steps))
        for name, program in converted.items()
    }
    return traces, converted
