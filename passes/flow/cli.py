"""Command line: ``mutable-buffer-passes run [MODEL] [options]``, also ``python -m passes run``.

The factory returns ``(module, example_inputs[, steps])`` (v1) or a mapping with
``module``, ``example_args``, ``example_kwargs``, ``steps``, ``dynamic_shapes`` and
``export`` (v2; see :mod:`passes.flow.factory`), or a mapping with ``module``, ``methods``
and ``steps`` (v3, several methods over one state; see :mod:`passes.flow.factory`). Without
a factory the built-in seeded
KV-cache decoder is used. The report goes to stdout alone, so it can be piped or redirected;
progress lines, notices and errors go to stderr (``--quiet`` drops the progress and notices).
Exit status: 0 every check passed, 1 a check failed, 2 bad usage or the model could not be
loaded (or exported, or its steps do not fit it, or it holds float64 values the quantizer
would observe), 3 the flow failed (a short report says
where), 130 interrupted (Ctrl-C), 141 stdout was closed before the report ended (``| head``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pass_manager import PassManagerError, PrintIR, Reproducer, parse_pipeline
from pass_manager.pipeline_text import did_you_mean, registered_passes
from pass_manager.validation import as_call

from .. import __version__
from .._startup import started
from ..errors import QuantizationInputError, StatePastEndError
from .factory import (
    EXPORT_MODES,
    Exported,
    ExportError,
    MethodsSpec,
    ModelError,
    ModelSpec,
    check_calls_fit,
    check_steps_within_state,
    export_methods,
    export_program,
    model_spec,
)
from .noise import held, hold_known_noise
from .result import Failure, FlowResult

DEFAULT_MODEL = "passes.examples:stateful_decoder_job"
DEFAULT_STEPS = 8
MAX_STEPS = 100_000
# The console command setup.cfg installs is named after the distribution.
COMMAND = "mutable-buffer-passes"
# 2 is also bad usage (argparse's own status for it).
LOAD_FAILED, FLOW_FAILED = 2, 3
# As a shell reports a process that SIGINT / SIGPIPE ended: 128 + the signal's number.
INTERRUPTED, OUTPUT_CLOSED = 130, 141
EXIT_STATUSES = """exit status:
  0    every check passed
  1    a check failed
  2    bad usage, or the model could not be loaded, exported, fit its steps or be quantized
  3    the flow failed after loading (the report so far, then where it failed)
  130  interrupted (Ctrl-C): the report so far, then the stage it stopped
  141  stdout was closed before the report ended (e.g. piped into head)"""


MODEL_FORMS = ("package.module:factory (importable from the current folder or PYTHONPATH) "
               "or path/to/file.py:factory")


def _import_model_module(module_name: str) -> Any:
    """The factory's module: a file path, or a module importable from the current folder
    (as ``python -m`` and ``make run`` see it) or from PYTHONPATH."""
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        path = Path(module_name)
        if path.is_dir():
            raise ModelError(f"{module_name!r} is a folder: MODEL names a file in it and its "
                             f"factory, path/to/file.py:factory, or is {MODEL_FORMS}")
        if not path.is_file():
            raise ModelError(f"no such file {module_name!r}; MODEL is {MODEL_FORMS}")
        sys.path.insert(0, str(path.resolve().parent))  # the file's own sibling imports
        # By its own name where that name finds this file: what records a pass it defines
        # by module (a reproducer, pipeline text) imports it again, in a replay too.
        found = importlib.util.find_spec(path.stem) if path.stem.isidentifier() else None
        if found is not None and found.origin and Path(found.origin) == path.resolve():
            return importlib.import_module(path.stem)
        name = f"_mutable_buffer_passes_model_{path.stem}"  # a name taken by another module
        loader = importlib.util.spec_from_file_location(name, path.resolve())
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        loader.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_name)


def load_model(spec: str, steps: int) -> ModelSpec | MethodsSpec:
    """Import the factory ``MODEL`` names, call it and read its result; ModelError otherwise."""
    module_name, _, attr = spec.rpartition(":")
    _refuse_a_file_that_is_not_a_factory(spec, module_name)
    if not module_name or not attr:
        head, dot, tail = spec.rpartition(".")
        meant = (f" (did you mean {head}:{tail}?)"
                 if ":" not in spec and dot and head and tail.isidentifier() else "")
        raise ModelError(f"MODEL must be {MODEL_FORMS}, got {spec!r}{meant}")
    try:
        module = _import_model_module(module_name)
    except ModelError:
        raise
    except ModuleNotFoundError as e:
        if e.name and module_name != e.name and not module_name.startswith(f"{e.name}."):
            # The module is there: a package it imports is not.
            raise ModelError(f"cannot import {module_name!r}: it imports {e.name!r}, which is "
                             f"not installed (ModuleNotFoundError: {e})") from e
        raise ModelError(
            f"cannot import {module_name!r}: {e} (looked in the current folder {os.getcwd()} "
            "and PYTHONPATH; a file path works too: path/to/file.py:factory)") from e
    except SystemExit as e:
        raise ModelError(f"cannot import {module_name!r}: importing it {_exits(e)} (code run "
                         "at import, such as a script's argparse: put it under "
                         "if __name__ == '__main__':)") from e
    except Exception as e:
        raise ModelError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise ModelError(f"{module_name!r} has no attribute {attr!r}"
                         f"{did_you_mean(attr, _callables(module)) or _in_folder(module, attr)}")
    if not callable(factory):
        raise ModelError(f"{spec} is {_a(type(factory).__name__)}, not a factory function")
    module_class = factory if isinstance(factory, type) else type(factory)
    if issubclass(module_class, torch.nn.Module):
        what = "class" if factory is module_class else "instance"
        raise ModelError(f"{spec} is an nn.Module {what} ({module_class.__name__}), not a "
                         "factory: MODEL names a function returning the module and its "
                         f"example inputs, e.g. def factory(): return "
                         f"{module_class.__name__}(...), (example_input,)")
    required = _required_parameters(factory)
    if required:
        raise ModelError(f"{spec} takes {', '.join(required)}: a factory takes no arguments "
                         "(wrap it in one that gives them, e.g. def factory(): return "
                         f"{attr}(...))")
    try:
        made = factory()
    except SystemExit as e:  # else the job would end with the factory's status, silently
        raise ModelError(f"{spec}() {_exits(e)}: a factory returns the model") from e
    except Exception as e:
        raise ModelError(f"{spec}() failed: {type(e).__name__}: {e}") from e
    return model_spec(made, spec, steps)


def _refuse_a_file_that_is_not_a_factory(spec: str, module_name: str) -> None:
    """MODEL naming a file that holds no factory: a config, weights, a .pte, or a Python file
    without its factory's name. Each was read as a module name ("No module named 'config'")."""
    for name in (spec, module_name):
        path = Path(name)
        if not name or not path.is_file():
            continue
        if path.suffix == ".py":
            if name != spec:  # path/to/file.py:factory, as it should be
                return
            raise ModelError(f"MODEL {spec!r} names the file but not its factory: "
                             f"{name}:NAME, NAME the function in it returning the model")
        hint = (" (a Hugging Face config: a factory builds the model from it, e.g. "
                "AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)); see "
                "the tiny Llama factory in docs/main-job.md)" if path.suffix == ".json" else "")
        raise ModelError(f"MODEL {spec!r} names {_a(path.suffix or 'extensionless')} file, not "
                         f"Python: MODEL is {MODEL_FORMS}, a function returning the model and "
                         f"its example inputs{hint}")


def _in_folder(module: Any, attr: str) -> str:
    """For a folder without ``__init__.py`` (imported as a namespace package, which holds
    nothing): the modules in it, one of which MODEL meant to name."""
    if getattr(module, "__file__", None) is not None or not hasattr(module, "__path__"):
        return ""
    dotted = all(part.isidentifier() for part in module.__name__.split("."))
    inside = sorted({path.stem for folder in module.__path__ for path in Path(folder).glob("*.py")
                     if path.stem.isidentifier() or not dotted})
    # A folder name that is not an identifier is named by its path.
    names = ", ".join(f"{module.__name__}.{stem}:{attr}" if dotted else
                      f"{module.__name__.replace('.', os.sep)}{os.sep}{stem}.py:{attr}"
                      for stem in inside[:5])
    return (f": {module.__name__!r} is a folder, and MODEL names a module in it"
            + (f", e.g. {names}" if names else ""))


def _callables(module: Any) -> list[str]:
    """The names a misspelt factory name is matched against: what the module holds that can
    be called (its functions, and the classes and modules a wrong name may also be)."""
    return [name for name, value in vars(module).items()
            if callable(value) and not name.startswith("__")]


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _exits(e: SystemExit) -> str:
    return f"called sys.exit({'' if e.code is None else repr(e.code)})"


def _required_parameters(factory: Callable[..., Any]) -> list[str]:
    """The parameters ``factory()`` would leave without a value (none when unreadable)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def state_copies(steps: int) -> int:
    """About how many copies of a model's buffers the single-model flow holds at its peak:
    the programs it builds, then every compared program's buffers after every call.
    Measured with a 64 MiB buffer: peak memory grew by 32x the state at --steps 2, 76x at 8."""
    return 18 + 15 * steps // 2


def available_memory() -> int | None:
    """Bytes of memory available to this process now (Linux's MemAvailable, else the free
    pages), or None when the system does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _warn_if_state_will_not_fit(model: ModelSpec, spec: str) -> None:
    """Before the run: the system would kill the job minutes in, without a word."""
    state = sum(buffer.nbytes for buffer in model.module.buffers())
    needed, available = state * state_copies(len(model.steps)), available_memory()
    if available is not None and needed > available:
        print(f"warning: {spec} holds {state:,} bytes of buffers; the job keeps a copy of them "
              "for every program it compares, after every call: about "
              f"{needed:,} bytes at --steps {len(model.steps)}, more than the {available:,} "
              "bytes of memory available (fewer --steps need less)", file=sys.stderr)


def _runtime_for_precision(args: argparse.Namespace, spec: str, module: Any,
                           asked: str) -> None:
    """The runtime stage takes float32 programs: on a bfloat16 one ExecuTorch's portable
    dequantize aborts the process (the report is lost), and its check allows float32's 1e-5.
    Asked for, that is a load error; by default (auto), the job decodes in Python."""
    if args.runtime != "executorch":
        return
    tensors = [*module.named_parameters(), *module.named_buffers()]
    low = next(((n, t.dtype) for n, t in tensors if t.is_floating_point()
                and torch.finfo(t.dtype).bits < 32), None)
    if low is None:
        return
    why = (f"{spec} computes in {low[1]} ({low[0]}), and the ExecuTorch runtime stage takes "
           "float32 programs (ExecuTorch's dequantize aborts on a bfloat16 output; the check "
           "allows float32's 1e-5): convert the model with .float() in the factory")
    if asked == "executorch":
        raise ModelError(f"--runtime executorch: {why}, or run with --runtime python")
    args.runtime = "python"
    _notice(args)(f"decoding in Python only: {why} to also run it on ExecuTorch's runtime")


def _export(model: ModelSpec, spec: str, mode: str | None) -> Exported:
    try:
        return export_program(
            model.module,
            model.example_args,
            model.example_kwargs,
            dynamic_shapes=model.dynamic_shapes,
            mode=mode or model.export,
        )
    except ExportError as e:
        raise ModelError(f"{spec} is not exportable: {e}") from e
    except ModelError as e:  # found before export: the model fails on its example
        raise ModelError(f"{spec}: {e}") from e


def _print_section(title: str, body: str) -> None:
    print(f"\n== {title}\n{body}", flush=True)


def _notice(args: argparse.Namespace) -> Callable[[str], None]:
    """Where progress lines and notices go: stderr, so stdout holds the report alone."""
    if args.quiet:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _quantizer_factory(name: str) -> Any:
    from .examples import AnnotateEveryOpQuantizer, xnnpack_quantizer

    # every-op: the QNN-style quantizer that annotates data movement too.
    return AnnotateEveryOpQuantizer if name == "every-op" else xnnpack_quantizer


def _print_report(result: Any) -> None:
    if result.bought:
        _print_section("what the passes bought (quantized decode vs fp32 eager, torchao's "
                       "recipe without them vs with them)", "\n".join(result.bought))
    if result.notes:
        _print_section("notes", "\n".join(result.notes))
    _print_section("pass plan", result.plan)
    if result.reports:
        _print_section("passes", result.pass_table())
    if result.quantization is not None:
        _print_section("quantization", "\n".join(_quantization_lines(result.quantization)))
    if result.state_storage:
        from .integer_state import state_lines

        _print_section("state storage (QuantizeMutableBuffers)",
                       "\n".join(state_lines(result.state_storage)))
    if result.delegate_summary:
        _print_section("delegates", "\n".join(result.delegate_summary))
    if result.step_errors:
        _print_section("decode", result.decode_table())
    if result.stage_times:
        _print_section("slowest stages", "\n".join(result.slowest_stages()))
    if result.checks:
        _print_section(
            "checks",
            "\n".join(
                f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in result.checks
            ),
        )


def _quantization_lines(report: Any) -> list[str]:
    return [
        "with the passes: quantize_program (prepare, calibrate, reset, convert, "
        "UnfreezeMutableBuffer, lifted back to an ExportedProgram: no re-trace)",
        *(f"  {line}" for line in report.summary()),
        "without the passes (the reference for today's way): torchao's recipe as it is, "
        "run_decompositions({}) then prepare/convert of the module, decoded as converted "
        "(its users re-export it to lower it)",
    ]


def run(args: argparse.Namespace) -> int:
    spec = args.model or DEFAULT_MODEL
    hold_known_noise()
    pass_options = _pass_options(args)
    # Found now, not after minutes of quantization (or, for the debugging flags, never:
    # an unusable folder loses the dump).
    unusable, problem = _unusable_output(args)
    if not problem and args.quantize_state and args.skip_quantization:
        problem = ("--quantize-state stores quantized state: it cannot go with "
                   "--skip-quantization")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        # The usable ones say so: a report a previous run left there would read as this one's.
        _write_refusal(args, Failure("options", problem), skip=unusable)
        return LOAD_FAILED
    if args.print_to:
        _remove_previous_dumps(Path(args.print_to), _notice(args))
    runtime_asked = args.runtime
    try:
        # Importing ExecuTorch to see whether it is there takes seconds.
        refused = _resolve_runtime(args)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C) while looking for ExecuTorch", file=sys.stderr)
        _write_refusal(args, interrupted="looking for ExecuTorch")
        return INTERRUPTED
    if refused:
        return refused
    doing = "loading"
    try:
        model = load_model(spec, args.steps or DEFAULT_STEPS)
        # Read once the model's module is imported, before its export: a pass of the user's
        # own that module defines or imports is registered by then.
        pipeline, problem = _pass_flags(args, pass_options)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            _write_refusal(args, Failure(doing, problem))
            return LOAD_FAILED
        if args.steps and len(model.steps) < args.steps:
            _notice(args)(f"--steps {args.steps}: {spec} gives {len(model.steps)} step(s); "
                          "decoding those")
        _runtime_for_precision(args, spec, model.module, runtime_asked)
        doing = "exporting"
        if isinstance(model, MethodsSpec):
            methods = _export_methods(model, spec, args.export)
            doing = "checking the steps"
            _check_method_calls(model, methods, spec)
        else:
            _warn_if_state_will_not_fit(model, spec)
            exported = _export(model, spec, args.export)
            doing = "checking the steps"
            check_calls_fit(exported.program,
                            [(f"steps[{i}]", call) for i, call in enumerate(model.steps)], spec)
            check_steps_within_state({"forward": exported.program},
                                     [("forward", *as_call(call)) for call in model.steps],
                                     spec)
        if not args.skip_quantization:
            doing = "checking the model"
            _check_quantizable(args, model, methods if isinstance(model, MethodsSpec)
                               else {"forward": exported})
    except QuantizationInputError as e:
        # Else found after export, the fp32 stages and the functional stage, as the flow's
        # quantize stage fails.
        if args.traceback:
            traceback.print_exc()
        why = f"{spec} cannot be quantized: {e.reason}; or run with --skip-quantization"
        print(f"error: {why}", file=sys.stderr)
        _write_refusal(args, Failure(doing, f"{type(e).__name__}: {why}", node=e.node))
        return LOAD_FAILED
    except (ModelError, StatePastEndError) as e:
        if args.traceback:
            traceback.print_exc()
        hint = (f" (--steps {e.step} stops before it)"
                if isinstance(e, StatePastEndError) and e.step else "")
        print(f"error: {e}{hint}", file=sys.stderr)
        _write_refusal(args, Failure(doing, f"{type(e).__name__}: {e}{hint}"))
        return LOAD_FAILED
    except KeyboardInterrupt:  # the flow's own stages report theirs in _finish
        print(f"interrupted (Ctrl-C) while {doing} {spec}", file=sys.stderr)
        _write_refusal(args, interrupted=f"{doing} {spec}")
        return INTERRUPTED
    except Exception as e:  # noqa: BLE001 - unforeseen, but still this stage's, one line
        if args.traceback:
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        why = f"{doing} {spec} failed: {type(e).__name__}: {first}"
        print(f"error: {why}" + ("" if args.traceback else " (--traceback shows the full "
                                 "trace)"), file=sys.stderr)
        _write_refusal(args, Failure(doing, why))
        return LOAD_FAILED
    if isinstance(model, MethodsSpec):
        return _run_methods(args, spec, model, methods, pipeline, pass_options)
    from .run import run_model

    print(
        f"model: {spec} ({sum(p.numel() for p in model.module.parameters())} parameters), "
        f"{len(model.steps)} decode steps, exported {exported.mode}, runtime {args.runtime}",
        flush=True,
    )
    return _finish(args, pass_options, lambda: run_model(
        model, exported=exported, delegate=not args.skip_delegation,
        **_flow_options(args, pipeline, pass_options)))


def _check_quantizable(args: argparse.Namespace, model: ModelSpec | MethodsSpec,
                       exported: dict[str, Exported]) -> None:
    """A value the quantizer would observe in float64, which pt2e cannot quantize, as a
    QuantizationInputError naming its node; looked for only in a model holding float64."""
    from .quantization import check_quantizable, holds_float64

    if holds_float64(model.module, model.steps):
        for method in exported.values():
            check_quantizable(method.program, _quantizer_factory(args.quantizer)())


def _resolve_runtime(args: argparse.Namespace) -> int | None:
    """``--runtime auto`` made ``executorch`` or ``python`` by whether ExecuTorch is
    installed; the exit status when ``--runtime executorch`` cannot be honoured, else None."""
    from ..executorch import INSTALL_HINT, available

    if args.runtime == "auto":
        args.runtime = "executorch" if available() else "python"
        if args.runtime == "python":
            _notice(args)("ExecuTorch is not installed: decoding in Python only (install the "
                          "executorch extra to also run ExecuTorch's runtime: " + INSTALL_HINT
                          + ")")
    elif args.runtime == "executorch" and not available():
        why = ("--runtime executorch needs the executorch extra; install it with: "
               f"{INSTALL_HINT}; or decode in Python only: --runtime python (or auto, the "
               "default, which uses ExecuTorch when it is installed)")
        print(f"error: {why}", file=sys.stderr)
        _write_refusal(args, Failure("runtime", why))
        return FLOW_FAILED
    return None


def _export_methods(model: MethodsSpec, spec: str, mode: str | None) -> dict[str, Exported]:
    try:
        return export_methods(model, mode)
    except ModelError as e:
        raise ModelError(f"{spec}: {e}") from e


def _check_method_calls(model: MethodsSpec, exported: dict[str, Exported], spec: str) -> None:
    """A v3 factory's calls against its exported methods: their inputs, and the state they
    write by position (as for one method)."""
    for index, (method, step_args, kwargs) in enumerate(model.steps):
        if method not in model.carried:  # a carried method's calls fit it once resident
            check_calls_fit(exported[method].program,
                            [(f"steps[{index}] ({method})", (step_args, kwargs))], spec)
    if not model.carried:  # else the flow checks, once the state is resident
        check_steps_within_state({m: e.program for m, e in exported.items()}, model.steps,
                                 spec)


def _run_methods(args: argparse.Namespace, spec: str, model: MethodsSpec,
                 exported: dict[str, Exported], pipeline: Any,
                 pass_options: dict[str, Any]) -> int:
    """A v3 factory, its methods exported and its calls checked: the several-method flow."""
    from .run_methods import run_methods_flow

    modes = ", ".join(f"{m} exported {e.mode}" for m, e in exported.items())
    print(
        f"model: {spec} ({sum(p.numel() for p in model.module.parameters())} parameters), "
        f"{len(model.steps)} calls of {len(model.methods)} methods over one state ({modes}), "
        f"runtime {args.runtime}",
        flush=True,
    )
    if args.skip_delegation:
        _notice(args)("--skip-delegation: the several-method flow delegates only on "
                      "ExecuTorch's runtime (--runtime executorch)")
    return _finish(args, pass_options, lambda: run_methods_flow(
        model, exported=exported, **_flow_options(args, pipeline, pass_options)))


def _flow_options(args: argparse.Namespace, pipeline: Any, pass_options: dict[str, Any],
                  ) -> dict[str, Any]:
    """The options both flows take from the command line."""
    return {
        "quantize": not args.skip_quantization,
        "quantize_state": args.quantize_state,
        "quantizer_factory": _quantizer_factory(args.quantizer),
        "log": _notice(args),
        "progress_bars": not args.quiet,
        "pipeline": pipeline,
        "pass_options": pass_options,
        "runtime": args.runtime,
    }


def _finish(args: argparse.Namespace, pass_options: dict[str, Any],
            flow: Callable[[], Any]) -> int:
    """Run the flow; print its report (and where it failed) and give the exit status."""
    from .run import FlowError, FlowInterrupted

    try:
        result = flow()
    except FlowError as e:
        _warn_unprinted(pass_options)
        return _failed(args, e)
    except FlowInterrupted as e:
        try:
            _print_report(e.result)
            _print_section("interrupted (Ctrl-C)", f"stage:  {e.stage}")
        finally:  # what ran, and "interrupted" naming the stage: even if stdout closed
            _write_outputs(args, e.result)
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
    try:
        _print_report(result)
        _warn_unprinted(pass_options)
    finally:  # stdout closed (| head) or Ctrl-C while printing: the files are this run's
        written = _write_outputs(args, result)
    _show_held_warnings(args)
    if not written:
        return LOAD_FAILED
    return 0 if result.ok else 1


def _warn_unprinted(pass_options: dict[str, Any]) -> None:
    """A --print-before/--print-after pass this run never ran (e.g. one an option adds)."""
    for printer in pass_options.get("instruments", ()):
        for name in printer.unmatched() if isinstance(printer, PrintIR) else ():
            print(f"warning: --print-before/--print-after {name}: no pipeline of this run "
                  "ran that pass; nothing was printed for it", file=sys.stderr)


def _failed(args: argparse.Namespace, e: Any) -> int:
    result = e.result
    try:
        _print_report(result)
        if args.traceback:
            traceback.print_exception(e.__cause__ or e)
        hint = "" if args.traceback else "\n(--traceback shows the full trace)"
        _print_section("failed", "\n".join(e.failure.lines()) + hint)
    finally:  # stdout closed (| head) or Ctrl-C while printing: the files are this run's
        _write_outputs(args, result)
    _show_held_warnings(args)
    return FLOW_FAILED


def _show_held_warnings(args: argparse.Namespace) -> None:
    """With --show-warnings, what torch, torchao and ExecuTorch said that the job held back."""
    if args.show_warnings:
        lines = held()
        print(f"\n== warnings held back as known harmless ({len(lines)})", file=sys.stderr)
        for line in lines:
            print(line, file=sys.stderr)


def _pass_options(args: argparse.Namespace) -> dict[str, Any]:
    """The debugging flags as PassManager instruments, for every pipeline the job runs."""
    instruments: list[Any] = []
    if args.print_before or args.print_after or args.print_after_change \
            or args.print_after_failure:
        instruments.append(PrintIR(args.print_before or (), args.print_after or (),
                                   args.print_after_change, args.print_after_failure,
                                   args.print_to, warn=False))  # said once, by _finish
    if args.reproducer_dir:
        instruments.append(Reproducer(args.reproducer_dir))
    return {"instruments": instruments} if instruments else {}


def _write_outputs(args: argparse.Namespace, result: Any, skip: str | None = None) -> bool:
    """Write --dot and --json (but the ``skip`` one); False when one could not be written
    (one line says why)."""
    notice = _notice(args)
    written = True
    args.outputs_written = True  # by this run, whatever stops it next
    for option, file, what, text in (
            ("--dot", args.dot, "the pass DAG" if result.dot else "an empty pass DAG (no "
             "pass ran)", lambda: result.dot or _no_passes_dot(result)),
            ("--json", args.json, "the report", lambda: _report_json(result.to_dict()))):
        if not file or option == skip:
            continue
        try:
            # A path that is not UTF-8 in a refusal's reason is escaped, not an error.
            Path(file).write_text(text(), encoding="utf-8", errors="backslashreplace")
        except OSError as e:  # the folder went away or filled up while the flow ran
            print(f"error: {option} {file}: cannot write it: {type(e).__name__}: "
                  f"{e.strerror or e}{_removed(Path(file))}", file=sys.stderr)
            written = False
        else:
            notice(f"wrote {what} to {file}")
    return written


def _report_json(report: dict) -> str:
    """``report`` as JSON text. An error that is not finite (an output NaN or inf, a
    buffer holding -inf that quantization made finite) is the string ``"inf"`` / ``"-inf"``
    / ``"nan"``: JSON has no such number, and Python's ``Infinity`` is refused by strict
    parsers (JavaScript's ``JSON.parse``, ``jq`` before 1.7)."""
    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [finite(item) for item in value]
        return value

    return json.dumps(finite(report), indent=2, allow_nan=False)


def _removed(path: Path) -> str:
    """Remove what is left at ``path`` of a write that failed (the start of this run's
    file on a full disk, or a previous run's that could not be opened again), which would
    read as this run's; say so."""
    if not path.is_file():
        return ""
    try:
        path.unlink()
    except OSError:
        return " (what is left in it is not this run's report)"
    return " (removed what was left in it)"


def _no_passes_dot(result: Any) -> str:
    """--dot for a job that stopped before any pass ran: an empty graph saying why, so a
    DAG a previous run left in the file is not read as this run's."""
    why = (f"{result.failure.stage}: {result.failure.reason}" if result.failure
           else f"interrupted (Ctrl-C) while {result.interrupted}" if result.interrupted
           else "nothing ran")
    return "digraph passes {\n  // no pass ran: " + " ".join(why.split()) + "\n}\n"


def _write_refusal(args: argparse.Namespace, failure: Failure | None = None,
                   interrupted: str | None = None, skip: str | None = None) -> None:
    """--json and --dot (but the ``skip`` one) for a job that stopped before its flow ran
    (its options refused, the model not loaded, exported or fitting its steps; Ctrl-C then):
    ``ok`` false with why, and an empty DAG saying why, so a file a previous run left there
    (``"ok": true``, its DAG) is not read as this run's."""
    _write_outputs(args, FlowResult(failure=failure, interrupted=interrupted), skip)


def _unusable_output(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The output option whose path is unusable before the run, and why; (None, None) when
    all are usable."""
    for option, value, kind in (("--json", args.json, "file"), ("--dot", args.dot, "file"),
                                ("--print-to", args.print_to, "folder"),
                                ("--reproducer-dir", args.reproducer_dir, "folder")):
        problem = value and ("not stdout: the report goes there; give a file name"
                             if value == "-" else _unwritable(Path(value), kind))
        if problem:
            return option, f"{option} {value}: {problem}"
    if args.json and args.dot and os.path.realpath(args.json) == os.path.realpath(args.dot):
        # Else the report overwrites the DAG, each said written there.
        return "--dot", f"--json and --dot both name {args.dot}: give each its own file"
    return None, None


def _unwritable(path: Path, kind: str) -> str | None:
    """Why a file (written in an existing folder) or a folder (created with its parents)
    cannot be written at ``path``; None when it can."""
    if kind == "file":
        if path.is_dir():
            return "a folder, not a file"
        if path.exists() and not os.access(path, os.W_OK):
            return "the file is not writable"
        folder = path.parent
        if not folder.exists():
            return f"no folder {str(folder)!r}"
    else:
        if path.exists() and not path.is_dir():
            return "a file, not a folder"
        folder = next(p for p in (path, *path.parents) if p.exists())  # what mkdir starts in
    if not folder.is_dir():
        return f"{str(folder)!r} is a file, not a folder"
    if not os.access(folder, os.W_OK):
        return f"cannot write in {str(folder)!r}"
    return _refused_by_trying(path, folder, kind)


def _refused_by_trying(path: Path, folder: Path, kind: str) -> str | None:
    """Why creating (or opening) ``path`` fails, found by doing it and undoing it: the
    permission bits allow root everything, while /proc, /sys or a read-only mount refuse
    the file itself, which was found only after the run."""
    try:
        if kind == "file" and path.is_file():
            doing = "cannot open it for writing"
            os.close(os.open(path, os.O_WRONLY))  # not truncated: the run may yet stop
        elif kind == "file" and not path.exists():
            doing = "cannot create it"
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            path.unlink()
        elif kind == "folder":
            doing = f"cannot create a folder in {str(folder)!r}"
            Path(tempfile.mkdtemp(prefix=".mutable-buffer-passes-", dir=folder)).rmdir()
    except OSError as e:
        return f"{doing}: {type(e).__name__}: {e.strerror or e}"
    return None


# The name PrintIR gives each dump it writes in a folder: count, pass index, pass, when.
_DUMP_NAME = re.compile(r"\d{3,}-\d+-\w+-(before|after|after-failure)\.txt")
_DUMP_HEADER = "// -----// IR Dump "


def _remove_previous_dumps(folder: Path, notice: Callable[[str], None]) -> None:
    """The dumps a previous run left in the --print-to folder: this run numbers its own from
    001 again, so a file it does not overwrite would read as this run's. Only files named and
    headed as PrintIR writes them are removed."""
    if not folder.is_dir():
        return
    removed = 0
    for path in folder.iterdir():
        if not _DUMP_NAME.fullmatch(path.name) or not path.is_file():
            continue
        with contextlib.suppress(OSError, UnicodeDecodeError):
            with path.open(encoding="utf-8") as file:
                if file.read(len(_DUMP_HEADER)) != _DUMP_HEADER:
                    continue
            path.unlink()
            removed += 1
    if removed:
        notice(f"--print-to {folder}: removed {removed} dump(s) a previous run left there")


def _pass_flags(args: argparse.Namespace, pass_options: dict[str, Any]
                ) -> tuple[Any, str | None]:
    """The ``--pipeline`` manager and what is wrong with the pass flags (a pipeline that does
    not parse, a name to print no pass has), or None."""
    own = " (a pass of your own: define or import it in MODEL's module)"
    try:
        pipeline = parse_pipeline(args.pipeline, **pass_options) if args.pipeline else None
    except PassManagerError as e:
        first = str(e).splitlines()[0]
        if not Path(args.pipeline).is_file():
            return None, f"--pipeline: {first}{own if 'no registered pass' in first else ''}"
        # Not pipeline text, but a file holding it (a long pipeline kept beside the model).
        try:
            pipeline = parse_pipeline(Path(args.pipeline).read_text(), **pass_options)
        except (OSError, UnicodeDecodeError) as e:
            return None, f"--pipeline {args.pipeline}: cannot read it: {e}"
        except PassManagerError as e:
            first = str(e).splitlines()[0]
            return None, (f"--pipeline {args.pipeline} (read as a file): {first}"
                          f"{own if 'no registered pass' in first else ''}")
    problem = _unknown_pass_to_print(args)
    return pipeline, problem and problem + own


def _unknown_pass_to_print(args: argparse.Namespace) -> str | None:
    """A --print-before / --print-after name no pass has (it would silently print nothing)."""
    known = sorted({cls.__name__ for cls in registered_passes()})
    for option, names in (("--print-before", args.print_before),
                          ("--print-after", args.print_after)):
        for name in names or ():
            if name not in known:
                return (f"{option}: no pass is named {name!r}{did_you_mean(name, known)}; "
                        f"known: {', '.join(known)}")
    return None


def _version() -> str:
    """This package's version and those of the libraries whose behaviour it depends on."""
    libraries = []
    for name in ("torch", "torchao", "executorch"):
        try:
            libraries.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            libraries.append(f"{name} not installed")
    return f"{COMMAND} {__version__} ({', '.join(libraries)})"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (one decode call), got {value}")
    if value > MAX_STEPS:
        # Else the job spends hours building and checking that many calls before its first
        # stage, in silence, or runs out of memory.
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_STEPS:,} (every program decodes that many calls and the job "
            f"keeps each call's outputs and state to compare), got {value:,}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``prog`` is how the user called it (default: argv[0])."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Keep mutable buffers (KV caches, counters) correct through torch.export,\n"
        "pt2e quantization and delegation, and check it on a model.",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the version (and torch's, torchao's, ExecuTorch's) and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run_parser = commands.add_parser(
        "run",
        help="run the mutable-buffer flow on a model and check it against eager",
        description="Export MODEL, run the passes, quantize with torchao's pt2e flow, delegate,\n"
        "decode, and compare every program with fp32 eager. The report goes to stdout\n"
        "alone (pipe or redirect it); progress lines and notices go to stderr.",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_parser.add_argument(
        "model",
        nargs="?",
        default="",
        metavar="MODEL",
        help="package.module:factory or path/to/file.py:factory, a function returning "
        "(module, example_inputs[, steps]) or a mapping (see passes.flow.factory); default: "
        f"{DEFAULT_MODEL}, a seeded "
        "2-layer Llama-style decoder with KV caches",
    )
    run_parser.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                            help=f"decode calls, 1 to {MAX_STEPS:,}: the first N of the "
                            "factory's steps, or its example repeated N times (default "
                            f"{DEFAULT_STEPS})")
    run_parser.add_argument(
        "--quantizer",
        choices=("xnnpack", "every-op"),
        default="xnnpack",
        help="torchao's XNNPACK-style quantizer, or one that annotates every op (QNN style)",
    )
    run_parser.add_argument(
        "--pipeline",
        metavar="TEXT",
        help="run this pipeline instead of the functionalization stage, e.g. "
        "'MarkMutableBuffers,InplaceToFunctional' (registered pass names, options in {})",
    )
    run_parser.add_argument(
        "--export",
        choices=EXPORT_MODES,
        default=None,
        help="force torch.export's mode (default: the factory's, else strict, else non-strict)",
    )
    run_parser.add_argument(
        "--runtime",
        choices=("auto", "python", "executorch"),
        default="auto",
        help="executorch: also decode on ExecuTorch's runtime (XNNPACK + "
        "BufferOwningPartitioner, .pte, pybind runtime; needs the executorch extra); "
        "python: Python only; auto (default): executorch when it is installed",
    )
    run_parser.add_argument("--skip-quantization", action="store_true",
                            help="run the flow in fp32: no pt2e quantization (the passes, "
                            "delegation and decoding still run)")
    run_parser.add_argument("--quantize-state", action="store_true",
                            help="store the quantized state as integers (QuantizeMutableBuffers "
                            "after quantization): per buffer dtype and bytes, checked exactly "
                            "against the fp32-stored program; with --runtime executorch, the "
                            "planned mutable-buffer bytes of both .pte files")
    run_parser.add_argument("--skip-delegation", action="store_true",
                            help="do not lower to delegates (to_delegate and "
                            "ConsumeBufferMutationsInDelegate)")
    run_parser.add_argument("--dot", metavar="FILE", help="write the pass DAG as Graphviz DOT")
    run_parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    run_parser.add_argument("-q", "--quiet", action="store_true",
                            help="no progress bars or notices on stderr (errors still show)")
    run_parser.add_argument(
        "--traceback", action="store_true", help="show the full trace when something fails"
    )
    run_parser.add_argument(
        "--show-warnings", action="store_true",
        help="also print the warnings of torch, torchao and ExecuTorch held back as known "
        "harmless (CPU-only kernel libraries, deprecations, native CPU probes)")
    debug = run_parser.add_argument_group("when a pass goes wrong")
    debug.add_argument("--print-before", metavar="PASS", action="append",
                       help="print the program before this pass (repeatable)")
    debug.add_argument("--print-after", metavar="PASS", action="append",
                       help="print the program after this pass (repeatable)")
    debug.add_argument("--print-after-change", action="store_true",
                       help="print the program after every pass that changed it")
    debug.add_argument("--print-after-failure", action="store_true",
                       help="print what a failing pass changed, and the rolled-back program")
    debug.add_argument("--print-to", metavar="DIR",
                       help="write those dumps to DIR, one file each (default: stdout)")
    debug.add_argument("--reproducer-dir", metavar="DIR",
                       help="when a pass fails, write a reproducer folder under DIR "
                       "(rerun it with python -m pass_manager replay FOLDER [--trust])")
    return parser


@contextlib.contextmanager
def _printable_output() -> Any:
    """stdout and stderr escaping what their encoding cannot hold: a path that is not UTF-8
    (its bytes arrive as surrogates) or a report's arrow on an ASCII stream otherwise ends
    the job with a UnicodeEncodeError in the middle of its report (stderr escapes by
    default, but not every stream standing in for it does)."""
    strict = [stream for stream in (sys.stdout, sys.stderr)
              if getattr(stream, "errors", None) == "strict"
              and callable(getattr(stream, "reconfigure", None))]
    for stream in strict:
        stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        for stream in strict:
            with contextlib.suppress(ValueError):  # closed by then
                stream.reconfigure(errors="strict")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the command, return the exit status.

    A usage error (an unknown flag, ``--steps 0``) exits with status 2 through argparse.
    """
    started()  # Ctrl-C is KeyboardInterrupt again: the stages below name where it stopped
    parser = build_parser(prog)
    argv = sys.argv[1:] if argv is None else argv
    if next((word for word in argv if not word.startswith("-")), None) == "replay":
        # A --reproducer-dir folder is replayed by pass_manager's own command; argparse
        # alone says only "invalid choice: 'replay' (choose from 'run')".
        parser.error("replay is the pass manager's command: python -m pass_manager replay "
                     "FOLDER [--trust] [--pdb]")
    args = parser.parse_args(argv)
    try:
        with _printable_output():
            return run(args)
    except BrokenPipeError:
        # The reader of stdout left (``| head``): nothing more can reach it, and Python's
        # own flush of stdout at exit would fail again, so stdout goes nowhere from now on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not getattr(args, "outputs_written", False):  # closed before the flow ran
            _write_refusal(args, Failure("output", "stdout was closed before the report "
                                         "(e.g. piped into head): the job stopped"))
        return OUTPUT_CLOSED
    except KeyboardInterrupt:  # between what run() reports itself (e.g. printing the report)
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main(prog="python -m passes.flow.cli"))
