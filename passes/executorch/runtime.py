"""Decode on ExecuTorch's runtime: lower with XNNPACK (buffers decided by
:class:`BufferOwningPartitioner`), serialize to a ``.pte`` program, load it with the pybind
runtime in the wheel (``executorch.extension.pybindings.portable_lib``) and call it once
per step; the mutable buffers (KV caches) live in the loaded program and persist across
calls, exactly as on a device.

Each helper takes the program in the form a user holds it at any stage: an
``ExportedProgram`` or a module (lowered here), an ``EdgeProgramManager`` (from
``to_edge_transform_and_lower``, serialized here), an ``ExecutorchProgramManager`` (from
``.to_executorch()``) or the ``.pte`` bytes; anything else, or inputs that do not fit,
raise :class:`ExecuTorchInputError` saying what to pass.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The out variants of torchao's quantize/dequantize ops, for the ones no delegate takes (a
# quantizer annotating every op leaves some outside XNNPACK): to_executorch() needs them.
import executorch.kernels.quantized  # noqa: F401  (registers ops on import)
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import (
    EdgeProgramManager,
    ExecutorchBackendConfig,
    ExecutorchProgramManager,
)
from executorch.exir._serialize._program import deserialize_pte_binary
from executorch.exir.backend.partitioner import Partitioner
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from executorch.exir.schema import TensorShapeDynamism
from executorch.extension.pybindings import portable_lib
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Node

from pass_manager.call_signature import describe_inputs, signature_of
from pass_manager.validation import Trace, as_call

from .._analysis.buffers import user_outputs
from .._analysis.data_movement import moved_from
from .._analysis.node_origin import exported_name, source_line
from .._analysis.quantize_ops import is_dequantize, scale_of
from .._analysis.write_bounds import check_writes_within_state
from .._carried.pairs import pairs_of
from . import ExecuTorchInputError, ParameterMutationOnExecuTorchError
from .buffer_layout import contiguous_buffers
from .dynamic_ranges import TRACED_MINIMUM, ExportedRangeSymShapeEval, exported_ranges
from .edge_ops import exact_view_scatters, to_edge_or_refuse
from .initial_state import repair_initial_state
from .partitioner import BufferOwningPartitioner
from .portable_kernels import refuse_aborting_kernels
from .runtime_inputs import (
    CarriedState,
    aliased_outputs,
    carried_outputs,
    flat_inputs,
    user_input_names,
)
from .state_writes import refuse_mismatched_state_writes, refuse_state_written_in_subgraphs
from .tied_buffers import drop_unused_aliases

__all__ = [
    "LoweredProgram",
    "RuntimeDecode",
    "decode_on_runtime",
    "decode_pte",
    "lower_for_runtime",
    "lower_to_pte",
    "output_grid",
    "runtime_pairs",
    "runtime_steps",
    "within_grid_steps",
    "within_grid_steps_per_call",
]

PROGRAM_FORMS = (
    "an ExportedProgram, a module (with example_inputs), an EdgeProgramManager (from "
    "to_edge_transform_and_lower), an ExecutorchProgramManager (from .to_executorch()) or "
    "the .pte bytes (its .buffer)"
)
"""What the helpers take as ``program``, as their errors say it."""


@dataclass
class RuntimeDecode:
    """What the runtime computed, one entry per call, and what it took.

    Attributes:
        trace: the runtime's outputs (``trace.outputs``) and, after each call, its flat
            inputs with the written ones at their new values (``trace.inputs``).
        notes: the wrapper's notes on buffer ownership, notes on state a caller's
            serialization did not keep, and on carried state a step did not carry.
        delegates: the delegate calls of ``forward``.
        lower_seconds: the lowering and serialization time (0 for a lowered program).
        pte_bytes: the ``.pte`` size.
        carried: per call, the new values of the inputs carrying state, by input name:
            written in place (``USER_INPUT_MUTATION``) or paired with an output returning
            their next value (``next_values``); empty dicts when there are none.
    """

    trace: Trace
    notes: list[str] = field(default_factory=list)
    delegates: int = 0
    lower_seconds: float = 0.0
    pte_bytes: int = 0
    carried: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @property
    def outputs(self) -> list[list[Any]]:
        """The runtime's outputs per call (the program's outputs, without the written
        inputs' new values the runtime returns ahead of them: those are in ``carried``)."""
        return self.trace.outputs


@dataclass
class LoweredProgram:
    """A program lowered for the runtime, with what decoding it needs to know.

    Attributes:
        pte: the ``.pte`` program.
        wrapper: the :class:`BufferOwningPartitioner` used (None if it came lowered).
        delegates: the delegate calls of ``forward``.
        notes: the wrapper's notes, or notes on state the caller's serialization lost.
        carried: ``{output position: input position}``: the inputs ``forward`` writes in
            place, whose new values the runtime returns at those output positions.
        input_names: ``forward``'s user inputs, in the runtime's order (empty if unknown).
        program: the exported program whose call spec flattens the steps (None for a
            ``.pte`` alone, which takes them flat).
        lower_seconds: the lowering and serialization time.
    """

    pte: bytes
    wrapper: BufferOwningPartitioner | None
    delegates: int
    notes: list[str]
    carried: dict[int, int] = field(default_factory=dict)
    input_names: list[str] = field(default_factory=list)
    program: ExportedProgram | None = None
    lower_seconds: float = 0.0


def _kind(value: Any) -> str:
    name = type(value).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _exported(helper: str, program: Any, example_inputs: Any) -> ExportedProgram:
    # A private copy: lowering must not touch the caller's state, and the runtime starts
    # from the buffers' values as they are now (the initial state of the decode).
    if isinstance(program, ExportedProgram):
        return copy.deepcopy(program)
    if example_inputs is None:
        raise ExecuTorchInputError(
            helper, "example_inputs", "a module is exported before it is lowered: give the "
            "argument tuple of one call, e.g. (x,), or its (args, kwargs) pair, or pass the "
            "ExportedProgram")
    if not isinstance(example_inputs, (tuple, list, Mapping)):
        raise ExecuTorchInputError(
            helper, "example_inputs", f"the argument tuple of one call, e.g. (x,), or its "
            f"(args, kwargs) pair; got {_kind(example_inputs)}")
    # As the steps are written: keyword inputs (keyword-only ones, the Hugging Face form)
    # go in an (args, kwargs) pair.
    args, kwargs = as_call(example_inputs)
    signature = signature_of(program)
    reason = signature.mismatch(args, kwargs)
    if reason:
        raise ExecuTorchInputError(
            helper, "example_inputs", f"{reason}; the module takes {signature}, "
            f"example_inputs gives {describe_inputs(args, kwargs)} (keyword inputs go in an "
            "(args, kwargs) pair)")
    return torch.export.export(copy.deepcopy(program), copy.deepcopy(args),
                               copy.deepcopy(kwargs))


def delegate_backends(program: ExportedProgram | bytes) -> dict[str, list[str]]:
    """``{method: backend ids of its delegates}`` of a lowered ``program`` (for an
    ExportedProgram, ``"forward"``: its own)."""
    if isinstance(program, ExportedProgram):
        return {"forward": [getattr(program.graph_module, str(n.target)).backend_id
                            for n in program.graph.nodes if n.op == "get_attr"
                            and str(n.target).startswith("lowered_module")]}
    return {plan.name: [delegate.id for delegate in plan.delegates]
            for plan in deserialize_pte_binary(program).program.execution_plan}


def refuse_missing_backends(helper: str, backends: Mapping[str, Sequence[str]]) -> None:
    """An :class:`ExecuTorchInputError` if a delegate's backend is not built into this
    ExecuTorch runtime, before loading: its first call would fail with an untyped
    ``RuntimeError`` (``Failed to execute method forward, error: 0x20``). Core ML's
    backend, for one, runs on macOS only: lowering for it here is fine, running is not."""
    registered = set(portable_lib._get_registered_backend_names())
    for method, ids in backends.items():
        missing = sorted(set(ids) - registered)
        if missing:
            raise ExecuTorchInputError(
                helper, "partitioner", f"method {method!r} delegates to {', '.join(missing)}, "
                f"which this ExecuTorch runtime does not have (it has "
                f"{', '.join(sorted(registered))}): run the .pte where that backend is built "
                "in (Core ML's on macOS), or decode here lowered for a backend it has "
                "(XnnpackPartitioner, or no partitioner)")


def refuse_missing_operators(helper: str, pte: bytes,
                             programs: Mapping[str, ExportedProgram] | None = None) -> None:
    """An :class:`ExecuTorchInputError` if a method of ``pte`` calls an operator this
    ExecuTorch runtime registers no kernel for, before loading: loading it would fail with
    an untyped ``RuntimeError`` (``Failed to execute method forward, error: 0x14``) and
    ``Missing operator`` only in the log. A dtype view (``Tensor.view(torch.int32)``)
    becomes ``aten::view_copy.dtype_out``, which the portable kernels lack, for one.
    ``programs`` (method name -> the serialized program, ``et.exported_program(method)``)
    name the node calling it: its name in the exported program and its line in ``forward``."""
    registered = set(portable_lib._get_operator_names())
    for plan in deserialize_pte_binary(pte).program.execution_plan:
        missing = sorted({f"{op.name}.{op.overload}" if op.overload else op.name
                          for op in plan.operators} - registered)
        if missing:
            caller = _calling_node(programs.get(plan.name) if programs else None, missing)
            node, where = (None, "") if caller is None else (
                exported_name(caller), f" (node {exported_name(caller)!r}"
                + (f", {line}" if (line := source_line(caller)) else "") + ")")
            raise ExecuTorchInputError(
                helper, "program", f"method {plan.name!r} calls {', '.join(missing)}{where}, "
                "for which this ExecuTorch runtime has no kernel (loading it would fail with "
                "'Missing operator'): express that step with other ops, or lower with a "
                "partitioner whose backend takes it", node=node)


def _calling_node(program: ExportedProgram | None, operators: Sequence[str]) -> Node | None:
    """The first node of ``program`` calling one of ``operators`` (``aten::sum.out``)."""
    if program is None:
        return None
    for node in program.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and (f"{schema.name}.{schema.overload_name}"
                                   if schema.overload_name else schema.name) in operators:
            return node
    return None


def refuse_written_parameters(ep: ExportedProgram, helper: str = "lower_to_pte") -> None:
    """A :class:`ParameterMutationOnExecuTorchError` of ``helper`` if ``ep`` writes a
    parameter, naming the node computing its new value (its name in the exported program,
    its line)."""
    written = ep.graph_signature.parameters_to_mutate
    if not written:
        return
    producers = {spec.target: spec.arg.name for spec in ep.graph_signature.output_specs
                 if spec.kind == OutputKind.PARAMETER_MUTATION}
    first = sorted(written.values())[0]
    nodes = {node.name: node for node in ep.graph.nodes}
    node = nodes.get(producers.get(first, ""))
    raise ParameterMutationOnExecuTorchError(
        sorted(written.values()), None if node is None else exported_name(node), helper)


def _serialize(helper: str, edge: EdgeProgramManager, wrapper: BufferOwningPartitioner | None,
               notes: Sequence[str] = (), source: ExportedProgram | None = None
               ) -> LoweredProgram:
    """``edge`` serialized, its mutable buffers' values kept; lowered from ``source`` (our
    private copy of the caller's program; None: lowered by the caller), its dynamic sizes
    planned over the ranges ``source`` was exported with."""
    ep = edge.exported_program()
    refuse_written_parameters(ep, helper)
    refuse_aborting_kernels(ep, helper)  # a typed error now, not an abort when it runs
    refuse_mismatched_state_writes(ep, helper)  # lowered by hand from a decomposed program
    sig = ep.graph_signature
    # ExecuTorch serializes only the shape of a mutated buffer unless asked: the runtime
    # must start from the program's state (e.g. a reset cache, a non-zero counter).
    mutated = set(sig.buffers_to_mutate.values())
    names = [name for name, fqn in sig.inputs_to_buffers.items() if fqn in mutated]
    # Their names go into the plan too, so that planned_memory can say which is which.
    # ExecuTorch plans dynamic sizes over the range torch traced them for (from 2), not the
    # one they were exported with (see dynamic_ranges).
    ranges = exported_ranges(source, ep) if source is not None else {}
    config = ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(names)],
                                     emit_mutable_buffer_names=True,
                                     sym_shape_eval_pass=ExportedRangeSymShapeEval(ranges))
    notes = [*notes, *(wrapper.notes if wrapper is not None else ())]
    et = edge.to_executorch(config)
    notes += repair_initial_state(et, config)
    return _lowered(et, wrapper, len(delegate_backends(ep)["forward"]), notes)


def _lowered(et: ExecutorchProgramManager, wrapper: BufferOwningPartitioner | None,
             delegates: int, notes: list[str]) -> LoweredProgram:
    serialized = et.exported_program()
    return LoweredProgram(et.buffer, wrapper, delegates, notes, carried_outputs(serialized),
                          user_input_names(serialized), serialized)


def _initialized_allocations(pte: bytes) -> set[tuple[int, int]]:
    """Where the program's memory-planned tensors that come with data (the mutable buffers
    serialized with their values) live: ``(memory id, offset)``."""
    found = set()
    for plan in deserialize_pte_binary(pte).program.execution_plan:
        for value in plan.values:
            tensor = value.val
            where = getattr(tensor, "allocation_info", None)
            if where is not None and getattr(tensor, "data_buffer_idx", 0) > 0:
                found.add((where.memory_id,
                           where.memory_offset_low + (where.memory_offset_high << 32)))
    return found


def _state_notes(et: ExecutorchProgramManager) -> list[str]:
    """The mutable buffers holding a value the caller's serialization did not keep."""
    ep = et.exported_program()
    sig = ep.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    initialized = _initialized_allocations(et.buffer)
    notes = []
    for name, fqn in sorted(sig.inputs_to_buffers.items(), key=lambda item: item[1]):
        value = ep.state_dict.get(fqn, ep.constants.get(fqn))
        if fqn not in mutated or not isinstance(value, torch.Tensor) or not bool(value.any()):
            continue
        spec = placeholders[name].meta.get("spec") if name in placeholders else None
        if spec is not None and (spec.mem_id, spec.mem_offset) in initialized:
            continue
        notes.append(
            f"{fqn!r} holds a non-zero value the .pte does not keep: the runtime does not "
            "start from it (to_executorch() serializes a mutable buffer's shape, not its "
            "value, unless configured with InitializedMutableBufferPass); pass the "
            "EdgeProgramManager and decode_on_runtime serializes it")
    return notes


def _pte_forward(helper: str, pte: bytes) -> tuple[int, dict[int, int]]:
    """A ``.pte`` alone: the delegate calls of ``forward``, and the inputs it writes, read
    from its plan (the runtime returns a written input's own value ahead of the outputs)."""
    try:
        plans = deserialize_pte_binary(pte).program.execution_plan
    except Exception as e:
        raise ExecuTorchInputError(
            helper, "program", f"the {len(pte)} bytes given are not a .pte program "
            f"({type(e).__name__}: {e}); pass an ExecutorchProgramManager's .buffer or a "
            ".pte file's bytes") from e
    forward = [plan for plan in plans if plan.name == "forward"]
    return (sum(len(plan.delegates) for plan in forward),
            aliased_outputs(forward[0]) if forward else {})


def _no_partitioner(helper: str, partitioner: Any, program: Any) -> None:
    if partitioner is not None:
        raise ExecuTorchInputError(
            helper, "partitioner", f"{_kind(program)} is already lowered, so a partitioner "
            "has nothing to partition: pass the ExportedProgram to lower it with this "
            "partitioner, or drop the partitioner")


def _lower(helper: str, program: Any, example_inputs: Any, partitioner: Any) -> LoweredProgram:
    if isinstance(program, (bytes, bytearray, memoryview)):
        _no_partitioner(helper, partitioner, program)
        pte = bytes(program)
        delegates, carried = _pte_forward(helper, pte)
        return LoweredProgram(pte, None, delegates, [], carried)
    if isinstance(program, ExecutorchProgramManager):
        _no_partitioner(helper, partitioner, program)
        ep = program.exported_program()
        refuse_written_parameters(ep, helper)
        refuse_aborting_kernels(ep, helper)
        refuse_mismatched_state_writes(ep, helper)
        return _lowered(program, None, len(delegate_backends(ep)["forward"]), _state_notes(program))
    # ExecuTorch's emitter writes buffers back in place; with autograd on, parameters that
    # require grad make those writes illegal.
    with torch.no_grad():
        if isinstance(program, EdgeProgramManager):
            _no_partitioner(helper, partitioner, program)
            # to_executorch edits its graph
            return _serialize(helper, copy.deepcopy(program), None)
        if isinstance(program, (ExportedProgram, torch.nn.Module)):
            # XNNPACK's partitioner gives its delegates no buffers: saying so spares the wrapper
            # the trial partition that decides which new buffer values an owner needs copied.
            # A wrapper given is used as it is: wrapped again, its notes (and its keep-outs'
            # reasons) would be the inner one's, lost, and the trial partition would run twice.
            if partitioner is None:
                wrapper = BufferOwningPartitioner(XnnpackPartitioner(), own_buffers=False)
            elif isinstance(partitioner, BufferOwningPartitioner):
                wrapper = partitioner
            else:
                wrapper = BufferOwningPartitioner(partitioner)
            ep = _exported(helper, program, example_inputs)
            refuse_written_parameters(ep, helper)  # before a partitioner reports it otherwise
            notes = drop_unused_aliases(ep) + contiguous_buffers(ep, helper)
            refuse_mismatched_state_writes(ep, helper)  # what no copy_ is left to convert
            refuse_state_written_in_subgraphs(ep, helper)  # to_edge fails on it, untyped
            ep = exact_view_scatters(ep)  # a write through diagonal(): no Core ATen scatter
            return _serialize(helper, to_edge_or_refuse(helper, ep, [wrapper]),
                              wrapper, notes, source=ep)
    _refuse_form(helper, program)
    raise ExecuTorchInputError(helper, "program", f"got {_kind(program)}; pass {PROGRAM_FORMS}")


def _refuse_form(helper: str, program: Any) -> None:
    if isinstance(program, (str, os.PathLike)):
        raise ExecuTorchInputError(
            helper, "program", f"got the path {os.fspath(program)!r}; pass the .pte "
            "program's bytes: pathlib.Path(path).read_bytes()")
    if not isinstance(program, (bytes, bytearray, memoryview, ExecutorchProgramManager,
                                EdgeProgramManager, ExportedProgram, torch.nn.Module,
                                LoweredProgram)):
        raise ExecuTorchInputError(
            helper, "program", f"got {_kind(program)}; pass {PROGRAM_FORMS}")


def _steps_program(program: Any) -> ExportedProgram | None:
    """The exported program whose call spec and inputs the steps are checked against."""
    if isinstance(program, ExportedProgram):
        return program
    if isinstance(program, (EdgeProgramManager, ExecutorchProgramManager)):
        return program.exported_program()
    if isinstance(program, LoweredProgram):
        return program.program
    return None


def runtime_steps(helper: str, program: Any, steps: Sequence[Any]) -> list[list[Any]]:
    """Each step as the flat positional inputs the runtime takes, checked against
    ``program`` (any form :func:`decode_on_runtime` takes; a module once exported): what
    the helpers run before lowering, so that a step that cannot run fails in a moment.

    Raises:
        ExecuTorchInputError: naming ``helper`` and the step (``steps[i]``) and the input
            that does not fit (see :func:`passes.executorch.runtime_inputs.flat_inputs`).
    """
    _refuse_form(helper, program)
    if isinstance(steps, (str, bytes, Mapping, torch.Tensor)) or not isinstance(
            steps, Sequence):
        raise ExecuTorchInputError(
            helper, "steps", f"a list with one entry per call (an argument tuple, an (args, "
            f"kwargs) pair, or the inputs flat); got {_kind(steps)}")
    checked = _steps_program(program)
    return [flat_inputs(helper, f"steps[{index}]", checked, step)
            for index, step in enumerate(steps)]


def runtime_pairs(helper: str, program: Any, next_values: Mapping[str, str] | None,
                  pair_by_name: tuple[str, str] | None, method: str | None = None,
                  ) -> dict[int, int]:
    """``{flat input: flat output}`` of the state ``program`` carries as input/output pairs
    (:func:`passes._carried.pairs.pairs_of`), resolved on the program before lowering.

    Raises:
        ExecuTorchInputError: a pairing given with a ``.pte`` alone (it names nothing).
        UnpairedStateError, StateNameError, StatePairingError: see ``pairs_of``.
    """
    checked = _steps_program(program)
    if checked is None:
        if next_values or pair_by_name:
            raise ExecuTorchInputError(
                helper, "next_values" if next_values else "pair_by_name", "a .pte alone "
                "names none of its inputs and outputs: pass the ExportedProgram (or the "
                "Edge / ExecuTorch program manager) to pair them")
        return {}
    return {p.input: p.output
            for p in pairs_of(checked, next_values, pair_by_name, helper, method)}


def lower_for_runtime(
    program: Any, example_inputs: tuple | Mapping[str, Any] | None = None,
    partitioner: Partitioner | None = None,
) -> LoweredProgram:
    """``program`` lowered once, for :func:`decode_on_runtime` to decode (maybe several times)
    and :func:`passes.executorch.planned_memory` to read (``.pte``); the forms and errors of
    :func:`lower_to_pte`. Timed in ``lower_seconds``."""
    return _lower_timed("lower_for_runtime", program, example_inputs, partitioner)


def _lower_timed(helper: str, program: Any, example_inputs: Any,
                 partitioner: Any) -> LoweredProgram:
    if isinstance(program, LoweredProgram):
        _no_partitioner(helper, partitioner, program)
        return program
    start = time.perf_counter()
    lowered = _lower(helper, program, example_inputs, partitioner)
    lowered.lower_seconds = time.perf_counter() - start
    return lowered


def lower_to_pte(
    program: Any, example_inputs: tuple | Mapping[str, Any] | None,
    partitioner: Partitioner | None = None,
) -> tuple[bytes, BufferOwningPartitioner | None, int]:
    """``program`` as a ``.pte`` buffer, the wrapper used (None if it came lowered), delegates.

    Args:
        program: an ``ExportedProgram`` or a module (lowered with ``partitioner``, XNNPACK
            by default, wrapped in :class:`BufferOwningPartitioner`); an
            ``EdgeProgramManager`` (serialized as lowered, its mutable buffers' values
            kept); an ``ExecutorchProgramManager`` or ``.pte`` bytes (taken as serialized).
        example_inputs: the argument tuple of one call, or its ``(args, kwargs)`` pair (as
            a step is written), to export a module; not used for the other forms (None is
            fine).
        partitioner: for a program not lowered yet; giving one with a lowered program is
            an error.

    Raises:
        ExecuTorchInputError: ``program`` is none of those forms, bytes that are not a
            ``.pte`` program, or a module without fitting ``example_inputs``; or a
            ``partitioner`` given with a lowered program; or a state whose new value has
            another dtype or shape than the state (a decomposed program: see
            :mod:`passes.executorch.state_writes`).
        ParameterMutationOnExecuTorchError: ``program`` writes a parameter, which the
            runtime would not keep between calls.
        PortableKernelAbortError: the lowered program keeps at the top level a quantize
            or dequantize whose ExecuTorch kernel aborts the process on its dtype (a
            bfloat16 float side), found before serializing.
        NonContiguousStateError: a buffer that is not contiguous (lowered contiguous, a
            note says so) is read by an op computing by strides (``as_strided``).
    """
    lowered = _lower("lower_to_pte", program, example_inputs, partitioner)
    return lowered.pte, lowered.wrapper, lowered.delegates


def _shapes_as_declared(args: Sequence[Any], meta: Any) -> bool:
    return all(
        not isinstance(a, torch.Tensor)
        or tuple(a.shape) == tuple(meta.input_tensor_meta(i).sizes())
        for i, a in enumerate(args)
    )


def _dynamic_inputs(pte: bytes) -> list[bool]:
    """Per input of ``forward``: whether the runtime takes it at any size up to its planned
    one (a dynamic-size input), not at that size only."""
    plan = next(p for p in deserialize_pte_binary(pte).program.execution_plan
                if p.name == "forward")
    return [getattr(plan.values[i].val, "shape_dynamism", TensorShapeDynamism.STATIC)
            != TensorShapeDynamism.STATIC for i in plan.inputs]


def _sizes_below_minimum(args: Sequence[Any], meta: Any, dynamic: Sequence[bool]
                         ) -> list[str] | None:
    """For inputs the method's plan takes (a static one at its size, a dynamic one at most
    at its planned size): the dynamic sizes given below the one torch traces them from (2);
    None if an input does not fit its plan."""
    small = []
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            continue
        planned = list(meta.input_tensor_meta(i).sizes())
        if a.dim() != len(planned) or any(g > p for g, p in zip(a.shape, planned, strict=True)):
            return None
        if not dynamic[i]:
            if list(a.shape) != planned:
                return None
            continue
        small += [f"input #{i} dimension {d} is {g} (planned up to {p})"
                  for d, (g, p) in enumerate(zip(a.shape, planned, strict=True))
                  if g < TRACED_MINIMUM < p]
    return small


def _declared_inputs(meta: Any) -> str:
    return ", ".join(f"Tensor{list(meta.input_tensor_meta(i).sizes())}"
                     for i in range(meta.num_inputs()))


def decode_on_runtime(
    program: Any,
    example_inputs: tuple | Mapping[str, Any] | None,
    steps: Sequence[Any],
    partitioner: Partitioner | None = None,
    *,
    next_values: Mapping[str, str] | None = None,
    pair_by_name: tuple[str, str] | None = None,
) -> RuntimeDecode:
    """Lower ``program``, load it once, and call it once per step (state persists).

    State persists as on a device: mutable buffers in the loaded program; inputs the
    program writes in place (``USER_INPUT_MUTATION``, e.g. the KV caches of transformers'
    own exporter) as in Python eager: ExecuTorch's runtime returns such an input's new
    value as an extra output and leaves the tensor passed as it was, so each later step
    that passes the same tensor is given that new value here (the caller's tensors are
    never written). A step that passes a new tensor for it starts from that tensor's
    value, as in eager, and a note says so. (A ``.pte`` alone does not say which outputs
    are written inputs: its leading outputs that are an input's own value are taken so.)
    State carried as an input/output pair (the program returns an input's next value, as
    static-shape backends take state) is threaded alike once paired, by ``next_values`` or
    ``pair_by_name`` as :class:`passes.InputsToBuffers` takes them: each later step passing
    the same tensor for the input is given the output the previous call returned. Without
    a pairing, a program whose output looks like an input's next value is refused
    (:class:`~passes.errors.UnpairedStateError`; the rules: :mod:`passes._carried.pairs`):
    ``next_values={}`` says it carries no state so.

    Args:
        program: what a user holds at any stage: an ``ExportedProgram`` or a module
            (lowered with ``partitioner``, XNNPACK by default, each delegate given the
            buffers it owns by :class:`BufferOwningPartitioner`); an
            ``EdgeProgramManager`` from ``to_edge_transform_and_lower`` (serialized here,
            its mutable buffers' values kept); an ``ExecutorchProgramManager`` from
            ``.to_executorch()``, its ``.pte`` bytes (run as serialized), or a
            :class:`LoweredProgram` from :func:`lower_for_runtime`.
        example_inputs: the argument tuple of one call, or its ``(args, kwargs)`` pair (as
            a step is written), to export a module; not used for the other forms (None is
            fine).
        steps: one entry per call, as the program is called in Python (an argument tuple,
            an ``(args, kwargs)`` pair, or a keyword mapping; flattened by the program's
            call spec) or its inputs flat in the exported order (the runtime's form; the
            only form a ``.pte`` alone takes). Checked against the program's inputs
            before anything is lowered.
        partitioner: for a program not lowered yet.
        next_values: ``{input name: output name}``: each output returning an input's next
            value (inputs by placeholder or keyword path, outputs by dotted path: ``cache``,
            ``past_key_values.0.key``; ``0``, ``1`` for a returned tuple); ``{}``: none.
        pair_by_name: ``(input prefix, output prefix)``, e.g. ``("past_key_values.",
            "present.")``: pairs the inputs and outputs so named.

    Returns:
        :class:`RuntimeDecode`: the runtime's outputs per step (``.outputs``), the new
        values of the inputs carrying state (written in place or paired; ``.carried``),
        notes (buffer ownership, state a caller's serialization may not have kept, state a
        step did not carry), the number of delegates, the lowering time and the ``.pte``
        size.

    Raises:
        ExecuTorchInputError: a ``program`` of none of those forms (the message lists
            them), bytes that are not a ``.pte`` program, a module without fitting
            ``example_inputs``, a ``partitioner`` with a lowered program, or a step that
            does not fit the program's inputs (naming the step and the input: their
            number, keyword names, a dtype, a static size or a dynamic size out of range),
            inputs the runtime refuses, or a delegate whose backend this runtime lacks
            (Core ML's on Linux), found before loading; or a state whose new value has
            another dtype or shape than the state (a decomposed program: see
            :mod:`passes.executorch.state_writes`), found before lowering; or an operator
            ExecuTorch's edge dialect refuses (see :mod:`passes.executorch.edge_ops`),
            naming its node, where ``to_edge`` raises untyped.
        ParameterMutationOnExecuTorchError: ``program`` writes a parameter.
        PortableKernelAbortError: the lowered program keeps at the top level a quantize
            or dequantize whose ExecuTorch kernel aborts the process on its dtypes (a
            bfloat16 float side, a per-channel quantize of float32 scales or int32 zero
            points), found before serializing.
        NonContiguousStateError: a buffer that is not contiguous (lowered contiguous, a
            note says so) is read by an op computing by strides (``as_strided``).
        StatePastEndError: a step writes a buffer past its end (more decode steps than the
            cache holds), found before lowering an ExportedProgram or module, where the
            runtime would fail with an untyped error 0x12.
        UnpairedStateError: no pairing given, and an output looks like an input's next
            value (name, OpenVINO's names, or an update of the input).
        StateNameError, StatePairingError: the pairing names no input or output, or pairs
            an input with an output of another shape or dtype.
    """
    helper = "decode_on_runtime"
    _refuse_form(helper, program)
    if isinstance(program, torch.nn.Module):
        program = _exported(helper, program, example_inputs)  # once: checked, then lowered
    flat_steps = runtime_steps(helper, program, steps)
    pairs = runtime_pairs(helper, program, next_values, pair_by_name)
    if isinstance(program, ExportedProgram):  # a lowered program no longer shows its writes
        check_writes_within_state(helper, {"forward": program},
                                  [("forward", flat) for flat in flat_steps],
                                  lambda step, _: f"steps[{step}]", {"forward": pairs})
    lowered = _lower_timed(helper, program, None, partitioner)
    if lowered.delegates:
        refuse_missing_backends(helper, delegate_backends(lowered.program or lowered.pte))
    refuse_missing_operators(helper, lowered.pte, _programs(lowered))
    module = portable_lib._load_for_executorch_from_buffer(lowered.pte)
    meta = module.method_meta("forward")
    state = CarriedState(helper)
    trace, carried = Trace(), []
    for index, flat in enumerate(flat_steps):
        where = f"steps[{index}]"
        if len(flat) != meta.num_inputs():
            raise ExecuTorchInputError(
                helper, where, f"gives {len(flat)} input(s); the "
                f"lowered method takes {meta.num_inputs()} ({_declared_inputs(meta)})")
        inputs = state.inputs(flat)
        try:
            outputs = module.forward(inputs)
        except RuntimeError as e:
            if _shapes_as_declared(flat, meta):
                raise  # the inputs are as the method declares them: not theirs to fix
            if small := _sizes_below_minimum(flat, meta, _dynamic_inputs(lowered.pte)):
                raise ExecuTorchInputError(
                    helper, where, f"the runtime failed inside the method ({e}) on inputs "
                    f"within the sizes it is planned for (at most {_declared_inputs(meta)}): "
                    f"{'; '.join(small)}. ExecuTorch plans each dynamic-size tensor at its "
                    "largest size over the range to_edge keeps, which starts at 2 (torch "
                    "treats sizes 0 and 1 as special) whatever minimum the program was "
                    "exported with, so a tensor that shrinks as the size grows (cache[n:]) "
                    "is planned too small for a size below 2; lower the ExportedProgram "
                    "here (the helpers plan over the exported range), or give sizes of at "
                    "least 2") from e
            raise ExecuTorchInputError(
                helper, where, f"the runtime refused the call ({e}); {where} gives "
                f"{describe_inputs(tuple(flat), {})}, the lowered method takes "
                f"{_declared_inputs(meta)}") from e
        returned, written = state.update(where, flat, outputs, lowered.carried,
                                         lowered.input_names, pairs)
        trace.outputs.append(returned)
        names = lowered.input_names or [f"input #{i}" for i in range(len(inputs))]
        in_place = {names[position] for position in lowered.carried.values()}
        trace.inputs.append([written[name] if name in in_place else value
                             for name, value in zip(names, inputs, strict=True)])
        carried.append(written)
    return RuntimeDecode(trace, lowered.notes + state.notes, lowered.delegates,
                         lowered.lower_seconds, len(lowered.pte), carried)


def _programs(lowered: LoweredProgram) -> dict[str, ExportedProgram]:
    """The serialized program by method, when ``lowered`` holds one (not a ``.pte`` alone)."""
    return {} if lowered.program is None else {"forward": lowered.program}


def decode_pte(pte: bytes, steps: Sequence[Any]) -> Trace:
    """Load the already-lowered ``.pte`` program ``pte`` once and call its ``forward`` once
    per step: :func:`decode_on_runtime` without the lowering, for a program lowered once and
    decoded or inspected (:func:`passes.executorch.planned_memory`) several times."""
    return decode_on_runtime(bytes(pte), None, steps).trace


def output_grid(program: Any) -> float | None:
    """The step of the quantization grid of ``program``'s outputs (the largest output scale):
    the outputs its caller gets, not the mutation outputs of a lifted program's state; an
    output that views a dequantize (a reshape after it) is on the dequantize's grid.

    A quantized program ends in ``dequantize_per_tensor(q, scale, ...)``; a runtime whose
    integer kernels round differently lands on a neighbouring grid point, so per-step
    outputs agree within this step. ``None`` when no output is dequantized.

    Raises:
        ExecuTorchInputError: ``program`` is not an ExportedProgram or GraphModule; a
            lowered program (edge, ExecuTorch or ``.pte``) is refused, since its outputs'
            dequantize may have moved into a delegate: pass the program before lowering.
    """
    if isinstance(program, (EdgeProgramManager, ExecutorchProgramManager, bytes, bytearray)):
        raise ExecuTorchInputError(
            "output_grid", "program", f"got {_kind(program)}, already lowered: a delegate "
            "may hold its outputs' dequantize; pass the quantized program you lowered (the "
            "ExportedProgram or GraphModule)")
    if not isinstance(program, (ExportedProgram, torch.fx.GraphModule)):
        raise ExecuTorchInputError(
            "output_grid", "program", f"got {_kind(program)}; pass the quantized "
            "ExportedProgram or GraphModule")
    scales = []
    # The caller's outputs only: a mutation output dequantizes a cache on the cache's grid.
    for node in map(moved_from, user_outputs(program)):  # a view of a dequantize is on its grid
        if is_dequantize(node):
            scale = scale_of(node)
            if isinstance(scale, (float, int)):
                scales.append(float(scale))
    return max(scales, default=None)


# How far past a whole number of grid steps two dequantized outputs may be from float32
# rounding alone, relative to the step. Each side is q * scale with an integer |q| < 2**15
# (int8 and int16 grids), computed and stored in float32 (relative rounding 2**-24 per value,
# and the runtime's scale is the float32 of the program's double): each value may sit up to
# 2**15 * 2**-24 * step = 2**-9 step off its grid point, so their difference up to 2**-8 step.
# Without the slack, a runtime one grid point away fails by a few float32 ulps (the main job
# once reported 0.014555692 against a grid of 0.014555679 as a failure); any difference a real
# disagreement makes is a further whole step away.
GRID_ROUNDING_SLACK = 2.0**-8


def within_grid_steps(difference: float, grid: float, steps: int = 1) -> bool:
    """Whether ``difference`` between two dequantized outputs on the grid of step ``grid``
    is at most ``steps`` grid steps, allowing float32 rounding (:data:`GRID_ROUNDING_SLACK`
    of a step): a runtime whose integer kernels round differently lands ``steps`` grid
    points away at most."""
    return difference <= grid * (steps + GRID_ROUNDING_SLACK)


def within_grid_steps_per_call(differences: Sequence[float], grid: float,
                               carries_state: bool) -> bool:
    """Whether a runtime's per-call ``differences`` from the same quantized program in
    Python are its kernels' rounding: one grid step at each call, and where the program
    writes state, one more per call before it. A value that differs by one grid step is
    written into the state and read by the next call, which rounds again (an accumulator
    measured at 2 steps from its second call, seeds 1 and 5 of 6); a state the runtime
    drops or misreads is off by the state's magnitude, many steps at once."""
    return all(within_grid_steps(difference, grid, call + 1 if carries_state else 1)
               for call, difference in enumerate(differences))
