"""torchao's pt2e flow on programs with mutable buffers, with or without the passes.

The flow is ``prepare_pt2e`` -> calibrate -> reset the buffers -> ``convert_pt2e``. With the
passes, :class:`~passes.quantization.PassQuantizer` runs MarkMutableBuffers (and
InplaceToFunctional when asked) before annotation and SkipAnnotateDataMovementOps after it,
the buffers are reset with ``reset_mutable_buffers`` and the converted program goes through
UnfreezeMutableBuffer. Without them it is torchao's flow as users run it today; the
buffers, when reset, are put back by hand.

:func:`prepare` returns a :class:`Prepared` whose steps (:meth:`~Prepared.calibrate`,
:meth:`~Prepared.reset`, :meth:`~Prepared.convert`) the callers run in their order: the
main job (:func:`quantize_both_ways`), the decode-accuracy benchmark and the tests
(:func:`prepare_and_calibrate`, :func:`quantize`).

The main job quantizes both ways (:func:`quantize_both_ways`). With the passes it runs
:func:`passes.quantization.quantize_program`, whose ExportedProgram goes on to delegation
with no re-export. torchao's flow without the passes, the reference for today's way, takes
the functional form from ``run_decompositions({})``; its calibration leaves its state in the
buffers, so it is also converted once with the buffers put back by hand, which is the
like-for-like comparison for the flow with the passes (there ``reset_mutable_buffers`` does
the same).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.fx import GraphModule

from pass_manager import PassManager, Report
from pass_manager.validation import Trace, as_call, copy_program

from ..inplace_to_functional import InplaceToFunctional
from ..mark_mutable_buffers import MarkMutableBuffers
from ..quantization import PassQuantizer, quantize_program
from ..skip_annotate_data_movement_ops import SkipAnnotateDataMovementOps
from ..unfreeze_mutable_buffer import UnfreezeMutableBuffer
from .result import FlowError

__all__ = [
    "COLUMN_NOTES",
    "Converted",
    "Prepared",
    "prepare",
    "prepare_and_calibrate",
    "quantize",
    "quantize_both_ways",
]

NO_PASSES, RESET, WITH_PASSES = (
    "quantized, no passes",
    "quantized, no passes, caches reset by hand",
    "quantized, with passes",
)


# What each of those programs is, for the main job's decode table.
COLUMN_NOTES = {
    NO_PASSES: "torchao's recipe as users run it (run_decompositions, prepare, calibrate, "
               "convert): the state calibration left behind is where decoding starts",
    RESET: "the same, with the buffers put back by hand after calibration",
    WITH_PASSES: "quantize_program: the passes, reset_mutable_buffers after calibration, "
                 "UnfreezeMutableBuffer after convert",
}


class Converted(NamedTuple):
    """What :meth:`Prepared.convert` returns: the program and, with the passes, the run
    report of UnfreezeMutableBuffer's pipeline."""

    program: GraphModule
    report: Report | None


class Prepared:
    """A module prepared by ``prepare_pt2e`` (:func:`prepare`), and the flow's later steps.

    ``module`` is the prepared module; ``passes`` whether the flow runs the passes;
    ``reports`` the run reports of PassQuantizer's pipelines (before annotation, after
    annotation; empty without the passes).
    """

    def __init__(
        self,
        module: GraphModule,
        quantizer: Any,
        *,
        passes: bool,
        functional: bool = False,
        pass_options: Mapping[str, Any] | None = None,
    ):
        from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

        self.passes = passes
        self._pass_options = dict(pass_options or {})
        # Without the passes, the buffers are put back by hand from their values now.
        self._initial = (
            None if passes else {name: b.detach().clone() for name, b in module.named_buffers()}
        )
        if passes:
            transform = [MarkMutableBuffers()] + ([InplaceToFunctional()] if functional else [])
            quantizer = PassQuantizer(
                quantizer,
                transform=transform,
                after_annotate=[SkipAnnotateDataMovementOps()],
                **self._pass_options,
            )
        self.reports: list[Report] = quantizer.reports if passes else []
        self.module = prepare_pt2e(module, quantizer)

    def calibrate(
        self, sequences: Sequence[Sequence[Any]], on_call: Callable[[int], None] | None = None
    ) -> None:
        """Run each sequence of calls (copies of their inputs) under ``torch.no_grad()``.

        A call's inputs are an argument tuple, an ``(args, kwargs)`` pair or a keyword
        mapping. Every sequence after the first starts from the buffers' initial values
        (:meth:`reset`); ``on_call(index)`` runs after each call, counted over all of them.
        """
        index = 0
        with torch.no_grad():
            for number, sequence in enumerate(sequences):
                if number:
                    self.reset()
                for args, kwargs in copy_program([as_call(call) for call in sequence]):
                    self.module(*args, **kwargs)
                    if on_call is not None:
                        on_call(index)
                    index += 1

    def reset(self) -> None:
        """Put the buffers back to their initial values: ``reset_mutable_buffers`` with the
        passes, by hand (the values taken before ``prepare_pt2e``) without them."""
        if self.passes:
            # Looked up on the package at call time: a test replaces it there to show what
            # the main job's checks see when the reset is missing.
            from .. import reset_mutable_buffers

            reset_mutable_buffers(self.module)
            return
        with torch.no_grad():
            for name, value in self._initial.items():
                self.module.get_buffer(name).copy_(value)

    def convert(self, *, fold_quantize: bool = True, copy: bool = True) -> Converted:
        """``convert_pt2e`` (of a copy, unless ``copy`` is False); with the passes, then
        UnfreezeMutableBuffer (a PassManager with the flow's ``pass_options``)."""
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

        module = copy_program(self.module) if copy else self.module
        converted = convert_pt2e(module, fold_quantize=fold_quantize)
        if not self.passes:
            return Converted(converted, None)
        unfrozen = PassManager([UnfreezeMutableBuffer()], **self._pass_options).run(converted)
        return Converted(unfrozen.program, unfrozen.report)


def prepare(
    program: torch.export.ExportedProgram,
    quantizer: Any,
    *,
    passes: bool,
    functional: bool = False,
    pass_options: Mapping[str, Any] | None = None,
) -> Prepared:
    """``prepare_pt2e`` a copy of ``program``'s module with ``quantizer``, with or without
    the passes.

    ``functional`` asks for the functional form: with the passes, InplaceToFunctional runs
    after MarkMutableBuffers (before annotation); without them, the copy is
    ``run_decompositions({})``-ed first. ``pass_options`` are PassManager options for the
    passes' pipelines (e.g. ``print_after``, ``reproducer_dir``).
    """
    program = copy_program(program)
    if functional and not passes:
        program = program.run_decompositions({})
    return Prepared(
        program.module(), quantizer, passes=passes, functional=functional,
        pass_options=pass_options,
    )


def prepare_and_calibrate(
    model: torch.nn.Module,
    example_inputs: tuple,
    quantizer: Any,
    calibration: Sequence[Sequence[Any]],
    *,
    passes: bool,
    functional: bool = False,
    reset: bool = True,
) -> Prepared:
    """Export a deep copy of ``model``, :func:`prepare` it and run the calibration.

    ``calibration`` is a list of sequences (each a list of calls' inputs); the buffers start
    every sequence from their initial values, and are reset once more after the last one
    unless ``reset`` is False.
    """
    exported = torch.export.export(copy_program(model), example_inputs)
    prepared = prepare(exported, quantizer, passes=passes, functional=functional)
    prepared.calibrate(calibration)
    if reset:
        prepared.reset()
    return prepared


def quantize(
    model: torch.nn.Module,
    example_inputs: tuple,
    quantizer: Any,
    calibration: Sequence[Sequence[Any]],
    *,
    passes: bool,
    functional: bool = False,
    fold_quantize: bool = True,
    reset: bool = True,
) -> GraphModule:
    """:func:`prepare_and_calibrate`, then convert: the quantized program."""
    prepared = prepare_and_calibrate(
        model, example_inputs, quantizer, calibration,
        passes=passes, functional=functional, reset=reset,
    )
    return prepared.convert(fold_quantize=fold_quantize).program


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

    Without the passes it is torchao's recipe, the reference for today's way: the
    converted graph module (which its users re-export to lower it). With them it is
    :func:`~passes.quantization.quantize_program`: an ExportedProgram, lifted, not
    re-traced; its report goes to ``stage.result`` (pass reports and ``quantization``).
    ``stage`` is the flow's stage runner (titles, timing, per-step progress). Returns the
    decode traces and the quantized programs by flow name; when torchao's flow fails on
    its own, only the flow with the passes (and a note saying why). ``pass_options`` are
    PassManager options for the passes' pipelines.
    """
    converted: dict[str, Any] = {}

    def calibrate(prepared: Prepared) -> None:
        prepared.calibrate([calibration], on_call=stage.progress(len(calibration)))

    def without_passes() -> None:
        prepared = prepare(exported, quantizer_factory(), passes=False, functional=True)
        calibrate(prepared)
        converted[NO_PASSES] = prepared.convert().program
        prepared.reset()
        converted[RESET] = prepared.convert(copy=False).program

    def with_passes() -> None:
        # quantize_program: prepare, calibrate, reset, convert, UnfreezeMutableBuffer, and
        # the lift back into an ExportedProgram, where torchao's recipe re-exports.
        quantized, report = quantize_program(
            copy_program(functional), quantizer_factory(), calibration, return_report=True,
            on_call=stage.progress(len(calibration)), **(pass_options or {}),
        )
        stage.result.reports += report.passes
        stage.result.quantization = report
        converted[WITH_PASSES] = quantized

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
