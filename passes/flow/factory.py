"""What the main job runs on: a model factory's result, and how the model is exported.

A factory (``python -m passes run package.module:factory``) returns either

* v1: ``(module, example_inputs)`` or ``(module, example_inputs, steps)``, ``steps`` holding
  one argument tuple per decode call; or
* v2: a mapping with ``module``, ``example_args`` (a tuple, default ``()``),
  ``example_kwargs`` (a mapping, optional), ``steps`` (a list of argument tuples or
  ``(args, kwargs)`` pairs, optional), ``dynamic_shapes`` (optional, as
  ``torch.export.export`` takes them) and ``export`` (optional: ``"strict"`` or
  ``"non-strict"``); or
* v3: a mapping with ``module`` and ``methods``, the model deployed as several methods over
  one state (below).

Without steps (absent or None; an empty list is refused) the example call is
repeated. The module may be an ``nn.Module``, the
module of an exported program (``ep.module()``) or the exported program itself; a factory
may also return an exported program alone, decoded on the example it was exported with.

Contract v3 is a model deployed as several methods over one state, as backends that need
static shapes deploy a decoder (a prefill of N tokens and a one-token decode, two methods of
one ``.pte`` over one KV cache). Its mapping holds

* ``module``: the ``nn.Module`` every method calls (its ``forward``);
* ``methods``: method name -> how that method is exported, a mapping with
  ``example_args``, ``example_kwargs``, ``dynamic_shapes`` and ``export``, each optional as
  in contract v2;
* ``steps``: the calls in deployment order, each ``(method, args)``,
  ``(method, args, kwargs)`` or ``(method, kwargs_mapping)`` (default: every method's
  export example once, in the order ``methods`` lists them);
* ``export`` (optional): the default export mode of the methods.

In place of ``methods``, a v3 mapping may give the methods already exported:

* ``programs``: method name -> ``ExportedProgram`` (what another exporter produced, e.g.
  Hugging Face's ``export_for_generation`` stopped before lowering); ``steps`` is then
  required, in the form the methods take after ``carried``;
* ``carried`` (optional): method name -> ``passes.InputsToBuffers`` options, for programs
  that carry their state through their inputs and outputs (HF's ``StaticCache``): after
  functionalization each such method is made resident with its options, so the methods
  share that state as buffers;
* ``module`` is then the fp32 reference the calls are checked against, called with the
  ``steps`` (e.g. the programs' own modules with the state threaded as their exporter
  threads it, holding it as buffers named as ``carried`` names them).

Every method is exported from the same module, so the methods name their buffers alike:
the same fully-qualified name is the same state in every method.

Export happens the way model owners export (Hugging Face's and ExecuTorch's recipes):
under ``torch.no_grad()`` and strict (TorchDynamo) unless told otherwise. Strict is tried
first because it is the mode that sees a model's state as it is: non-strict tracing lifts
tensors reached through plain Python objects (Hugging Face's ``StaticCache`` layers) as
constants, so a KV cache becomes a constant the program writes (``InplaceToFunctional``
reads and writes it as the buffer it is when the module registers that very tensor; a
constant no buffer holds stays refused). When strict export fails (code TorchDynamo cannot
trace), or would drop a buffer ``forward`` rebinds (``self.total = self.total + x``), the
model is exported non-strict and the report says why; ``export="strict"`` /
``"non-strict"`` forces one mode.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pass_manager.call_signature import signature_of, tensor_wanted
from pass_manager.validation import Call, as_call, copy_program

from .._analysis.write_bounds import check_writes_within_state, flat_user_inputs

__all__ = [
    "EXPORT_MODES",
    "ExportError",
    "Exported",
    "MethodCall",
    "MethodSpec",
    "MethodsSpec",
    "ModelError",
    "ModelSpec",
    "check_calls_fit",
    "check_steps_within_state",
    "export_methods",
    "export_program",
    "first_misfit",
    "is_methods_factory",
    "methods_spec",
    "model_spec",
]

EXPORT_MODES = ("strict", "non-strict")
_NO_STEPS = ("{name}(): steps is empty: give one call per decode step, or leave steps out "
             "(or None) to repeat the example")
_V2_KEYS = {"module", "example_args", "example_kwargs", "steps", "dynamic_shapes", "export"}


class ModelError(Exception):
    """A factory's result is not a usable model; the message is one line for the user."""


class ExportError(ModelError):
    """``torch.export`` failed in every mode tried; the message is one line per mode."""


@dataclass
class ModelSpec:
    """A model and the calls it is exported with and decoded on."""

    module: torch.nn.Module
    example_args: tuple = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: list[Call] = field(default_factory=list)
    dynamic_shapes: Any = None
    export: str | None = None

    @property
    def example(self) -> Call:
        return self.example_args, self.example_kwargs


@dataclass
class Exported:
    """An exported program, the mode that produced it, and why when it is not the first tried."""

    program: torch.export.ExportedProgram
    mode: str
    note: str = ""


def model_spec(made: Any, name: str, steps: int) -> ModelSpec | MethodsSpec:
    """Read a factory's result (v1 tuple or v2 mapping) into a :class:`ModelSpec`, or a v3
    mapping (one with ``methods``) into a :class:`MethodsSpec`.

    ``steps`` is how many decode calls to keep; without steps of its own the example call is
    repeated that many times. Raises :class:`ModelError` naming what is wrong.
    """
    if is_methods_factory(made):
        return methods_spec(made, name, steps)
    if isinstance(made, torch.export.ExportedProgram):
        made = _from_exported(made, name)
    if isinstance(made, Mapping):
        spec = _from_mapping(made, name)
    elif isinstance(made, tuple) and len(made) in (2, 3):
        if not isinstance(made[1], tuple):
            raise ModelError(f"{name}() must return an nn.Module and a tuple of example inputs, "
                             f"got {_described(made)}")
        spec = ModelSpec(made[0], made[1], steps=_calls(made[2], name) if len(made) == 3 else [])
    else:
        raise ModelError(
            f"{name}() must return (module, example_inputs), (module, example_inputs, steps) "
            f"or a mapping with 'module' and 'example_args', got {_described(made)}"
        )
    if isinstance(spec.module, torch.export.ExportedProgram):
        spec.module = spec.module.module()
    _check_module(spec.module, name, "")
    # The module of an exported program refuses eval(); it is in inference form already.
    with contextlib.suppress(NotImplementedError):
        spec.module.eval()
    spec.steps = (spec.steps or [spec.example] * steps)[:steps]
    _check_calls(spec.module, [("the example", spec.example),
                               *((f"steps[{i}]", call) for i, call in enumerate(spec.steps))],
                 name, positional_only=isinstance(made, tuple))
    return spec


def _described(made: Any) -> str:
    """A factory's result as the user would recognize it: a tuple or list by the types it
    holds ("a tuple of 4: (Linear, tuple, list, int)"), anything else by its type."""
    if isinstance(made, (tuple, list)):
        kinds = ", ".join(type(item).__name__ for item in made[:6])
        more = ", ..." if len(made) > 6 else ""
        return f"a {type(made).__name__} of {len(made)}: ({kinds}{more})"
    return type(made).__name__


def _from_exported(program: torch.export.ExportedProgram, name: str) -> dict[str, Any]:
    """A factory returning an exported program alone: its module, called as it was exported
    (``example_inputs``, which torch keeps beside the program it exported)."""
    example = program.example_inputs
    if example is None:
        raise ModelError(f"{name}() returned an ExportedProgram without its example inputs "
                         "(a loaded one): return {'module': program, 'example_args': (...)}")
    args, kwargs = example
    return {"module": program, "example_args": tuple(args), "example_kwargs": dict(kwargs)}


def _check_module(module: Any, name: str, where: str) -> None:
    if isinstance(module, type) and issubclass(module, torch.nn.Module):
        raise ModelError(f"{name}() must return an nn.Module{where}, got the class "
                         f"{module.__name__}: return an instance, {module.__name__}(...)")
    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"{name}() must return an nn.Module{where}, got "
                         f"{type(module).__name__}")
    # A model built on the meta device has shapes but no values: eager and every program
    # "decode" it, and the job failed only in its checks, reading a value (status 3).
    empty = next((n for n, t in (*module.named_parameters(), *module.named_buffers())
                  if t.is_meta), None)
    if empty is not None:
        raise ModelError(f"{name}(): the module{where} holds tensors on the meta device, "
                         f"which have a shape but no values (first: {empty!r}): load its "
                         "weights in the factory (e.g. module.to_empty(device='cpu') then "
                         "load_state_dict, or build it outside torch.device('meta') / "
                         "init_empty_weights)")


def _check_calls(module: torch.nn.Module, calls: Sequence[tuple[str, Call]], name: str,
                 positional_only: bool = False) -> None:
    """Each call's inputs against ``forward``'s signature, before export and the decodes
    fail on them (an export error, or a TypeError at the n-th decode call)."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a forward without a readable signature: export says
        return
    shown = signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=signature.empty)
    for where, (args, kwargs) in calls:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            keyword_only = any(p.kind is p.KEYWORD_ONLY for p in signature.parameters.values())
            hint = (" (contract v1 gives inputs by position: keyword inputs go in a mapping's "
                    "'example_kwargs' and in steps as (args, kwargs) pairs)"
                    if positional_only and keyword_only else "")
            raise ModelError(f"{name}(): {where} does not fit "
                             f"{type(module).__name__}.forward{shown}: {e}{hint}") from None
        # A NumPy array fits the signature and fails inside forward (torch's "must be
        # Tensor, not numpy.ndarray"), or is baked into the program as a constant.
        for argument, given in bound.arguments.items():
            for path, value in torch.utils._pytree.tree_leaves_with_path(given):
                if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
                    raise ModelError(
                        f"{name}(): {where}: input "
                        f"{argument + torch.utils._pytree.keystr(path)!r} "
                        f"{tensor_wanted(value)}")


def _from_mapping(made: Mapping, name: str) -> ModelSpec:
    unknown = sorted(set(made) - _V2_KEYS)
    if unknown:
        raise ModelError(
            f"{name}() returned unknown keys {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(_V2_KEYS))}"
        )
    if "module" not in made:
        raise ModelError(f"{name}() returned a mapping without 'module'")
    args = made.get("example_args", ())
    kwargs = _given(made, "example_kwargs", {})
    if not isinstance(args, tuple) or not isinstance(kwargs, Mapping):
        raise ModelError(f"{name}(): 'example_args' must be a tuple and 'example_kwargs' a mapping")
    mode = made.get("export")
    if mode is not None and mode not in EXPORT_MODES:
        raise ModelError(f"{name}(): 'export' must be one of {EXPORT_MODES}, got {mode!r}")
    return ModelSpec(
        made["module"],
        args,
        dict(kwargs),
        steps=_calls(made["steps"], name) if made.get("steps") is not None else [],
        dynamic_shapes=made.get("dynamic_shapes"),
        export=mode,
    )


def _given(made: Mapping, key: str, default: Any) -> Any:
    """``made[key]``, or ``default`` when it is absent or None; never read for its truth
    value, which a tensor given in the wrong place does not have."""
    value = made.get(key)
    return default if value is None else value


def _calls(steps: Any, name: str) -> list[Call]:
    if not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)):
        raise ModelError(f"{name}(): steps must be a list of calls, got {type(steps).__name__}")
    if not steps:  # else the example, repeated, is decoded in place of the calls it meant
        raise ModelError(_NO_STEPS.format(name=name))
    return [as_call(step) for step in steps]


def export_program(
    module: torch.nn.Module,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    mode: str | None = None,
) -> Exported:
    """Export a copy of ``module`` under ``torch.no_grad()``: strict, else non-strict.

    ``mode`` forces one of :data:`EXPORT_MODES`. Raises :class:`ExportError` with the first
    line of each failure.
    """
    modes = [mode] if mode else list(EXPORT_MODES)
    failures = []
    rebound = rebound_buffers(module, args, kwargs or {})
    if mode == "non-strict":  # it writes a rebinding back
        rebound = []
    if rebound:
        dropped = (f"strict: forward reassigns the buffer(s) {', '.join(rebound)} "
                   "(self.x = ...), which strict export (TorchDynamo) drops as a side effect: "
                   "the program would never update them")
        if mode == "strict":
            raise ExportError(dropped + "; write them in place (self.x.copy_(...)) or export "
                              "non-strict, which writes them back")
        modes, failures = ["non-strict"], [dropped]
    for attempt in modes:
        try:
            program = _export(module, args, dict(kwargs or {}), dynamic_shapes, attempt)
        except Exception as e:  # noqa: BLE001 - every export failure is reported, one line each
            failures.append(f"{attempt}: {type(e).__name__}: {_first_line(e)}")
            continue
        note = f"exported {attempt} ({failures[0]})" if failures else ""
        return Exported(program, attempt, note)
    raise ExportError("; ".join(failures) + _export_hint(" ".join(failures)))


def _export_hint(failures: str) -> str:
    """What to change in the model for the export failures torch words for itself only."""
    if "extract specialized integer from data-dependent" in failures:
        # Not a branch: a tensor's value turned into a Python int, most often a KV cache
        # written at a 0-d position tensor (cache[:, pos] = k), which eager takes.
        return (" (forward turns a tensor's value into a Python int, which torch.export "
                "cannot capture: int(t), or a 0-d tensor as an index, as in cache[:, pos] = "
                "k; index with a 1-element tensor, pos = torch.tensor([i]), or write with "
                "cache.index_copy_(dim, pos, k))")
    if "data-dependent" in failures.lower():
        return (" (forward branches on a tensor's value, which torch.export cannot capture: "
                "write the branch with torch.cond, or compute both sides and pick with "
                "torch.where)")
    if "DynamicCache" in failures:
        return (" (the model returns Hugging Face's DynamicCache, which an exported program "
                "cannot: export it as HF's ExecuTorch recipe does, with a static cache "
                "(transformers.integrations.executorch.TorchExportableModuleWithStaticCache, "
                "as the tiny Llama factory in docs/main-job.md), or call it with "
                "use_cache=False)")
    return ""


def rebound_buffers(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]
                    ) -> list[str]:
    """The buffers ``forward`` rebinds (``self.acc = self.acc + x``) instead of writing in
    place, found by one call of a copy on the example. Strict export drops such a rebinding
    with only a warning, so its program silently keeps the initial value; non-strict
    export writes it back (``copy_``), which the passes handle.

    Raises:
        ModelError: the module cannot be copied (the job runs every program on its own
            copy), or ``forward`` raises on its example in eager: export may still trace
            such a call (a float64 input to a float32 layer), and the eager decode would
            then fail at its first call, after export.
    """
    try:
        probe = copy_program(module)
    except Exception as e:  # deepcopy raises whatever an attribute's pickling does
        raise ModelError(
            f"cannot copy {type(module).__name__} with copy.deepcopy ({type(e).__name__}: "
            f"{_first_line(e)}): the job runs every program on its own copy of the model; "
            "keep objects that cannot be copied (locks, open files) off the module") from e
    before = dict(probe.named_buffers())
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe(*copy.deepcopy(args), **copy.deepcopy(dict(kwargs)))
    except Exception as e:  # whatever forward raises is the model's to fix
        raise ModelError(
            f"{type(module).__name__}.forward raises on its example in eager, before export: "
            f"{type(e).__name__}: {_first_line(e)}{_dtype_hint(module, args, kwargs)}") from e
    # A rebinding to the value it had (a dtype or device conversion) loses nothing.
    return sorted(name for name, tensor in probe.named_buffers()
                  if name in before and tensor is not before[name]
                  and not _same_value(tensor, before[name]))


def _dtype_hint(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> str:
    """The example's floating inputs whose dtype no parameter of the module has (a float64
    or float16 example for a float32 model), as a hint; empty when there are none."""
    held = {t.dtype for t in module.parameters() if t.is_floating_point()}
    try:  # the inputs by forward's names
        named = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        named = {**{f"args[{i}]": arg for i, arg in enumerate(args)}, **kwargs}
    odd = [(name + torch.utils._pytree.keystr(path), value.dtype)
           for name, given in named.items()
           for path, value in torch.utils._pytree.tree_leaves_with_path(given)
           if isinstance(value, torch.Tensor) and value.is_floating_point()
           and held and value.dtype not in held]
    if not odd:
        return ""
    inputs = ", ".join(f"input {path!r} is {str(dtype).removeprefix('torch.')}"
                       for path, dtype in odd)
    kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in held))
    return f" ({inputs}; the model's parameters are {kinds}: give the example in that dtype)"


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def check_calls_fit(program: torch.export.ExportedProgram, calls: Sequence[tuple[str, Call]],
                    name: str) -> None:
    """Each call against the inputs the exported program takes, which its export example
    fixed: a call that fits ``forward`` but not the program (a keyword the example did not
    give, None for a tensor) otherwise fails the first decode making it, after the others.

    Raises:
        ModelError: naming the call, the program's inputs and the difference.
    """
    misfit = first_misfit(program, calls)
    if misfit:
        where, why = misfit
        raise ModelError(f"{name}(): {where} does not fit the exported program's inputs "
                         f"{signature_of(program)}: {why} (a program takes the inputs its "
                         "export example gave)")


def check_steps_within_state(programs: Mapping[str, torch.export.ExportedProgram],
                             calls: Sequence[MethodCall], name: str) -> None:
    """The calls ``(method, args, kwargs)``, in order over the methods' shared state (one
    program: ``{"forward": program}``), against the length of the state they write by
    position: more decode calls than a static cache holds fail here, naming the call and
    the cache, before a run in which eager or the exported program raises an IndexError at
    that call and ExecuTorch's runtime an untyped error 0x12.

    Raises:
        StatePastEndError: naming the call (``steps[16]``, with its method when there are
            several), the buffer, the position and the length.
    """
    several = len(programs) > 1
    check_writes_within_state(
        f"{name}()", programs,
        [(method, flat_user_inputs(programs[method], args, kwargs))
         for method, args, kwargs in calls],
        lambda step, method: f"steps[{step}]" + (f" ({method})" if several else ""))


def first_misfit(program: torch.export.ExportedProgram, calls: Sequence[tuple[str, Call]]
                 ) -> tuple[str, str] | None:
    """The first of ``calls`` (each named) ``program`` cannot take, and why; None if all fit:
    their structure (count, keywords), then each tensor's dtype and shape against what the
    program was exported for (torch's own check: static sizes, dynamic sizes in range),
    which otherwise fail at that call's decode, after the others (a guard, or an op
    refusing an int32 index)."""
    signature = signature_of(program)
    placeholders = {node.name: node for node in program.graph.find_nodes(op="placeholder")}
    user_inputs = [spec for spec in program.graph_signature.input_specs
                   if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    exported = [placeholders.get(getattr(spec.arg, "name", None)) for spec in user_inputs]
    # An input the example gave as None (or another constant) is baked into the program:
    # torch's own check lets a tensor through there, and the program ignores it.
    constant = [spec.arg if isinstance(spec.arg, torch.export.graph_signature.ConstantArgument)
                else None for spec in user_inputs]
    for where, (args, kwargs) in calls:
        why = signature.mismatch(args, kwargs) or _value_misfit(
            program, signature.positional, signature.leaves(args, kwargs), exported, constant)
        if why:
            return where, why
    return None


def _value_misfit(program: torch.export.ExportedProgram, positional: Sequence[str],
                  leaves: list[tuple[tuple, Any]], exported: list[Any],
                  constant: Sequence[Any] = ()) -> str | None:
    """Why the leaves of a call that fits the program's structure hold other tensors than
    it was exported for (dtype, shape), or None."""
    def label(path: tuple) -> str:
        top, key, *rest = path
        head = (positional[key.idx] if top.idx == 0 and key.idx < len(positional)
                else f"args[{key.idx}]" if top.idx == 0 else str(key.key))
        return head + torch.utils._pytree.keystr(tuple(rest))

    for (path, value), fixed in zip(leaves, constant, strict=False):
        if fixed is not None and isinstance(value, torch.Tensor):
            return (f"input {label(path)!r} is a tensor, the program was exported with "
                    f"{fixed.value!r} there, a constant it keeps and ignores a tensor for "
                    "(give the export example a tensor there)")
    for (path, value), node in zip(leaves, exported, strict=False):
        wanted = node.meta.get("val") if node is not None else None
        if isinstance(wanted, torch.Tensor) and not isinstance(value, torch.Tensor):
            return f"input {label(path)!r} {tensor_wanted(value)}"
        if isinstance(value, torch.Tensor) and isinstance(wanted, torch.Tensor) \
                and value.dtype != wanted.dtype:
            return (f"input {label(path)!r} is {str(value.dtype).removeprefix('torch.')}, the "
                    f"program was exported for {str(wanted.dtype).removeprefix('torch.')}")
    try:
        program._check_input_constraints(leaves)
    except RuntimeError as e:
        shapes = [f"input {label(path)!r} has shape {list(value.shape)}, the program was "
                  f"exported for [{', '.join(map(str, node.meta['val'].shape))}]"
                  for (path, value), node in zip(leaves, exported, strict=False)
                  if isinstance(value, torch.Tensor) and node is not None
                  and isinstance(node.meta.get("val"), torch.Tensor)
                  and list(value.shape) != list(node.meta["val"].shape)]
        if shapes:
            return (f"{'; '.join(shapes)} (a factory gives other shapes per call with "
                    "'dynamic_shapes')")
        return (f"{_first_line(e)} (a value that is no tensor is fixed at export: every "
                "call gives the example's)")
    return None


def _export(
    module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, mode: str
) -> torch.export.ExportedProgram:
    # A failing export prints its partial graph to stderr and logs warnings; the one-line
    # error says what the user needs, so both are held back.
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            return torch.export.export(
                copy_program(module),
                copy.deepcopy(args),
                copy.deepcopy(kwargs),
                dynamic_shapes=dynamic_shapes,
                strict=mode == "strict",
            )
    finally:
        logging.disable(logging.NOTSET)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


_V3_KEYS = {"module", "methods", "programs", "carried", "steps", "export"}
_METHOD_KEYS = {"example_args", "example_kwargs", "dynamic_shapes", "export"}


@dataclass
class MethodSpec:
    """How one method is exported: its example call, dynamic shapes and export mode."""

    example_args: tuple = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    dynamic_shapes: Any = None
    export: str | None = None

    @property
    def example(self) -> Call:
        return self.example_args, self.example_kwargs


MethodCall = tuple[str, tuple, dict]
"""One call of the deployment sequence: ``(method, args, kwargs)``."""


@dataclass
class MethodsSpec:
    """A model, its methods and the calls the deployment makes, in order."""

    module: torch.nn.Module
    methods: dict[str, MethodSpec]
    steps: list[MethodCall]
    programs: dict[str, torch.export.ExportedProgram] = field(default_factory=dict)
    """Methods exported by the factory (then ``methods`` holds empty specs)."""
    carried: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per method, ``InputsToBuffers`` options making its carried state resident."""

    @property
    def calls_by_method(self) -> dict[str, list[tuple[tuple, dict]]]:
        """Each method's own calls, in order (what quantizing it on its own calibrates on)."""
        found: dict[str, list[tuple[tuple, dict]]] = {name: [] for name in self.methods}
        for method, args, kwargs in self.steps:
            found[method].append((args, kwargs))
        return found


def is_methods_factory(made: Any) -> bool:
    """Whether a factory's result is contract v3 (a mapping naming ``methods`` or
    ``programs``)."""
    return isinstance(made, Mapping) and ("methods" in made or "programs" in made)


def methods_spec(made: Mapping, name: str, steps: int) -> MethodsSpec:
    """Read a v3 factory result; ``steps`` is how many calls to keep. ModelError otherwise."""
    unknown = sorted(set(made) - _V3_KEYS)
    if unknown:
        raise ModelError(f"{name}() returned unknown keys {', '.join(map(repr, unknown))} "
                         f"beside 'methods'; known: {', '.join(sorted(_V3_KEYS))}")
    module = made.get("module")
    if isinstance(module, torch.export.ExportedProgram):
        module = module.module()
    _check_module(module, name, " as 'module'")
    with contextlib.suppress(NotImplementedError):  # an ep.module() is inference form already
        module.eval()
    default_mode = _mode(made.get("export"), name, "'export'")
    if "programs" in made:
        return _given_programs(made, module, name, steps)
    methods = made["methods"]
    if not isinstance(methods, Mapping) or not methods:
        raise ModelError(f"{name}(): 'methods' must map method names to their export "
                         "examples, e.g. {'prefill': {'example_args': (...)}, 'decode': ...}")
    specs = {str(method): _method(method, entry, name, default_mode)
             for method, entry in methods.items()}
    given = made.get("steps")
    if given is not None and (not isinstance(given, Sequence) or isinstance(given, str)):
        raise ModelError(f"{name}(): 'steps' must be a list of (method, args[, kwargs]) calls")
    if given is not None and not given:
        raise ModelError(_NO_STEPS.format(name=name))
    calls = ([_step(step, index, specs, name) for index, step in enumerate(given)]
             if given else [(m, s.example_args, dict(s.example_kwargs))
                            for m, s in specs.items()])[:steps]
    # Every method calls forward.
    _check_calls(module, [*((f"methods[{m!r}]'s example", s.example) for m, s in specs.items()),
                          *((f"steps[{i}]", (args, kwargs))
                            for i, (_, args, kwargs) in enumerate(calls))], name)
    return MethodsSpec(module, specs, calls)


def _given_programs(made: Mapping, module: torch.nn.Module, name: str,
                    steps: int) -> MethodsSpec:
    """A v3 result naming ``programs`` (already exported) and maybe ``carried``."""
    if "methods" in made:
        raise ModelError(f"{name}() returned both 'methods' (how to export) and 'programs' "
                         "(already exported): give one")
    programs = made["programs"]
    if (not isinstance(programs, Mapping) or not programs or not all(
            isinstance(p, torch.export.ExportedProgram) for p in programs.values())):
        raise ModelError(f"{name}(): 'programs' must map method names to ExportedPrograms")
    carried = _given(made, "carried", {})
    if not isinstance(carried, Mapping) or not all(
            isinstance(o, Mapping) for o in carried.values()):
        raise ModelError(f"{name}(): 'carried' must map method names to InputsToBuffers "
                         "options (mappings)")
    unknown = sorted(set(carried) - set(programs))
    if unknown:
        raise ModelError(f"{name}(): 'carried' names {', '.join(map(repr, unknown))}, not "
                         f"among the programs ({', '.join(map(repr, programs))})")
    given = made.get("steps")
    if not isinstance(given, Sequence) or isinstance(given, str) or not given:
        raise ModelError(f"{name}(): with 'programs', 'steps' must list the calls "
                         "(method, args[, kwargs]) in deployment order")
    specs = {str(method): MethodSpec() for method in programs}
    calls = [_step(step, index, specs, name) for index, step in enumerate(given)]
    return MethodsSpec(module, specs, calls[:steps], dict(programs),
                       {m: dict(o) for m, o in carried.items()})


def export_methods(spec: MethodsSpec, mode: str | None = None) -> dict[str, Exported]:
    """Export every method of ``spec`` as :func:`~passes.flow.factory.export_program` does;
    ``mode`` forces an export mode for all of them. ModelError names the failing method.
    Methods the factory gave already exported (``programs``) are copied, not exported."""
    if spec.programs:
        return {method: Exported(copy_program(program), "by the factory")
                for method, program in spec.programs.items()}
    exported = {}
    for method, entry in spec.methods.items():
        try:
            exported[method] = export_program(
                spec.module, entry.example_args, entry.example_kwargs,
                dynamic_shapes=entry.dynamic_shapes, mode=mode or entry.export)
        except ExportError as e:
            raise ModelError(f"method {method!r} is not exportable: {e}") from e
        except ModelError as e:  # found before export: the module fails on this example
            raise ModelError(f"method {method!r}: {e}") from e
    return exported


def _mode(mode: Any, name: str, where: str) -> str | None:
    if mode is not None and mode not in EXPORT_MODES:
        raise ModelError(f"{name}(): {where} must be one of {EXPORT_MODES}, got {mode!r}")
    return mode


def _method(method: Any, entry: Any, name: str, default_mode: str | None) -> MethodSpec:
    where = f"methods[{method!r}]"
    if not isinstance(entry, Mapping):
        raise ModelError(f"{name}(): {where} must be a mapping with 'example_args' and/or "
                         f"'example_kwargs', got {type(entry).__name__}")
    unknown = sorted(set(entry) - _METHOD_KEYS)
    if unknown:
        raise ModelError(f"{name}(): {where} has unknown keys {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(_METHOD_KEYS))}")
    args, kwargs = entry.get("example_args", ()), _given(entry, "example_kwargs", {})
    if not isinstance(args, tuple) or not isinstance(kwargs, Mapping):
        raise ModelError(f"{name}(): {where}: 'example_args' must be a tuple and "
                         "'example_kwargs' a mapping")
    mode = _mode(entry.get("export"), name, f"{where}['export']") or default_mode
    return MethodSpec(args, dict(kwargs), entry.get("dynamic_shapes"), mode)


def _step(step: Any, index: int, methods: Mapping[str, MethodSpec], name: str) -> MethodCall:
    where = f"{name}(): steps[{index}]"
    if not isinstance(step, (tuple, list)) or len(step) not in (2, 3):
        raise ModelError(f"{where} must be (method, args), (method, args, kwargs) or "
                         f"(method, kwargs), got {type(step).__name__}")
    method = step[0]
    if method not in methods:
        raise ModelError(f"{where} calls {method!r}, which is not one of the methods "
                         f"({', '.join(map(repr, methods))})")
    inputs = step[1] if len(step) == 2 else (step[1], step[2])
    if len(step) == 3 and not (isinstance(step[1], tuple) and isinstance(step[2], Mapping)):
        raise ModelError(f"{where}: (method, args, kwargs) needs a tuple and a mapping")
    args, kwargs = as_call(inputs)
    return method, tuple(args), dict(kwargs)
