"""pt2e quantization of programs with mutable buffers: :func:`quantize_program`,
:func:`quantize_methods` for the methods of one model sharing its state, and the
:class:`PassQuantizer` both are built on.

In one call, an ExportedProgram in and an ExportedProgram out::

    quantized = quantize_program(ep, XNNPACKQuantizer().set_global(config), calibration_data)

and the methods of one model (a prefill and a decode sharing a KV cache), calibrated along
the deployment's calls over one state, each shared buffer on one grid::

    methods = quantize_methods({"prefill": ep4, "decode": ep1}, quantizer,
                               [("prefill", (x4, pos4)), ("decode", (x1, pos1)), ...])


The flow, with torchao's ``prepare_pt2e`` / ``convert_pt2e``::

    gm = torch.export.export(model, example_inputs).module()
    quantizer = PassQuantizer(
        XNNPACKQuantizer().set_global(config),
        # in transform_for_annotation; functional, so convert_pt2e sees the write-backs
        transform=[MarkMutableBuffers(), InplaceToFunctional()],
        after_annotate=[SkipAnnotateDataMovementOps()],  # after the quantizer's annotate
    )
    prepared = prepare_pt2e(gm, quantizer)
    for args in calibration_data:
        prepared(*args)
    reset_mutable_buffers(prepared)          # calibration leaves its state in the buffers
    converted = convert_pt2e(prepared, fold_quantize=True)
    converted = PassManager([UnfreezeMutableBuffer()]).run(converted).program

``reset_mutable_buffers`` is the step after calibration: without it the converted program
starts from whatever the last calibration batch left in a KV cache or an accumulator.
:func:`quantize_program` runs those steps and lifts the result back into an ExportedProgram
(:func:`passes.exported_program_from`), where re-exporting it would trace it again.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule
from torchao.quantization.pt2e.quantizer import Quantizer

from pass_manager import PassManager, Report

from ._analysis.buffer_reads import record_observed_reads
from ._analysis.marked_state import reset_mutable_buffers
from ._analysis.non_finite_observations import NON_FINITE_MEANING, non_finite_observations
from ._carried.pairs import method_pairing, pairs_of
from ._lifting import exported_program_from
from ._methods.calibration import (
    calibration_calls,
    callers_state_restored,
    check_calibration_call,
    run_calibration_call,
)
from ._methods.calls import (
    PairedState,
    QuantizedMethods,
    carried_inputs,
    check_write_backs,
    mark_state_of_other_methods,
    method_calls,
    reads_kept_live,
    share_buffer_tensors,
)
from ._methods.joint_storage import kept_float
from ._methods.observers import buffer_observers, share_observers
from ._methods.shared_buffers import (
    check_shared_buffers,
    parameter_difference,
    written_by_any_method,
)
from .errors import (
    CalibrationInputError,
    CarriedStateWarning,
    QuantizationFlowError,
    QuantizationInputError,
)
from .inplace_to_functional import InplaceToFunctional
from .mark_mutable_buffers import MarkMutableBuffers
from .quantize_mutable_buffers import QuantizeMutableBuffers
from .skip_annotate_data_movement_ops import SkipAnnotateDataMovementOps
from .unfreeze_mutable_buffer import UnfreezeMutableBuffer

__all__ = [
    "PassQuantizer",
    "QuantizationFlowError",
    "QuantizationReport",
    "QuantizedMethods",
    "QuantizedProgram",
    "quantize_methods",
    "quantize_program",
]


class PassQuantizer(Quantizer):
    """A torchao ``Quantizer`` that runs pass pipelines around another quantizer.

    ``transform_for_annotation`` runs the wrapped quantizer's own transform, drops the
    conversions that convert nothing (:func:`no_op_conversions_dropped`), then runs the
    ``transform`` passes; ``annotate`` runs the wrapped ``annotate``, takes back what it
    annotated on integer and bool values (:func:`integer_annotations_dropped`; listed in
    :attr:`dropped_annotations`), then runs the ``after_annotate`` passes (each list is
    one :class:`pass_manager.PassManager`, so its conditions are checked and a failing
    pass is rolled back). ``validate`` and the observer callback delegate to the wrapped
    quantizer. The callback also records, on
    each mutable buffer's node, the observers that watch a read of it, so that
    ``UnfreezeMutableBuffer`` knows exactly which frozen constant stands for which buffer.

    Args:
        quantizer: any torchao pt2e ``Quantizer``.
        transform: passes run before annotation (e.g. ``MarkMutableBuffers()``).
        after_annotate: passes run after annotation (e.g. ``SkipAnnotateDataMovementOps()``);
            they must edit the graph module in place, since ``prepare_pt2e`` ignores what
            ``annotate`` returns.

    The run reports of both pipelines are kept in :attr:`reports`.
    """

    def __init__(
        self,
        quantizer: Quantizer,
        transform: Sequence[Any] = (),
        after_annotate: Sequence[Any] = (),
        **options: Any,
    ):
        super().__init__()
        self.quantizer = checked_quantizer(quantizer, "PassQuantizer")
        # ``options`` are PassManager options for both pipelines (e.g. strict,
        # instruments=[PrintIR(after=True)]).
        self.transform = (
            PassManager(list(transform), name="transform", **options) if transform else None
        )
        self.after_annotate = (
            PassManager(list(after_annotate), name="after_annotate", **options)
            if after_annotate else None
        )
        self.reports: list[Report] = []
        self.dropped_annotations: list[str] = []

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        model = self.quantizer.transform_for_annotation(model)
        integer_constants_kept_integer(model)
        integer_results_restored(model)
        no_op_conversions_dropped(model)
        if self.transform is None:
            return model
        result = self.transform.run(model)
        self.reports.append(result.report)
        return result.program

    def annotate(self, model: GraphModule) -> GraphModule:
        annotated = self.quantizer.annotate(model)
        if annotated is not None and annotated is not model:
            raise QuantizationFlowError(
                f"{type(self.quantizer).__name__}.annotate returned a new graph module; "
                "prepare_pt2e only keeps annotations made in place",
                pass_name=type(self).__name__,
            )
        self.dropped_annotations = integer_annotations_dropped(model)
        if self.after_annotate is not None:
            result = self.after_annotate.run(model)
            self.reports.append(result.report)
            if result.program is not model:
                raise QuantizationFlowError(
                    "an after_annotate pass returned a new graph module; prepare_pt2e only "
                    "keeps annotations made in place",
                    pass_name=type(self).__name__,
                )
        return model

    def validate(self, model: GraphModule) -> None:
        self.quantizer.validate(model)

    def prepare_obs_or_fq_callback(
        self, model: GraphModule, edge_or_node_to_obs_or_fq: dict
    ) -> None:
        self.quantizer.prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)
        record_observed_reads(model, edge_or_node_to_obs_or_fq)

    def __repr__(self) -> str:
        return f"PassQuantizer({type(self.quantizer).__name__})"


_CONVERSIONS = frozenset({torch.ops.aten.to.dtype, torch.ops.aten.to.device,
                          torch.ops.aten.to.dtype_layout})


def no_op_conversions_dropped(model: GraphModule) -> list[str]:
    """Drop each ``.to(...)`` that converts nothing (``x.to(torch.float32)`` of a float32
    ``x``, as Hugging Face's models write): ``Tensor.to`` returns its very input then, so
    its users read the input instead, exactly. Returns the nodes dropped.

    A quantizer annotates such a node as any op: ``QnnQuantizer`` observes its output on a
    grid of its own, one more rounding than torchao's recipe makes, whose
    ``run_decompositions`` removes the node (a tiny GPT-2's later decode steps were up to
    3x further from eager). A conversion the program returns is kept (a returned input
    would be a pass-through output), and so is one that copies or sets a memory format.
    """
    dropped = []
    for node in list(model.graph.nodes):
        if node.op != "call_function" or node.target not in _CONVERSIONS:
            continue
        names = [argument.name for argument in node.target._schema.arguments]
        given = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
        source, before, after = given.get("self"), None, node.meta.get("val")
        if isinstance(source, torch.fx.Node):
            before = source.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
            continue
        if given.get("copy") or given.get("memory_format") not in (None, torch.preserve_format):
            continue
        if (before.dtype, before.device, before.layout) != (after.dtype, after.device,
                                                           after.layout):
            continue
        if any(user.op == "output" for user in node.users):
            continue
        node.replace_all_uses_with(source)
        model.graph.erase_node(node)
        dropped.append(node.name)
    if dropped:
        model.recompile()
    return dropped


def integer_constants_kept_integer(model: GraphModule) -> list[str]:
    """Give back their integer dtype to the constants of integer arithmetic that a
    quantizer's ``transform_for_annotation`` made float; returns the nodes changed.

    XNNPACK's quantizers (torchao's and ExecuTorch's ``_convert_scalars_to_attrs``) turn
    every scalar argument of ``add`` / ``mul`` into a float32 tensor constant, also on an
    integer tensor: a counter's ``add(pos, 1)`` becomes ``add(pos, tensor(1.))``, which
    promotes to float in Python and makes ExecuTorch's runtime fail a dtype check
    (``dtype={Float, Long}``) on every call. A node whose traced result (``meta["val"]``,
    from before the transform) is an integer keeps integer operands: each 0-d float
    constant it reads (a ``get_attr`` read by it alone) whose value the integer dtype holds
    exactly becomes that dtype. Other constants are left as the quantizer made them.
    """
    changed = []
    for node in model.graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor) or \
                value.dtype.is_floating_point or value.dtype.is_complex or \
                value.dtype == torch.bool:
            continue
        for arg in node.args:
            if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr" or len(arg.users) != 1:
                continue
            constant = getattr(model, arg.target, None) if "." not in arg.target else None
            if not isinstance(constant, torch.Tensor) or constant.dim() != 0 or \
                    not constant.is_floating_point():
                continue
            integer = constant.to(value.dtype)
            if not torch.equal(integer.to(constant.dtype), constant):
                continue
            if arg.target in model._buffers:
                model.register_buffer(arg.target, integer)
            else:
                setattr(model, arg.target, integer)
            fake = arg.meta.get("val")
            mode = getattr(fake, "fake_mode", None)
            arg.meta["val"] = mode.from_tensor(integer, static_shapes=True) \
                if mode is not None else integer
            changed.append(node.name)
    return changed


# Set on a node computing, in floating point, what the program computed as integers (see
# integer_results_restored): its value is integer arithmetic, never quantized.
INTEGER_ARITHMETIC_META = "integer_arithmetic"


def integer_results_restored(model: GraphModule) -> list[str]:
    """Give back their integer dtype to integer values a quantizer's
    ``transform_for_annotation`` now computes in floating point; returns the casts added.

    ``QnnQuantizer``'s ``DecomposeRemainder`` rewrites every ``remainder`` as
    ``x - floor(x / y) * y`` and keeps the integer fake values the remainder had: on a
    ring buffer's position (``pos % slots``) ``div.Tensor`` of two integers divides truly,
    so the chain computes a float position, and the cache write indexed by it failed in
    the first calibration call (``index_copy_(): Expected a long tensor for index``). Each
    node reading such a value is run on its inputs' actual fake values: one whose recorded
    value is an integer but which computes a float is integer arithmetic done in floating
    point (exact below 2**24), keeps its float value and is marked
    :data:`INTEGER_ARITHMETIC_META` (never quantized: :func:`integer_annotations_dropped`);
    any other node reading such a value (the cache write, the output) reads it cast back
    to its recorded dtype, as the program was traced.
    """
    import operator

    from ._analysis.fake_values import graph_fake_mode

    mode = graph_fake_mode(model.graph)
    if mode is None:
        return []
    actual: dict[torch.fx.Node, torch.Tensor] = {}  # values that are not what was recorded

    def integer(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point \
            and not value.dtype.is_complex

    def value_of(node: torch.fx.Node) -> Any:
        return actual.get(node, node.meta.get("val"))

    casts: list[str] = []
    for node in list(model.graph.nodes):
        recorded = node.meta.get("val")
        if node.op == "get_attr":
            try:
                tensor = operator.attrgetter(node.target)(model)
            except AttributeError:
                continue
            if isinstance(tensor, torch.Tensor) and isinstance(recorded, torch.Tensor) and \
                    tensor.dtype != recorded.dtype:
                actual[node] = mode.from_tensor(tensor, static_shapes=True)
            continue
        floats = [arg for arg in node.all_input_nodes
                  if arg in actual and integer(arg.meta.get("val"))
                  and actual[arg].dtype.is_floating_point]
        if not floats and not (integer(recorded) and node.op == "call_function"):
            continue  # an integer result may be a float one now (a true division)
        result = None
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value_of)
            try:
                with mode:
                    result = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - the op refuses the float value: cast it back
                result = None
        if isinstance(result, torch.Tensor) and integer(recorded) and \
                result.dtype.is_floating_point:
            actual[node] = result  # more integer arithmetic in floating point
            continue
        for arg in floats:  # any other reader reads the integers it was traced with
            with model.graph.inserting_before(node):
                cast = model.graph.call_function(
                    torch.ops.aten._to_copy.default, (arg,),
                    {"dtype": arg.meta["val"].dtype})
            cast.meta["val"] = arg.meta["val"]
            node.replace_input_with(arg, cast)
            casts.append(f"{arg.name} -> {node.name}")
    for node, value in actual.items():
        if node.op == "call_function":
            node.meta["val"] = value
            node.meta[INTEGER_ARITHMETIC_META] = True
    if casts:
        model.recompile()
    return casts


def integer_annotations_dropped(model: GraphModule) -> list[str]:
    """Take back what a quantizer annotated on integer and bool values; returns one line
    per value, ``"<node>"`` for an output, ``"<input> -> <node>"`` for an input.

    pt2e quantizes floating-point values only; a quantizer annotating an op whatever its
    dtypes (ExecuTorch's ``CoreMLQuantizer`` annotates every ``add``, an int64 step
    counter's ``step += 1`` and ``arange + offset`` included) would otherwise give an
    integer value an observer, which fails inside the first calibration call or inside
    ``convert_pt2e``. An integer value stays exactly what it was, unquantized, as
    ``prepare_pt2e`` leaves any value no one annotated; the float values around it keep
    their annotations. A spec sharing or deriving its grid from a dropped one is dropped
    with it (a grid of an integer value does not exist).
    """
    from torchao.quantization.pt2e.quantizer import (
        DerivedQuantizationSpec,
        SharedQuantizationSpec,
    )

    def integer(node: Any) -> bool:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(node, torch.fx.Node) and node.meta.get(INTEGER_ARITHMETIC_META):
            return True
        return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point \
            and not value.dtype.is_complex

    dropped_edges: set[Any] = set()  # (input, node) edges and nodes whose spec is gone
    dropped: list[str] = []

    def refers_to_dropped(spec: Any) -> bool:
        if isinstance(spec, SharedQuantizationSpec):
            return spec.edge_or_node in dropped_edges
        if isinstance(spec, DerivedQuantizationSpec):
            return any(source in dropped_edges for source in spec.derived_from)
        return False

    changed = True
    while changed:
        changed = False
        for node in model.graph.nodes:
            annotation = node.meta.get("quantization_annotation")
            if annotation is None:
                continue
            for arg, spec in list(annotation.input_qspec_map.items()):
                if spec is not None and (integer(arg) or refers_to_dropped(spec)):
                    del annotation.input_qspec_map[arg]
                    dropped_edges.add((arg, node))
                    dropped.append(f"{arg.name} -> {node.name}")
                    changed = True
            spec = annotation.output_qspec
            if spec is not None and (integer(node) or refers_to_dropped(spec)):
                annotation.output_qspec = None
                dropped_edges.add(node)
                dropped.append(node.name)
                changed = True
    return dropped


def checked_quantizer(quantizer: Any, helper: str) -> Quantizer:
    """``quantizer`` when it is a torchao pt2e ``Quantizer``; else a
    :class:`QuantizationInputError` naming ``helper``'s ``quantizer`` argument, what was
    given and what to pass instead."""
    if isinstance(quantizer, Quantizer):
        return quantizer
    given = f"{type(quantizer).__name__} {quantizer!r:.80}"
    hint = "pass a torchao pt2e Quantizer instance, e.g. passes.examples.xnnpack_quantizer()"
    if isinstance(quantizer, type) and issubclass(quantizer, Quantizer):
        given = f"the class {quantizer.__name__}"
        hint = f"pass an instance: {quantizer.__name__}() (configured, e.g. .set_global(...))"
    elif callable(quantizer) and _returns_quantizer(quantizer):
        name = getattr(quantizer, "__name__", "it")
        given = f"the function {name}"
        hint = f"call it: {name}() returns the Quantizer"
    elif isinstance(quantizer, str):
        hint = ("quantizers are not looked up by name; "
                f"pass an instance, e.g. passes.examples.xnnpack_quantizer(){_named(quantizer)}")
    elif _is_torchao_config(quantizer):
        hint = (f"{type(quantizer).__name__} is a torchao config for quantize_() on an "
                "eager module, not a pt2e Quantizer; pass a Quantizer such as "
                "passes.examples.xnnpack_quantizer()")
    raise QuantizationInputError(helper, "quantizer", f"is {given}, not a torchao pt2e "
                                 f"Quantizer: {hint}")


def _returns_quantizer(function: Callable[..., Any]) -> bool:
    """Whether ``function``'s return annotation is a Quantizer (read, not called)."""
    import inspect
    import typing

    try:
        returned = typing.get_type_hints(function).get("return")
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to their text
        try:
            returned = inspect.signature(function).return_annotation
        except (TypeError, ValueError):
            return False
    if isinstance(returned, type):
        return issubclass(returned, Quantizer)
    return isinstance(returned, str) and returned.split(".")[-1].endswith("Quantizer")


def _named(name: str) -> str:
    return " for XNNPACK" if "xnnpack" in name.lower() else ""


def _is_torchao_config(value: Any) -> bool:
    try:
        from torchao.core.config import AOBaseConfig
    except ImportError:  # pragma: no cover - torchao without the config base class
        return False
    return isinstance(value, AOBaseConfig)


@dataclass
class QuantizationReport:
    """What :func:`quantize_program` did, stage by stage (``return_report=True``).

    Attributes:
        passes: each pipeline's PassManager report by stage: ``"before annotation"``
            (MarkMutableBuffers, InplaceToFunctional), ``"after annotation"``
            (SkipAnnotateDataMovementOps), ``"after convert"`` (UnfreezeMutableBuffer).
        reset_buffers: the FQNs ``reset_mutable_buffers`` put back after calibration.
        repaired_reads: one line per frozen buffer read UnfreezeMutableBuffer made live.
        non_finite_reads: one line per quantized value that held inf or NaN during
            calibration (an attention mask of -inf): quantized, it reads a finite value;
            or a value at +-65504 or beyond (a ``torch.finfo(torch.float32).min`` mask,
            ``-1e9``): its grid's step is so large that the tensor's other values read 0;
            or a smaller value stretching its grid as far for the values it saw (scores
            plus a ``-10000`` mask on an 8-bit grid: the scores within 0.1 of a step), see
            :func:`passes._analysis.non_finite_observations.stretched_grid`.
        seconds: wall time per step: prepare, calibrate, reset, convert, unfreeze, lift.
    """

    passes: list[tuple[str, Report]] = field(default_factory=list)
    reset_buffers: list[str] = field(default_factory=list)
    repaired_reads: list[str] = field(default_factory=list)
    non_finite_reads: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> list[str]:
        """A few lines for a person: the steps' times, the reset buffers, the repaired reads."""
        steps = ", ".join(f"{step} {s * 1e3:.0f} ms" for step, s in self.seconds.items())
        lines = [f"steps: {steps}"]
        reset = ", ".join(self.reset_buffers) or "none"
        lines.append(f"reset after calibration ({len(self.reset_buffers)}): {reset}")
        lines.append(f"frozen buffer reads repaired: {len(self.repaired_reads) or 'none'}")
        lines += [f"  {read}" for read in self.repaired_reads]
        if self.non_finite_reads:
            lines.append(f"quantized values holding inf or NaN in calibration (or +-65504 "
                         f"and beyond, or stretching their grid): "
                         f"{len(self.non_finite_reads)} ({NON_FINITE_MEANING})")
        return lines + [f"  {read}" for read in self.non_finite_reads]

    def __str__(self) -> str:
        """``print(report)`` gives :meth:`summary`'s lines, then each stage's pass table."""
        tables = [f"{stage}:\n{report.table()}" for stage, report in self.passes]
        return "\n".join([*self.summary(), *tables])

    def to_dict(self) -> dict[str, Any]:
        return {
            "passes": {stage: report.to_dict() for stage, report in self.passes},
            "reset_buffers": list(self.reset_buffers),
            "repaired_reads": list(self.repaired_reads),
            "non_finite_reads": list(self.non_finite_reads),
            "seconds": dict(self.seconds),
        }


class QuantizedProgram(NamedTuple):
    """:func:`quantize_program`'s result with ``return_report=True``."""

    program: ExportedProgram
    report: QuantizationReport


def quantize_program(
    program: ExportedProgram,
    quantizer: Quantizer,
    calibration: Iterable[Any],
    *,
    fold: bool = True,
    return_report: bool = False,
    on_call: Callable[[int], None] | None = None,
    **options: Any,
) -> ExportedProgram | QuantizedProgram:
    """Quantize an ExportedProgram with pt2e and give back an ExportedProgram, state intact.

    The steps: ``prepare_pt2e`` of ``program.module()`` with ``quantizer`` wrapped in a
    :class:`PassQuantizer` (MarkMutableBuffers and InplaceToFunctional before annotation,
    so a program straight from ``torch.export.export`` is functional by then;
    SkipAnnotateDataMovementOps after it), one call per calibration entry,
    :func:`~passes.reset_mutable_buffers`, ``convert_pt2e(fold_quantize=fold)``,
    :class:`~passes.UnfreezeMutableBuffer`, and :func:`~passes.exported_program_from`
    with ``like=program`` instead of a re-export. Each mutable buffer's update is a
    ``BUFFER_MUTATION`` output of the result. (torchao sees a functional program's
    write-backs and does not fold the reads of those buffers; UnfreezeMutableBuffer undoes
    any fold it still makes.)

    Args:
        program: the exported program (functional or not).
        quantizer: a torchao pt2e ``Quantizer``.
        calibration: one entry per calibration call: an argument tuple, an
            ``(args, kwargs)`` pair or a mapping of keyword arguments.
        fold: constant-fold the quantized weights (torchao's ``fold_quantize``); the
            folded reads of mutable buffers are made live again either way.
        return_report: also return a :class:`QuantizationReport` (the pipelines'
            reports, the buffers reset, the frozen reads repaired, each step's time), as
            ``(program, report)``.
        on_call: called with the call's index after each calibration call (progress).
        **options: PassManager options for the pipelines it runs (``strict``,
            ``instruments=[PrintIR(after=True)]``, ...), as :class:`PassQuantizer` takes
            them.

    Raises:
        QuantizationInputError: ``program`` not an ExportedProgram, ``quantizer`` not a
            Quantizer (the message says what to pass, e.g. "call xnnpack_quantizer()"), no
            calibration call, ``calibration`` no sequence of calls (``None``, a tensor, one
            call's argument tuple ``(x, pos)``), or a value the quantizer observes of a
            dtype pt2e cannot quantize (float64: the message names it; found before
            calibration; what a quantizer annotates on integer and bool values is dropped,
            they stay unquantized, see :func:`integer_annotations_dropped`); its
            :class:`~passes.errors.CalibrationInputError` names the
            call and the input when a call does not fit the program (a keyword naming no
            input, another structure, no tensor for a tensor input: "pass a torch.Tensor" for
            a numpy array, another dtype, a static size, another number than one the program
            was specialized to: checked before anything is prepared) or the prepared program
            raises on it (the original error chained).
        QuantizationFlowError: ``convert_pt2e`` raised an ``AssertionError`` computing a
            grid after an observer saw inf or NaN (a moving-average observer's range turns
            NaN: ``QnnQuantizer`` on a -inf mask kept as state), naming the values.

    The result shares the program's buffer tensors (as ``program.module()`` does): the
    calibration writes them and the reset puts back, bit for bit, the values they had (or,
    on a program MarkMutableBuffers marked before, the values it saw then). State the
    program carries in inputs it writes in place (the caller's cache or position) is
    threaded through the calibration calls passing one tensor, and each such tensor is put
    back afterwards to what it held before them. Copy the
    program first (``pass_manager.validation.copy_program``) to keep the two apart.

    Example:
        >>> quantized = quantize_program(ep, xnnpack_quantizer(), [(x, pos) for ...])
        >>> quantized.graph_signature.buffers_to_mutate
        {'index_copy_default': 'layers.0.attn.k_cache', ...}
    """
    if not isinstance(program, ExportedProgram):
        raise QuantizationInputError("quantize_program", "program", "quantize_program takes an "
                                     f"ExportedProgram, got {type(program).__name__}")
    checked_quantizer(quantizer, "quantize_program")
    calls = calibration_calls(program, calibration, "quantize_program")
    for index, (args, kwargs) in enumerate(calls):
        check_calibration_call(program, args, kwargs, "quantize_program", index)
    report = QuantizationReport()
    clock = [time.perf_counter()]

    def timed(step: str) -> None:
        now = time.perf_counter()
        report.seconds[step] = now - clock[0]
        clock[0] = now

    wrapped = _flow_quantizer(quantizer, PassQuantizer, **options)
    prepared = _prepare(program, wrapped, "quantize_program")
    timed("prepare")
    where = ["calibration[0]"]
    with torch.no_grad(), callers_state_restored(
            {"forward": program}, [("forward", *call) for call in calls]), \
            non_finite_observations(prepared, where) as non_finite:
        try:
            for index, (args, kwargs) in enumerate(calls):
                where[0] = f"calibration[{index}]"
                run_calibration_call(prepared, args, kwargs, "quantize_program", index)
                if on_call is not None:
                    on_call(index)
        except CalibrationInputError as error:
            _reset(prepared)  # the program's buffers as they were given
            _raise_for_non_finite(error, non_finite, "quantize_program")
            raise
    timed("calibrate")
    report.non_finite_reads = non_finite
    if non_finite and not return_report:  # else the report says so
        warnings.warn(f"quantize_program: {'; '.join(non_finite)}: {NON_FINITE_MEANING}",
                      stacklevel=2)
    report.reset_buffers = _reset(prepared)
    timed("reset")
    with _convert_refusing_non_finite(non_finite, "quantize_program"):
        lifted, unfrozen = _convert(prepared, program, fold, timed, **options)
    if not return_report:
        return lifted
    report.passes = [*zip(("before annotation", "after annotation"), wrapped.reports,
                          strict=True), ("after convert", unfrozen)]
    report.repaired_reads = [note for record in unfrozen.records for note in record.notes]
    return QuantizedProgram(lifted, report)


def _raise_for_non_finite(error: CalibrationInputError, non_finite: list[str],
                          helper: str) -> None:
    """A calibration call that failed in an observer after a value beyond any grid was
    recorded (an observer refusing an inf) is that value's error, naming it."""
    if non_finite and error.__cause__ is not None:
        raise CalibrationInputError(
            helper, error.step, f"{non_finite[-1]} ({NON_FINITE_MEANING}); its observer "
            f"then raised: {error.reason.split('raised ', 1)[-1]}", method=error.method,
        ) from error


@contextmanager
def _convert_refusing_non_finite(non_finite: list[str], helper: str) -> Iterator[None]:
    """torchao's ``AssertionError`` checking an observer's range, after calibration saw a
    value beyond any grid, is a :class:`QuantizationFlowError` naming those values."""
    try:
        yield
    except AssertionError as error:
        if not non_finite:
            raise
        raise QuantizationFlowError(
            f"convert_pt2e could not compute a grid after calibration: "
            f"{'; '.join(non_finite)} ({NON_FINITE_MEANING}); torchao then raised "
            f"AssertionError: {str(error).strip()[:120]}: leave the value unquantized up "
            "to the op that bounds it (a softmax), as passes.flow.examples."
            "AnnotateEveryOpQuantizer does",
            pass_name=helper) from error


def _reset(prepared: Any) -> list[str]:
    """:func:`~passes.reset_mutable_buffers` after calibration, whose caller's tensors
    :func:`callers_state_restored` puts back: its warning that it cannot reset them does
    not apply."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CarriedStateWarning)
        return reset_mutable_buffers(prepared)


def _flow_quantizer(quantizer: Quantizer, wrapper: Callable[..., PassQuantizer],
                    **options: Any) -> PassQuantizer:
    """``quantizer`` wrapped as the flow quantizes: functional state before annotation,
    buffers observed through what is written into them after it."""
    return wrapper(
        quantizer,
        transform=[MarkMutableBuffers(), InplaceToFunctional()],
        after_annotate=[SkipAnnotateDataMovementOps()],
        **options,
    )


# pt2e's quantize ops take float32 (float16 and bfloat16 they convert first): anything else
# observed calibrates, then fails inside convert_pt2e with an untyped AssertionError (or,
# for an integer value under a fake-quantize, inside the first calibration call).
_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)


def _prepare(program: ExportedProgram, wrapped: PassQuantizer, helper: str,
             argument: str = "program") -> GraphModule:
    """prepare_pt2e on ``program``'s module; a value observed in a dtype pt2e's quantize ops
    cannot take is a QuantizationInputError of ``helper`` naming ``argument`` (the method's
    entry of ``programs``), before any calibration call."""
    from torchao.quantization.pt2e.observer import _is_activation_post_process
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    prepared = prepare_pt2e(program.module(), wrapped)
    for node in prepared.graph.find_nodes(op="call_module"):
        if not (_is_activation_post_process(prepared.get_submodule(node.target))
                and isinstance(node.args[0], torch.fx.Node)):
            continue
        value = node.args[0].meta.get("val")
        dtype = getattr(value, "dtype", None)
        if dtype is None or dtype in _QUANTIZABLE:
            continue
        said = (f"the quantizer observes {node.args[0].name!r}, of dtype {dtype}, which "
                "pt2e's quantize ops cannot take (float32, float16 or bfloat16)")
        if dtype.is_floating_point:
            raise QuantizationInputError(
                helper, argument, f"{said}: convert the model with .float() before export",
                node=node.args[0].name)
        # An integer (or bool) value: a quantizer annotating an op whatever its dtype
        # (CoreMLQuantizer's add, on a position counter) fails inside the first calibration
        # call with a fake-quantize, or inside convert with an observer.
        readers = ", ".join(sorted({user.name for user in node.users})) or "the output"
        raise QuantizationInputError(
            helper, argument, f"{said}, as an input of {readers}: pt2e does not quantize "
            "integer values (a position counter, index arithmetic), and this quantizer "
            "annotated that op whatever its dtypes; use one that annotates floating-point "
            "values only, or leave that op out of its configuration", node=node.args[0].name)
    return prepared


def _convert(prepared: GraphModule, like: ExportedProgram, fold: bool,
             timed: Callable[[str], None] = lambda step: None,
             read_only_state: frozenset[str] = frozenset(), **options: Any,
             ) -> tuple[ExportedProgram, Report]:
    """convert_pt2e (the reads of ``read_only_state``, buffers other methods write, kept
    from its constant folding), UnfreezeMutableBuffer (its report returned) and the lift;
    ``timed`` is told when each step ends."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    with reads_kept_live(prepared, read_only_state) as give_back_parameters:
        converted = give_back_parameters(convert_pt2e(prepared, fold_quantize=fold))
    _resolve_overload_packets(converted)
    _dequantize_lossless(converted)
    timed("convert")
    unfrozen = PassManager([UnfreezeMutableBuffer()], **options).run(converted)
    timed("unfreeze")
    lifted = exported_program_from(unfrozen.program, like=like)
    timed("lift")
    return lifted, unfrozen.report


def _resolve_overload_packets(gm: GraphModule) -> None:
    """Give each op ``convert_pt2e`` inserted as an overload packet its overload.

    torchao's affine observers (per-block weights: ``QnnQuantizer``'s ``use_16a4w_block``)
    convert to ``torch.ops.torchao.dequantize_affine``, the packet, which an
    ExportedProgram's verifier refuses (``not an allowed operator type``): a re-export
    would resolve it, the lift does not trace. The overload is the packet's only one, or
    the one its arguments' values select (as dynamo resolves a packet); one that cannot be
    resolved is left for the lift to name."""
    for node in gm.graph.nodes:
        packet = node.target
        if node.op != "call_function" or not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        overloads = packet.overloads()
        if len(overloads) != 1:
            def value(arg: Any) -> Any:
                return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
            args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), value)
            try:
                overloads = [torch._C._jit_resolve_packet(packet._qualified_op_name,
                                                          *args, **kwargs)]
            except RuntimeError:
                continue
        node.target = getattr(packet, overloads[0])
    gm.recompile()


def _exact_integers(quant_min: int, quant_max: int, out_dtype: torch.dtype) -> bool:
    """Whether ``out_dtype`` holds every integer of ``[quant_min, quant_max]`` and every
    difference of two of them exactly (float16: up to 2048, bfloat16: up to 256)."""
    if not out_dtype.is_floating_point:
        return False
    largest = max(abs(quant_min), abs(quant_max), quant_max - quant_min)
    return largest <= 2 / torch.finfo(out_dtype).eps  # 2 ** (mantissa bits + 1)


def _dequantize_lossless(gm: GraphModule) -> None:
    """Dequantize per tensor in float32, then cast, where ``out_dtype`` cannot hold the
    grid's integers.

    torch's reference ``dequantize_per_tensor`` casts the integers to ``out_dtype`` before
    subtracting the zero point: on a 16-bit grid (``QnnQuantizer``'s ``use_16a8w``) read as
    float16, ``q`` is rounded to float16's spacing (32 above 32768: off by up to 32 steps)
    and is ``inf`` above 65504, while ExecuTorch's kernel computes in float32 and casts
    (the runtime then differs from the Python program call after call where the value is
    state). Computed in float32 and cast, both give the grid's value rounded once; where
    the integers are exact in ``out_dtype`` the two forms agree bit for bit and the node
    is left as it is."""
    qd = torch.ops.quantized_decomposed
    targets = (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor)
    for node in list(gm.graph.nodes):
        out_dtype = node.kwargs.get("out_dtype")
        if (node.op != "call_function" or node.target not in targets or out_dtype is None
                or out_dtype == torch.float32):
            continue
        quant_min, quant_max = node.args[3:5]
        if _exact_integers(quant_min, quant_max, out_dtype):
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k != "out_dtype"}
        with gm.graph.inserting_after(node):
            wide = gm.graph.call_function(node.target, node.args, kwargs)
        with gm.graph.inserting_after(wide):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (wide,),
                                          {"dtype": out_dtype})
        val = node.meta.get("val")
        wide.meta.update(node.meta)
        cast.meta.update(node.meta)
        if isinstance(val, torch.Tensor):
            wide.meta["val"] = val.to(torch.float32)
        node.replace_all_uses_with(cast)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


class _MethodQuantizer(PassQuantizer):
    """A PassQuantizer that also keeps, from the observer callback, which observers stand
    for each mutable buffer (see :mod:`passes._methods.observers`), and marks as state
    the buffers other methods write (``methods_state``) that this one only reads."""

    methods_state: frozenset[str] = frozenset()
    read_only_state: frozenset[str] = frozenset()  # of methods_state, what this one only reads

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        model = super().transform_for_annotation(model)
        self.read_only_state = frozenset(
            mark_state_of_other_methods(model, set(self.methods_state)))
        return model

    def prepare_obs_or_fq_callback(self, model: GraphModule, edge_or_node_to_obs_or_fq: dict,
                                   ) -> None:
        super().prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)
        self.buffer_observers = buffer_observers(model, edge_or_node_to_obs_or_fq,
                                                 getattr(self, "carried_inputs", None),
                                                 getattr(self, "paired_outputs", None))


def quantize_methods(
    programs: Mapping[str, ExportedProgram],
    quantizer: Quantizer,
    calls: Iterable[Any],
    *,
    fold: bool = True,
    quantize_state: bool = False,
    next_values: Mapping[str, Any] | None = None,
    pair_by_name: tuple[str, str] | None = None,
) -> QuantizedMethods:
    """Quantize the methods of one model (a prefill and a decode sharing their KV cache)
    with pt2e, calibrated as deployment runs them, each shared buffer on one grid.

    Each method is prepared as :func:`quantize_program` prepares a program. Then every
    buffer several methods share by fully-qualified name becomes one tensor object for
    all of them, and its observers (of the values written into it, of its contents and of
    its reads, see :mod:`passes._methods.observers`) one observer for all of them. The
    ``calls`` run in order on that one state (decode sees the cache prefill wrote), so the
    observers measure every method's values; the state is reset, each method converted,
    unfrozen and lifted (``like=`` its program). The methods must agree on their shared
    buffers before (shape, dtype, initial value) and agree after, the grid included
    (:func:`passes.check_shared_buffers`). A buffer one method writes is state in every
    method holding it, a method that only reads it included: its reads stay live (torchao
    would fold them into constants of the initial value), and with ``quantize_state`` it
    reads the integers the writers store.

    State carried in inputs the methods write in place (the caller's tensors, as Hugging
    Face's exporter passes its caches) is calibrated as deployment threads it: the calls
    pass one tensor, each prepared method writes it back (checked: an
    :class:`~passes.errors.InputStateError` otherwise), and inputs given one tensor object
    in several methods are one state with one observer, hence one grid
    (:attr:`QuantizedMethods.shared_inputs`). Afterwards the caller's tensors hold, bit
    for bit, what they held before calibration (saved and put back, as the buffers are
    reset).

    State carried as an input/output pair (the method returns an input's next value, as
    static-shape backends take state) is calibrated along alike once paired
    (``next_values`` / ``pair_by_name``, as :class:`passes.InputsToBuffers` takes them):
    each call passing the same tensor for the input is given the output the previous call
    returned (the caller's tensors are not written), and the input and its output are one
    state with one observer, hence one grid (with every other method passing that tensor:
    :attr:`QuantizedMethods.shared_inputs`). Without a pairing, a method whose output looks
    like an input's next value is refused (:class:`~passes.errors.UnpairedStateError`;
    ``next_values={}`` says no method carries state so).

    Args:
        programs: method name -> ExportedProgram of one model (functional or not).
        quantizer: a torchao pt2e ``Quantizer``, used for every method.
        calls: the calibration calls in deployment order, ``(method, args)`` or
            ``(method, args, kwargs)``; every method called at least once.
        fold: torchao's ``fold_quantize``, as in :func:`quantize_program`.
        quantize_state: also store each buffer whose writes lie on one grid as its
            integers (:class:`~passes.QuantizeMutableBuffers`, run on the mapping: one
            integer grid per buffer in every method). A shared buffer is stored so only
            if every method writing it can store it so; one that some method writes off
            the grid (a reset ``fill_(0.3)``) stays float in every method, the notes
            saying why (:func:`passes._methods.joint_storage.kept_float`). A method only
            reading a stored buffer, or writing it only as zeros, holds the writers'
            integers, and its ``quantize_state`` report says so.
        next_values: state carried as input/output pairs: one ``{input name: output
            name}`` for every method, or ``{method: {input: output}}``; ``{}``: none.
        pair_by_name: ``(input prefix, output prefix)`` pairing inputs and outputs by name
            in every method (``("past_key_values.", "present.")``).

    Returns:
        :class:`~passes._methods.calls.QuantizedMethods`, a dict of the quantized
        ExportedPrograms sharing one tensor per buffer (the first method's; the inputs'
        other tensors are left as they were), with a report per method and stage.

    Raises:
        pass_manager.SharedBufferError: the methods disagree about a shared buffer.
        QuantizationFlowError: the quantizer quantizes a shared buffer differently in two
            methods.
        QuantizationInputError: ``programs`` not a non-empty mapping of ExportedPrograms,
            ``quantizer`` not a Quantizer (the message says what to pass, e.g. "call
            xnnpack_quantizer()"), ``calls`` no sequence of calls (``None``, a tensor, one
            call), a call naming no method, or a method never called (also a
            ``ValueError``), methods sharing state that hold a parameter of one name
            differently (exported from separate instances of the model, each initialized
            its own way); its :class:`~passes.errors.CalibrationInputError` names the
            call and the input when a call does not fit its method's program, its
            :class:`~passes.errors.InputStateError` a method that would not write an input
            it writes in place back into the caller's tensor.
        UnpairedStateError: no pairing given, and a method's output looks like one of its
            inputs' next value (naming the method, the input and the output).
        StateNameError, StatePairingError: a pairing naming no input or output of a
            method, or pairing tensors of another shape or dtype.

    Example:
        >>> quantized = quantize_methods({"prefill": prefill_ep, "decode": decode_ep},
        ...                              xnnpack_quantizer(),
        ...                              [("prefill", (x4, pos4)), ("decode", (x1, pos1))])
        >>> quantized["decode"](x, pos)   # reads the cache quantized["prefill"] wrote
    """
    if not isinstance(programs, Mapping) or not programs:
        raise QuantizationInputError("quantize_methods", "programs", "takes a non-empty "
                                     "mapping {method: ExportedProgram}")
    for name, program in programs.items():
        if not isinstance(name, str) or not name:
            raise QuantizationInputError("quantize_methods", "programs", f"names a method "
                                         f"{name!r}: method names are non-empty strings, as "
                                         "ExecuTorch's .pte and PassManager take them")
        if not isinstance(program, ExportedProgram):
            raise QuantizationInputError("quantize_methods", f"programs[{name!r}]", "is a "
                            f"{type(program).__name__}, not an ExportedProgram")
    checked_quantizer(quantizer, "quantize_methods")
    calibration = method_calls(programs, calls, "quantize_methods")
    for index, (method, args, kwargs) in enumerate(calibration):
        check_calibration_call(programs[method], args, kwargs, "quantize_methods", index, method)
    check_shared_buffers(programs, "quantize_methods")
    separate = parameter_difference(programs)
    if separate is not None:
        raise QuantizationInputError("quantize_methods", "programs", separate)
    pairs = {name: pairs_of(program, method_pairing(next_values, name, list(programs)),
                            pair_by_name, "quantize_methods", name)
             for name, program in programs.items()}
    carried = carried_inputs(programs, calibration,
                             {name: [p.input_name for p in found]
                              for name, found in pairs.items()})
    wrapped = {name: _flow_quantizer(quantizer, _MethodQuantizer) for name in programs}
    state = frozenset(written_by_any_method(programs))
    for method in wrapped.values():
        method.methods_state = state
    for name, inputs in carried.items():
        wrapped[name].carried_inputs = inputs
    for name, found in pairs.items():
        placeholders = list(programs[name].graph_signature.user_inputs)
        wrapped[name].paired_outputs = {placeholders[p.input]: p.output for p in found}
    prepared = {name: _prepare(program, wrapped[name], "quantize_methods",
                               f"programs[{name!r}]")
                for name, program in programs.items()}
    check_write_backs(prepared, {name: {n: label for n, label in inputs.items()
                                        if n not in {p.input_name for p in pairs[name]}}
                                 for name, inputs in carried.items()})
    paired_state = PairedState(programs, {name: {p.input: p.output for p in found}
                                          for name, found in pairs.items()})
    shared = share_buffer_tensors(prepared)
    observers = share_observers(
        prepared, {name: wrapped[name].buffer_observers for name in programs})
    where = ["calls[0]", ""]
    with torch.no_grad(), callers_state_restored(programs, calibration), \
            non_finite_observations(prepared, where) as non_finite:
        try:
            for index, (method, args, kwargs) in enumerate(calibration):
                where[:] = [f"calls[{index}]", method]
                args, kwargs, given = paired_state.inputs(method, args, kwargs)
                result = run_calibration_call(prepared[method], args, kwargs,
                                              "quantize_methods", index, method)
                paired_state.returned(method, given, result)
        except CalibrationInputError as error:
            _reset(prepared)  # the programs' buffers as they were given
            _raise_for_non_finite(error, non_finite, "quantize_methods")
            raise
    _reset(prepared)
    reports: dict[str, dict[str, Report]] = {}
    quantized = {}
    for name, program in programs.items():
        with _convert_refusing_non_finite(non_finite, "quantize_methods"):
            quantized[name], unfreeze = _convert(prepared[name], program, fold,
                                                 read_only_state=wrapped[name].read_only_state)
        stages = dict(zip(("transform", "after_annotate"), wrapped[name].reports, strict=True))
        reports[name] = {**stages, "unfreeze": unfreeze}
    if quantize_state:
        # Run on the mapping: each method decides from its own writes, but a buffer some
        # method writes off the grid stays float in all (one buffer for every method);
        # then a method only reading a buffer reads the writers' integers, checked and
        # shared again.
        stored = PassManager([QuantizeMutableBuffers(keep_float=kept_float(quantized))]
                             ).run(quantized)
        for name, result in stored.items():
            quantized[name] = result.program
            reports[name]["quantize_state"] = result.report
    else:
        check_shared_buffers(quantized, "after quantize_methods")
    shared_inputs: dict[str, dict[str, str]] = {}
    for method, inputs in carried.items():
        for name, label in inputs.items():
            shared_inputs.setdefault(label, {})[method] = name
    shared_inputs = {label: by_method for label, by_method in shared_inputs.items()
                     if len(by_method) > 1}
    return QuantizedMethods(quantized, reports, shared,
                            {key: observers.get(key, 0) for key in [*shared, *shared_inputs]},
                            shared_inputs, non_finite)
