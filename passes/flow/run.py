"""The whole mutable-buffer flow on one model, as the main job (``python -m passes run``) runs it.

export -> MarkMutableBuffers -> InplaceToFunctional -> ``quantize_program`` (pt2e through
PassQuantizer with SkipAnnotateDataMovementOps, calibrate, reset_mutable_buffers, convert,
UnfreezeMutableBuffer, lifted back to an ExportedProgram: no re-trace) -> [QuantizeMutableBuffers]
-> to_delegate + ConsumeBufferMutationsInDelegate -> decode, next to the same model quantized
by torchao's flow without the passes, all compared with fp32 eager. Every call may take
keyword inputs; a failing stage raises :class:`~passes.flow.result.FlowError` with what was
found so far.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import OutputKind
from tqdm import tqdm

from pass_manager import PassManager, PipelineError, RunResult, ValidationInputError
from pass_manager.call_signature import signature_of
from pass_manager.validation import (
    Trace,
    as_call,
    call_inputs,
    copy_program,
    first_difference,
    output_errors,
    run_program,
)

from .._analysis.marked_state import mutable_buffers
from ..consume_buffer_mutations_in_delegate import ConsumeBufferMutationsInDelegate
from ..delegation.ownership import program_state
from ..errors import QuantizationInputError
from ..inplace_to_functional import InplaceToFunctional
from ..mark_mutable_buffers import MarkMutableBuffers
from ..quantization import checked_quantizer, quantize_program
from ..quantize_mutable_buffers import QuantizeMutableBuffers
from ..skip_annotate_data_movement_ops import SkipAnnotateDataMovementOps
from ..unfreeze_mutable_buffer import UnfreezeMutableBuffer
from .checks import non_finite_notes, quantization_checks, relative_buffer_errors
from .delegation import delegation_stages
from .examples import xnnpack_quantizer
from .factory import (
    Exported,
    ModelSpec,
    check_steps_within_state,
    export_program,
    first_misfit,
)
from .histogram_searches import histogram_searches_found_once
from .integer_state import INTEGER_STATE, integer_state_stage
from .noise import native_stderr_held
from .quantization import COLUMN_NOTES, NO_PASSES, RESET, WITH_PASSES, torchao_recipe
from .result import (
    Check,
    FlowError,
    FlowInterrupted,
    FlowResult,
    check_same,
    failure_of,
    restricted,
)

__all__ = ["Check", "FlowError", "FlowResult", "run_flow", "run_model"]

Log = Callable[[str], None]
RUNTIMES = ("python", "executorch")
# Export may reorder float arithmetic (a fused or decomposed op): the exported program is
# compared with eager within float rounding, the passes' programs with theirs exactly.
EXPORT_RTOL, EXPORT_ATOL = 1e-4, 1e-5


class _Stages:
    """Runs the stages in order and times each; a failure becomes FlowError.

    With ``bars`` each stage is one progress bar on stderr (tqdm: its calls and time);
    otherwise ``log`` gets a line when a stage starts and ends.
    """

    def __init__(self, log: Log, result: FlowResult, bars: bool = False):
        self.log = log
        self.result = result
        self.bars = bars
        self.bar: Any = None
        self.title = ""
        self.calls: tuple[int, int] | None = None  # (calls done, calls planned) in this stage

    def __call__(self, title: str, fn: Callable[[], Any]) -> Any:
        self.title, self.calls = title, None
        if self.bars:
            # A stage is one bar: its title, the time so far and, while it decodes, its calls.
            self.bar = tqdm(desc=title, file=sys.stderr, leave=True, dynamic_ncols=True,
                            bar_format="{desc} [{elapsed}]{postfix}")
        else:
            self.log(f"[{title}] ...")
        start = time.perf_counter()
        try:
            value = fn()
        except (FlowError, FlowInterrupted):
            raise
        except KeyboardInterrupt as e:
            raise FlowInterrupted(self._where(), self.result) from e
        except QuantizationInputError as e:  # found before any call: the stage alone
            self.result.failure = failure_of(self.title, e)
            raise FlowError(self.result.failure, self.result) from e
        except Exception as e:
            self.result.failure = failure_of(self._where(), e)
            raise FlowError(self.result.failure, self.result) from e
        finally:
            seconds = time.perf_counter() - start
            self.result.stage_times.append((title, seconds))
            if self.bar is not None:
                self.bar.close()
                self.bar = None
        if not self.bars:
            self.log(f"[{title}] done in {seconds:.2f} s")
        return value

    def _where(self) -> str:
        """The stage running, and the call when it stopped during one of its calls."""
        if self.calls is not None and self.calls[0] < self.calls[1]:
            return f"{self.title} (call {self.calls[0] + 1} of {self.calls[1]})"
        return self.title

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Between stages (the checks), a failure is a FlowError too, named after the stage."""
        try:
            yield
        except (FlowError, FlowInterrupted):
            raise
        except KeyboardInterrupt as e:
            raise FlowInterrupted(f"checks after {self.title or 'setup'}", self.result) from e
        except Exception as e:
            self.result.failure = failure_of(f"checks after {self.title or 'setup'}", e)
            raise FlowError(self.result.failure, self.result) from e

    def progress(self, calls: int) -> Callable[[int], None]:
        """A per-call callback: the stage's bar counts calls, or ``log`` gets ``step i/n``."""
        last = [time.perf_counter()]
        self.calls = (0, calls)
        if self.bar is not None:
            self.bar.set_postfix_str(f"call 0/{calls}")

        def step(index: int) -> None:
            self.calls = (index + 1, calls)
            now = time.perf_counter()
            if self.bar is not None:
                self.bar.set_postfix_str(f"call {index + 1}/{calls}")
            else:
                self.log(f"  [{self.title}] step {index + 1}/{calls} ({now - last[0]:.2f} s)")
            last[0] = now

        return step

    def run(self, program: Any, steps: list, **options: Any) -> Trace:
        return run_program(program, steps, on_call=self.progress(len(steps)), **options)


def _check_inputs_kept(pipeline: PassManager, exported: torch.export.ExportedProgram,
                       functional: RunResult, calls: Sequence[tuple[str, Any]]) -> None:
    """A pipeline in place of functionalization keeps the inputs the calls (each named)
    give; one that changes them (BuffersToInputs) would fail the first decode in torch's
    pytree instead. Both main jobs, one method and several, check it."""
    misfit = first_misfit(functional.program, calls)
    if misfit:
        where, why = misfit
        changed = ", ".join(r.name for r in functional.report.records if r.modified)
        raise PipelineError(
            f"the pipeline {pipeline.name} changed the program's inputs from "
            f"{signature_of(exported)} to {signature_of(functional.program)}: {where} no "
            f"longer fits ({why}); in place of functionalization a pipeline must keep them "
            f"(its passes that changed the program: {changed})")


def check_flow_options(helper: str, runtime: str, quantize: bool,
                       quantizer_factory: Any) -> None:
    """Refuse, before any stage, the options a late stage would trip over: a ``runtime``
    the flow does not know (it decoded in Python alone, silently), or a
    ``quantizer_factory`` that is no function making a quantizer (a Quantizer instance:
    'object is not callable' after export and the fp32 decodes).

    Raises:
        ValueError: ``runtime`` is neither ``"python"`` nor ``"executorch"``.
        QuantizationInputError: ``quantizer_factory`` is not callable.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"{helper}: runtime={runtime!r}: takes 'python' (decode in Python) "
                         "or 'executorch' (also on ExecuTorch's runtime)")
    if quantize and not callable(quantizer_factory):
        try:  # a Quantizer where its factory goes: say so; anything else: what it is
            checked_quantizer(quantizer_factory, helper)
            given = f"an instance of {type(quantizer_factory).__name__}"
        except QuantizationInputError:
            given = f"{type(quantizer_factory).__name__} {quantizer_factory!r:.80}"
        raise QuantizationInputError(
            helper, "quantizer_factory", f"is {given}, not a function returning a Quantizer "
            "(each quantized flow takes a fresh one): pass e.g. passes.flow.examples."
            "xnnpack_quantizer, uncalled, or lambda: quantizer")


def flow_calls(helper: str, argument: str, calls: Any) -> list | None:
    """``calls`` (the ``steps`` or ``calibration`` a flow is given) as one ``(args,
    kwargs)`` pair per call; None stays None (the flow's default).

    Raises:
        ValidationInputError: ``calls`` is no sequence of calls (a number, a tensor, one
            call's keyword mapping): it was iterated (rows of a tensor taken as calls) or
            raised a bare TypeError.
    """
    if calls is None:
        return None
    if isinstance(calls, (torch.Tensor, Mapping, str, bytes)) or not isinstance(
            calls, Iterable):
        kind = "a tensor" if isinstance(calls, torch.Tensor) else (
            f"{type(calls).__name__} {calls!r:.60}")
        raise ValidationInputError(
            f"{helper}({argument}=...)", None, f"is {kind}, not a list of calls: give one "
            "entry per call, each an argument tuple, an (args, kwargs) pair or a keyword "
            "mapping, e.g. [(x0,), (x1,)]" + (" (None: the steps)"
                                                if argument == "calibration" else ""))
    return call_inputs(list(calls))


def run_flow(
    model: torch.nn.Module,
    example_inputs: Any = (),
    steps: Sequence[Any] = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    export: str | None = None,
    exported: Exported | None = None,
    quantize: bool = True,
    delegate: bool = True,
    quantizer_factory: Callable[[], Any] = xnnpack_quantizer,
    calibration: Sequence[Any] | None = None,
    log: Log = print,
    progress_bars: bool = False,
    pipeline: PassManager | None = None,
    pass_options: Mapping[str, Any] | None = None,
    runtime: str = "python",
    quantize_state: bool = False,
) -> FlowResult:
    """Run the flow; ``steps`` holds one call's inputs per decode call.

    A call's inputs are an argument tuple, an ``(args, kwargs)`` pair or a keyword mapping.
    The model is exported with ``example_inputs`` (and ``example_kwargs``,
    ``dynamic_shapes``) as :func:`passes.flow.factory.export_program` does, in ``export`` mode
    ("strict" / "non-strict"; default: strict, else non-strict), unless ``exported`` is
    given. ``calibration`` (default: ``steps``) is what the quantized programs are
    calibrated on. torchao's flow without the passes is the one users get today: the
    functional form from ``run_decompositions({})``, quantized by the same quantizer.
    ``pipeline`` replaces the functionalization stage (MarkMutableBuffers,
    InplaceToFunctional), e.g. ``parse_pipeline(text)`` from ``--pipeline``.
    ``pass_options`` are PassManager options for the pipelines the flow builds itself
    (the main job's ``--print-after``, ``--reproducer-dir`` ...).
    ``progress_bars`` shows each stage as a progress bar on stderr instead of ``log`` lines.
    ``runtime="executorch"`` also decodes the fp32 and quantized programs on ExecuTorch's
    runtime (:func:`passes.flow.executorch_stage.flow_stage`; needs the executorch extra).
    ``quantize_state=True`` stores the quantized state as integers (QuantizeMutableBuffers
    after quantization, :mod:`passes.flow.integer_state`), checks the result exactly against
    the fp32-stored quantized program, and delegates and lowers that program.
    ``steps`` None or empty: the example once.
    Raises :class:`FlowError` (with the partial result) when a stage fails; before any
    stage, ``ValueError`` for ``quantize_state`` without ``quantize`` or an unknown
    ``runtime``, ``ValidationInputError`` for ``steps`` or ``calibration`` that are no list
    of calls (or an empty ``calibration``), ``QuantizationInputError`` for a
    ``quantizer_factory`` that is not callable (a Quantizer instance).
    """
    if quantize_state and not quantize:
        raise ValueError("quantize_state=True stores quantized state: it needs quantize=True")
    check_flow_options("run_flow", runtime, quantize, quantizer_factory)
    args, kwargs = as_call(example_inputs)
    kwargs = {**kwargs, **(example_kwargs or {})}
    steps = flow_calls("run_flow", "steps", steps) or [(args, kwargs)]
    calibration = flow_calls("run_flow", "calibration", calibration)
    if calibration is None:
        calibration = steps
    elif quantize and not calibration:
        raise ValidationInputError("run_flow(calibration=...)", None, "gives no call: the "
                                   "observers would measure nothing; None calibrates on the "
                                   "steps")
    result = FlowResult()
    stage = _Stages(log, result, bars=progress_bars)
    with stage.guarded(), histogram_searches_found_once():
        options = dict(pass_options or {})
        functionalize = pipeline or PassManager(
            [MarkMutableBuffers(), InplaceToFunctional()], **options
        )
        # The stages run as separate pipelines around torchao's calls; their union is the DAG
        # that fixes the order, which is what the plan shows.
        every_pass = PassManager(
            [
                MarkMutableBuffers(),
                InplaceToFunctional(),
                SkipAnnotateDataMovementOps(),
                UnfreezeMutableBuffer(),
                *([QuantizeMutableBuffers()] if quantize_state else []),
                ConsumeBufferMutationsInDelegate(),
            ]
        )
        result.plan = every_pass.explain()
        result.dot = every_pass.to_dot()

        def within_state(program: torch.export.ExportedProgram) -> None:
            # More steps than a static cache holds: one line naming the step and the cache,
            # not an IndexError at that step (eager's), or an untyped error 0x12 (the
            # runtime's); and eager may take steps its program cannot (a window it rolls).
            stage("check the steps stay within the state", lambda: check_steps_within_state(
                {"forward": program}, [("forward", *call) for call in steps], "run_flow"))

        # Exported (a copy of the model) before eager decodes: a step past the end of a
        # static cache is the check's one line, not eager's IndexError at that step.
        if exported is None:
            exported = stage("export", lambda: export_program(
                model, args, kwargs, dynamic_shapes=dynamic_shapes, mode=export))
        within_state(exported.program)
        eager = stage("fp32 eager decode", lambda: stage.run(model, steps))
        result.notes += _no_outputs(eager)
        if exported.note:
            result.notes.append(exported.note)
        if runtime == "executorch":
            # A step ExecuTorch's runtime cannot take fails now, not after the quantization
            # and the lowerings it would wait for (tens of seconds each).
            from .executorch_stage import check_runtime_steps

            stage("check the steps fit ExecuTorch's runtime",
                  lambda: check_runtime_steps([("exported", exported.program)], steps))
        mode = exported.mode
        exported_trace = stage(
            "decode the exported program", lambda: stage.run(exported.program, steps)
        )
        _check_export(result, mode, eager, exported_trace)
        functional = stage(
            "functionalize", lambda: functionalize.run(copy_program(exported.program))
        )
        result.reports.append(("functionalize", functional.report))
        if pipeline is not None:
            stage("check the steps fit the pipeline's program",
                  lambda: _check_inputs_kept(pipeline, exported.program, functional, [
                      (f"steps[{index}]", step) for index, step in enumerate(steps)]))
        result.notes += _state_notes(functional.program)
        program: Any = functional.program
        # Later stages run the functional program's module, which shares its buffers.
        fp32_program = copy_program(program) if runtime == "executorch" else None
        lowered_before = {}
        if runtime == "executorch":
            # Lowered now, not after quantization: a program the runtime cannot load (an
            # operator it lacks) or whose state it would not keep (a written parameter) is
            # refused before the slow stages, naming the node.
            from .executorch_stage import lower_checked

            with native_stderr_held():
                lowered_before["fp32"] = stage("lower the fp32 program to a .pte",
                                               lambda: lower_checked(fp32_program, tuple(args)))
        functional_trace = stage("decode the functional program", lambda: stage.run(program, steps))
        check_same(
            result,
            "functional program matches the exported program",
            exported_trace,
            functional_trace,
        )

        state = program_state  # how the decodes read state (dequantized when stored as ints)
        if quantize:
            traces, converted = quantize_both_ways(
                stage, exported.program, functional.program, quantizer_factory, calibration, steps,
                options,
            )
            result.column_notes.update(COLUMN_NOTES)
            for name, trace in traces.items():
                result.step_errors[name] = output_errors(eager, trace)
                result.buffer_errors[name] = relative_buffer_errors(eager, trace)
            if RESET in traces:
                quantization_checks(result, eager, traces, converted)
            result.notes += _not_finite(result.step_errors)
            result.notes += non_finite_notes(result.quantization.non_finite_reads)
            result.bought += _bought(result, returns_tensors=not _no_outputs(eager))
            # quantize_program's ExportedProgram goes on as it is: no re-export, no second
            # functionalization (its cache updates are already its mutation outputs).
            program = quantized = converted[WITH_PASSES]
            reference = traces[WITH_PASSES]
            if quantize_state:
                program, reference, state = integer_state_stage(
                    stage, result, quantized, reference, steps, options
                )
        else:
            reference = functional_trace

        if delegate:
            final = delegation_stages(
                stage, result, program, steps, (eager, reference), options, state
            )
            name = "full pipeline" if quantize else "fp32 pipeline"
            result.column_notes[name] = ("the program with the passes, delegated (to_delegate + "
                                         "ConsumeBufferMutationsInDelegate)")
            result.step_errors[name] = output_errors(eager, final)
            result.buffer_errors[name] = relative_buffer_errors(eager, final)
        elif not quantize:
            result.step_errors["fp32 pipeline"] = output_errors(eager, functional_trace)
        if runtime == "executorch":
            from .executorch_stage import flow_stage

            programs = [("fp32", fp32_program)]
            if quantize:
                programs.append(("quantized", quantized))
            if quantize_state:
                programs.append((INTEGER_STATE, program))
            for name, _ in programs:
                result.column_notes[f"{name} on executorch"] = (
                    f"the {name} program lowered (XNNPACK + BufferOwningPartitioner) and run "
                    "on ExecuTorch's runtime")
            with native_stderr_held():
                flow_stage(result, stage, programs, tuple(args), steps, eager, lowered_before)
        return result


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

    Without the passes it is torchao's recipe (:func:`~passes.flow.quantization.torchao_recipe`),
    the reference for today's way: graph modules (which its users re-export to lower them),
    as calibration left the buffers and reset by hand. With them it is
    :func:`~passes.quantization.quantize_program`: an ExportedProgram, lifted, not
    re-traced; its report goes to ``stage.result`` (pass reports and ``quantization``).
    ``stage`` is the flow's stage runner (titles, timing, per-step progress). Returns the
    decode traces and the quantized programs by flow name; when torchao's flow fails on
    its own (quantizing or decoding), the traces of the flows that ran (and a note and a
    line of what the passes bought saying why). ``pass_options`` are
    PassManager options for the passes' pipelines.
    """
    converted: dict[str, Any] = {}

    def without_passes() -> None:
        recipe = torchao_recipe(exported, quantizer_factory(), [calibration],
                                on_call=stage.progress(len(calibration)))
        converted[NO_PASSES], converted[RESET] = recipe.left, recipe.reset

    def with_passes() -> None:
        # prepare, calibrate, reset, convert, UnfreezeMutableBuffer, and the lift back into
        # an ExportedProgram, where torchao's recipe re-exports.
        quantized, report = quantize_program(
            copy_program(functional), quantizer_factory(), calibration, return_report=True,
            on_call=stage.progress(len(calibration)), **(pass_options or {}),
        )
        stage.result.reports += report.passes
        stage.result.quantization = report
        converted[WITH_PASSES] = quantized

    def reference(title: str, fn: Callable[[], Any]) -> Any:
        # torchao's own flow failing on this model (quantizing, or decoding from the state
        # calibration left: past a static cache's end) is no failure of the passes: the flow
        # goes on with the passes, and the comparisons that need that column are skipped.
        try:
            return stage(title, fn)
        except FlowError as e:
            stage.result.failure = None
            stage.result.notes.append(
                f"torchao's flow without the passes failed ({'; '.join(e.failure.lines())}); "
                "the checks comparing with it are skipped")
            stage.result.bought.append(f"torchao's recipe without the passes fails "
                                       f"({e.failure.stage}: {e.failure.reason})")
            return None

    reference("quantize without the passes", without_passes)
    stage("quantize with the passes", with_passes)
    traces = {}
    for name, program in converted.items():
        decode = reference if name != WITH_PASSES else stage
        trace = decode(f"decode {name}", lambda program=program: stage.run(program, steps))
        if trace is not None:
            traces[name] = trace
    return traces, converted


def run_model(model: ModelSpec, **options: Any) -> FlowResult:
    """:func:`run_flow` on what a factory returned (:func:`~passes.flow.factory.model_spec`)."""
    if not isinstance(model, ModelSpec):  # the factory's result itself, or several methods
        raise TypeError(f"run_model takes model_spec(factory(), name, steps) of one method, got "
                        f"{type(model).__name__} (several methods: run_methods_flow)")
    return run_flow(
        model.module,
        model.example_args,
        model.steps,
        example_kwargs=model.example_kwargs,
        dynamic_shapes=model.dynamic_shapes,
        export=model.export,
        **options,
    )


def _state_notes(functional: Any) -> list[str]:
    """What the report's state figures cannot show: a model that writes no buffer (its
    state errors would read 0%), or writes a parameter (kept, but compared nowhere)."""
    if not isinstance(functional, torch.export.ExportedProgram):
        return []
    written = {kind: [spec.target for spec in functional.graph_signature.output_specs
                      if spec.kind == kind]
               for kind in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)}
    notes = []
    # A pipeline given as text may leave the writes in place (no mutation outputs): marked.
    if not any(written.values()) and not mutable_buffers(functional):
        notes.append("the model writes no buffer: it keeps no state between calls, so the "
                     "passes have nothing to keep and the comparisons measure quantization "
                     "alone")
    if written[OutputKind.PARAMETER_MUTATION]:
        names = ", ".join(map(repr, written[OutputKind.PARAMETER_MUTATION]))
        notes.append(f"the model writes the parameter(s) {names} in place: the flow keeps them "
                     "as state, but the state comparisons read buffers only, and ExecuTorch's "
                     "runtime refuses a written parameter (register them as buffers)")
    return notes


def _no_outputs(eager: Trace) -> list[str]:
    """A model returning no tensor: every output column would read 0, comparing nothing."""
    if any(isinstance(leaf, torch.Tensor) for outputs in eager.outputs
           for leaf in pytree.tree_leaves(outputs)):
        return []
    return ["the model returns no tensor (None, or only Python values): the decode table's "
            "output errors compare nothing and read 0; its state, compared below it, is "
            "what measures the programs"]


def _not_finite(step_errors: Mapping[str, list[float]]) -> list[str]:
    """The quantized decodes no number measures: the checks compare them with each other,
    and pass when all of them are off by inf."""
    broken = [name for name, errors in step_errors.items() if math.inf in errors]
    return [f"off by inf from fp32 eager (an output NaN or inf, or of another shape) at "
            f"some step: {', '.join(map(repr, broken))}"] if broken else []


def _bought(result: FlowResult, returns_tensors: bool = True) -> list[str]:
    """What the passes changed on this model's quantized decode, against torchao's recipe
    (its outputs only if it returns a tensor: else both would read 'off by 0')."""
    if NO_PASSES not in result.step_errors or WITH_PASSES not in result.step_errors:
        return []
    without, with_ = result.step_errors[NO_PASSES], result.step_errors[WITH_PASSES]
    bought = [
        f"first decode step off by {without[0]:.3g} without the passes, {with_[0]:.3g} with",
        f"worst decode step off by {max(without):.3g} without, {max(with_):.3g} with",
    ] if returns_tensors else []
    if result.buffer_errors[NO_PASSES] or result.buffer_errors[WITH_PASSES]:  # not 0% of none
        state_without = max(result.buffer_errors[NO_PASSES].values(), default=0.0)
        state_with = max(result.buffer_errors[WITH_PASSES].values(), default=0.0)
        bought.append(f"worst state error {state_without:.1%} of its fp32 magnitude without, "
                      f"{state_with:.1%} with")
    return bought


def _check_export(result: FlowResult, mode: str, eager: Trace, exported: Trace) -> None:
    """The exported program against eager, on the buffers it kept.

    Export drops buffers the forward never reads (Hugging Face's ``original_inv_freq``):
    they are named in the detail, not counted as a difference.
    """
    kept = set(exported.buffers[0]) if exported.buffers else set()
    dropped = sorted(set(eager.buffers[0]) - kept) if eager.buffers else []
    kept_only = restricted(eager, kept)
    difference = first_difference(kept_only, exported, EXPORT_ATOL, EXPORT_RTOL)
    worst = max(output_errors(kept_only, exported), default=0.0)
    detail = difference or (
        "outputs and buffers equal" if worst == 0 else f"max abs output difference {worst:.3g}"
    )
    if dropped:
        detail += f"; export dropped unused buffers: {', '.join(dropped)}"
    result.checks.append(
        Check(
            f"exported program ({mode}) matches fp32 eager within float rounding",
            difference is None,
            detail,
        )
    )
