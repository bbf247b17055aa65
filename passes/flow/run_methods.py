"""The main job on a model deployed as several methods over one state (factory contract v3).

A prefill and a decode of one decoder share its KV cache on a device. The flow exports each
method from the one module, runs the functionalization pipeline on the mapping (which
checks that the methods hold their shared buffers alike), and calls the methods in
deployment order on one state, compared call by call with fp32 eager (the same module
called in the same order). Quantized, it compares today's way — each method quantized on
its own, calibrated on its own calls and state, so the same cache gets one grid per
method — with :func:`passes.quantization.quantize_methods` (one calibration sequence over
one state, one grid per shared buffer); ``quantize_state`` stores the shared caches as
integers and checks them bit for bit against the fp32-stored methods; ``runtime=
"executorch"`` runs the methods from one ``.pte`` with shared mutable buffers, the fp32
methods right after their Python checks: a method the runtime cannot load (an operator it
lacks, named with its node and line) or whose state it would not keep (a written parameter)
stops the flow before the quantization stages, as the one-method flow's early lowering does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pass_manager import PassManager
from pass_manager.validation import (
    Trace,
    copy_program,
    first_difference,
    output_errors,
)

from .._analysis.buffers import find_mutations
from .._analysis.marked_state import mutable_buffers
from .._methods.calls import share_buffer_tensors
from .._methods.in_turn import run_methods
from .._methods.shared_buffers import shared_buffer_differences
from ..inplace_to_functional import InplaceToFunctional
from ..inputs_to_buffers import InputsToBuffers
from ..mark_mutable_buffers import MarkMutableBuffers
from ..quantization import quantize_methods, quantize_program
from ..quantize_mutable_buffers import QuantizeMutableBuffers
from .checks import non_finite_notes
from .examples import xnnpack_quantizer
from .factory import Exported, MethodsSpec, check_steps_within_state, export_methods
from .histogram_searches import histogram_searches_found_once
from .integer_state import dequantized_state, storage_of
from .noise import native_stderr_held
from .quantized_graphs import output_grid
from .result import Check, FlowResult, restricted
from .run import (
    EXPORT_ATOL,
    EXPORT_RTOL,
    _check_inputs_kept,
    _no_outputs,
    _not_finite,
    _Stages,
    check_flow_options,
)

__all__ = ["FP32_METHODS", "INTEGER_METHODS", "ONE_GRID", "PER_METHOD", "run_methods_flow"]

Log = Callable[[str], None]
FP32_METHODS = "fp32 methods"
PER_METHOD = "quantized per method"
ONE_GRID = "quantize_methods"
INTEGER_METHODS = "quantize_methods, integer state"


def run_methods_flow(
    spec: MethodsSpec,
    *,
    quantize: bool = True,
    quantize_state: bool = False,
    quantizer_factory: Callable[[], Any] = xnnpack_quantizer,
    export: str | None = None,
    exported: Mapping[str, Exported] | None = None,
    log: Log = print,
    progress_bars: bool = False,
    pipeline: PassManager | None = None,
    pass_options: Mapping[str, Any] | None = None,
    runtime: str = "python",
) -> FlowResult:
    """Run the several-method flow on ``spec`` (see the module docstring).

    ``pipeline`` replaces the functionalization stage; ``pass_options`` are PassManager
    options for the pipelines the flow builds itself; ``export`` forces an export mode;
    ``exported`` gives the methods already exported (:func:`~passes.flow.factory.export_methods`).
    Raises :class:`~passes.flow.result.FlowError` (with the partial result) when a stage
    fails; before any stage, ``ValueError`` for an unknown ``runtime`` and
    ``QuantizationInputError`` for a ``quantizer_factory`` that is not callable, and
    ``TypeError`` for a ``spec`` that is no :class:`MethodsSpec`.
    """
    if not isinstance(spec, MethodsSpec):  # a one-method spec, or the factory's mapping
        raise TypeError(f"run_methods_flow takes methods_spec(factory(), name, steps), got "
                        f"{type(spec).__name__} (one method: run_model)")
    check_flow_options("run_methods_flow", runtime, quantize, quantizer_factory)
    result = FlowResult()
    stage = _Stages(log, result, bars=progress_bars)
    calls = list(spec.steps)
    with stage.guarded(), histogram_searches_found_once():
        options = dict(pass_options or {})
        functionalize = pipeline or PassManager([MarkMutableBuffers(), InplaceToFunctional()],
                                                **options)
        result.plan = functionalize.explain()
        result.dot = functionalize.to_dot()
        def within_state(programs: Mapping[str, Any]) -> None:
            # More calls than a static cache holds: the call and the cache, in one line.
            stage("check the steps stay within the state",
                  lambda: check_steps_within_state(programs, calls, "run_methods_flow"))

        # Exported (copies of the module) and checked before eager calls: a call past the
        # end of a static cache is the check's one line, not eager's IndexError at it.
        if exported is None:
            exported = stage("export each method", lambda: export_methods(spec, export))
        if not spec.carried:
            within_state({m: e.program for m, e in exported.items()})
        result.notes += [f"{m}: {e.note}" for m, e in exported.items() if e.note]
        functional = stage("functionalize the methods",
                           lambda: functionalize.run({m: e.program for m, e in exported.items()}))
        for method, run in functional.items():
            result.reports.append((f"functionalize {method}", run.report))
        if pipeline is not None:
            stage("check the steps fit the pipeline's programs",
                  lambda: _check_pipeline_kept_inputs(pipeline, exported, functional, spec))
        fp32 = {method: run.program for method, run in functional.items()}
        if spec.carried:
            fp32 = stage("make carried state resident (InputsToBuffers)",
                         lambda: _resident(result, fp32, spec.carried, options))
            within_state(fp32)  # as the methods take the calls, their state resident
        eager = stage("fp32 eager calls",
                      lambda: stage.run(spec.module, [(a, k) for _, a, k in calls]))
        result.notes += _no_outputs(eager)
        shared = share_buffer_tensors(fp32)
        result.notes.append(
            "buffers shared by " + " and ".join(map(repr, fp32)) + ": "
            + (", ".join(shared) if shared else "none (each method keeps its own state)"))
        fp32_trace = stage("fp32 methods in turn", lambda: _in_turn(stage, fp32, calls))
        _check_against_eager(result, eager, fp32_trace, len(calls))
        result.step_errors[FP32_METHODS] = output_errors(eager, fp32_trace)
        # Each program the runtime stage lowers, with what it computed in Python.
        lowered: list[tuple[str, dict[str, Any], Trace]] = [("fp32", fp32, eager)]
        ran_before = {}
        if runtime == "executorch":
            # Run now, not after quantization: a method the runtime cannot load (an operator
            # it lacks) or whose state it would not keep (a written parameter) is refused
            # before the slow stages, naming the node; reported with the quantized run.
            with native_stderr_held():
                ran_before["fp32"] = _on_runtime(stage, "fp32", fp32, calls)
        if quantize:
            quantized, reference = _quantized_stages(stage, result, fp32, spec, calls, eager,
                                                     quantizer_factory, options)
            if quantize_state:
                quantized, reference = _integer_stage(stage, result, quantized, calls, eager,
                                                      reference, options)
            lowered.append(("quantized", quantized, reference))
        if runtime == "executorch":
            with native_stderr_held():  # ExecuTorch's native CPU probe, among others
                _runtime_stage(stage, result, lowered, calls, eager, ran_before)
        result.notes += _not_finite(result.step_errors)
    return result


def _check_pipeline_kept_inputs(pipeline: PassManager, exported: Mapping[str, Exported],
                                functional: Mapping[str, Any], spec: MethodsSpec) -> None:
    """Each method's calls against what the pipeline made of it, as the one-method job
    checks them (a carried method's calls fit it once resident, after the pipeline)."""
    for method, run in functional.items():
        if method not in spec.carried:
            _check_inputs_kept(pipeline, exported[method].program, run, [
                (f"steps[{index}] ({method})", (args, kwargs))
                for index, (name, args, kwargs) in enumerate(spec.steps) if name == method])


def _resident(result: FlowResult, programs: dict[str, Any],
              carried: Mapping[str, Mapping[str, Any]], options: dict[str, Any]) -> dict:
    """Each method with carried-state options made resident by InputsToBuffers."""
    resident = dict(programs)
    for method, method_options in carried.items():
        run = PassManager([InputsToBuffers(**method_options)], **options).run(programs[method])
        result.reports.append((f"make {method}'s carried state resident", run.report))
        resident[method] = run.program
    return resident


def _in_turn(stage: _Stages, programs: Mapping[str, Any], calls: list, **options: Any) -> Trace:
    return run_methods(programs, calls, on_call=stage.progress(len(calls)), **options)


def _check_against_eager(result: FlowResult, eager: Trace, trace: Trace, count: int) -> None:
    # Export drops buffers the forward never reads: only the methods' buffers are compared.
    expected = restricted(eager, set(trace.buffers[0]) if trace.buffers else set())
    difference = first_difference(expected, trace, EXPORT_ATOL, EXPORT_RTOL)
    worst = max(output_errors(eager, trace), default=0.0)
    result.checks.append(Check(
        "fp32 methods called in turn on one state match fp32 eager within float rounding",
        difference is None,
        difference or f"{count} calls, worst output difference {worst:.3g}, every shared "
        "buffer equal after each call"))


def _grids(programs: Mapping[str, Any]) -> list[str]:
    """The shared buffers whose grids differ between methods, in words."""
    return [str(d) for d in shared_buffer_differences(programs)
            if d.aspect not in ("shape", "dtype", "initial value")]


def _shared_buffers(count: int) -> str:
    return f"{count} shared buffer{'' if count == 1 else 's'}"


def _one_grid(count: int) -> str:
    return "on one grid" if count == 1 else "on one grid each"


def _one_grid_each(shared: int, split: int) -> str:
    """quantize_methods' grids in words, against quantizing each method on its own, which
    put ``split`` of the ``shared`` buffers on a grid per method."""
    if shared == 1:
        alone = "it is on different grids" if split else "it is on one grid too"
    else:
        alone = f"{split} of them {'is' if split == 1 else 'are'} on different grids"
    return f"{_shared_buffers(shared)} {_one_grid(shared)}; quantized per method, {alone}"


def _quantized_stages(stage: _Stages, result: FlowResult, fp32: dict[str, Any],
                      spec: MethodsSpec, calls: list, eager: Trace,
                      quantizer_factory: Callable[[], Any], options: dict[str, Any],
                      ) -> tuple[dict[str, Any], Trace]:
    """Today's way (each method on its own) and quantize_methods, both called in turn."""
    own_calls = spec.calls_by_method
    non_finite: list[str] = []

    def per_method() -> dict[str, Any]:
        separate = {}
        for method, program in fp32.items():
            separate[method], report = quantize_program(
                copy_program(program), quantizer_factory(), own_calls[method],
                return_report=True)
            # The note the one-method flow gives, not quantize_program's warning: each
            # method's calibration reads the values (a -inf mask) both flows quantize.
            if report.non_finite_reads:
                non_finite.append(f"method {method!r}, calibrated on its own calls: "
                                  + ", ".join(report.non_finite_reads))
        return separate

    separate = stage("quantize each method on its own (today's way)", per_method)
    result.notes += non_finite_notes(non_finite)
    share_buffer_tensors(separate)
    separate_trace = stage("per-method quantized methods in turn",
                           lambda: _in_turn(stage, separate, calls))
    together = stage("quantize the methods together (quantize_methods)",
                     lambda: quantize_methods(copy_program(fp32), quantizer_factory(), calls))
    for method, reports in together.reports.items():
        result.reports += [(f"quantize {method}: {name}", report)
                           for name, report in reports.items()]
    together_trace = stage("quantize_methods methods in turn",
                           lambda: _in_turn(stage, together, calls))
    result.step_errors[PER_METHOD] = output_errors(eager, separate_trace)
    result.step_errors[ONE_GRID] = output_errors(eager, together_trace)
    result.column_notes[PER_METHOD] = ("quantize_program on each method with its own calls "
                                       "(today's way): one grid per method for a shared cache")
    result.column_notes[ONE_GRID] = ("quantize_methods: calibrated along the calls over one "
                                     "state, one grid per shared buffer")

    split, merged = _grids(separate), _grids(together)
    result.checks.append(Check(
        "quantize_methods gives every shared buffer one grid in every method",
        not merged,
        merged[0] if merged else _one_grid_each(len(together.shared_buffers), len(split))
        + (f" (e.g. {split[0]})" if split else "")))
    grid = max(output_grid(p) for p in together.values())
    mine, theirs = result.step_errors[ONE_GRID], result.step_errors[PER_METHOD]
    worse = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a > b + grid + 1e-6]
    result.checks.append(Check(
        "quantize_methods is no worse than quantizing each method on its own, call by call",
        not worse,
        (f"call {worse[0] + 1} ({calls[worse[0]][0]}): {mine[worse[0]]:.6f} vs "
         f"{theirs[worse[0]]:.6f}" if worse else
         f"worst call error {max(mine):.6f} vs {max(theirs):.6f} per method") +
        f" (output grid step {grid:.3g})"))
    return together, together_trace


def _integer_stage(stage: _Stages, result: FlowResult, quantized: dict[str, Any], calls: list,
                   eager: Trace, reference: Trace, options: dict[str, Any],
                   ) -> tuple[dict[str, Any], Trace]:
    """QuantizeMutableBuffers on every method; bit for bit the fp32-stored methods."""
    manager = PassManager([QuantizeMutableBuffers()], **options)
    stored = stage("store quantized state as integers (QuantizeMutableBuffers)",
                   lambda: manager.run(copy_program(dict(quantized))))
    programs = {method: run.program for method, run in stored.items()}
    for method, run in stored.items():
        result.reports.append((f"quantize state {method}", run.report))
    grids = {fqn: info.grid for program in programs.values()
             for fqn, info in mutable_buffers(program).items() if info.grid is not None}
    trace = stage("integer-state methods in turn",
                  lambda: _in_turn(stage, programs, calls, state=dequantized_state(grids)))
    difference = first_difference(reference, trace)  # atol 0
    result.checks.append(Check(
        "integer-stored methods compute exactly what the fp32-stored ones do",
        difference is None,
        difference or f"outputs and dequantized state equal (atol 0) over {len(calls)} calls; "
        f"{_shared_buffers(len(grids))} stored as integers, {_one_grid(len(grids))}"))
    result.step_errors[INTEGER_METHODS] = output_errors(eager, trace)
    result.state_storage = _storage(quantized, programs, stored)
    return programs, trace


def _storage(before: Mapping[str, Any], after: Mapping[str, Any], stored: Any) -> dict:
    """Each buffer's storage before and after, over every method (a shared buffer once)."""
    merged: dict[str, Any] = {}
    for method in before:
        notes = [note for record in stored[method].report.records for note in record.notes]
        merged.update(storage_of(before[method], after[method], notes)["buffers"])
    return {
        "buffers": merged,
        "bytes_before": sum(b["bytes_before"] for b in merged.values()),
        "bytes_after": sum(b["bytes_after"] for b in merged.values()),
        "planned_mutable_buffer_bytes": {},
    }


def _on_runtime(stage: _Stages, label: str, programs: dict[str, Any], calls: list) -> Any:
    """The methods lowered into one .pte and called in turn on ExecuTorch's runtime."""
    from ..executorch.methods import run_methods_on_runtime

    return stage(f"{label} methods on ExecuTorch's runtime (one .pte, shared buffers)",
                 lambda: run_methods_on_runtime(programs, calls))


def _runtime_stage(stage: _Stages, result: FlowResult,
                   lowered: list[tuple[str, dict[str, Any], Trace]], calls: list,
                   eager: Trace, ran_before: Mapping[str, Any]) -> None:
    """Each program from one .pte on ExecuTorch's runtime, checked against what it computed
    in Python (fp32: within float rounding; quantized: within one output grid step, one
    more per call before it when the methods write state); its
    column in the decode table is, like every other, its error against fp32 eager.
    ``ran_before`` holds the runs (by label) the flow made already, reported as they are."""
    from ..executorch.runtime import output_grid as user_output_grid
    from ..executorch.runtime import within_grid_steps_per_call

    for label, programs, python in lowered:
        run = ran_before.get(label) or _on_runtime(stage, label, programs, calls)
        on_runtime = Trace(run.outputs)
        errors = output_errors(python, on_runtime)
        # The step of the dequantize each method returns, as the one-method job reads it.
        grid = None if label == "fp32" else max(
            (g for g in map(user_output_grid, programs.values()) if g is not None), default=None)
        tolerance = EXPORT_ATOL if grid is None else grid
        stateful = any(find_mutations(p).writers for p in programs.values())
        result.step_errors[f"{label} on ExecuTorch"] = output_errors(eager, on_runtime)
        result.column_notes[f"{label} on ExecuTorch"] = (
            f"the {label} methods lowered into one .pte and called in turn on ExecuTorch's "
            "runtime")
        if result.state_storage:
            stored_as = "integer-stored" if label == "quantized" else "fp32"
            result.state_storage["planned_mutable_buffer_bytes"][
                f"{stored_as} methods'"] = run.memory.shared_bytes
        result.notes += [f"{label} methods' lowering: {note}" for note in run.notes]
        result.checks.append(Check(
            f"{label} methods on ExecuTorch's runtime match "
            + ("fp32 eager" if label == "fp32" else "the same methods in Python"),
            max(errors) <= tolerance if grid is None else within_grid_steps_per_call(
                errors, grid, stateful),
            f"worst call difference {max(errors):.3g} (tolerance {tolerance:.3g}"
            f"{' per call so far' if grid is not None and stateful else ''}); shared "
            f"mutable buffers planned once: {run.memory.shared_bytes:,} B"))
