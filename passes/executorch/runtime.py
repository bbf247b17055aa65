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
from collections.abc import Sequence
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
    to_edge_transform_and_lower,
)
from executorch.exir._serialize._program import deserialize_pte_binary
from executorch.exir.backend.partitioner import Partitioner
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from executorch.extension.pybindings import portable_lib
from torch.export import ExportedProgram

from pass_manager.call_signature import describe_inputs, signature_of
from pass_manager.validation import Trace, call_inputs

from . import ExecuTorchInputError, ParameterMutationOnExecuTorchError
from .partitioner import BufferOwningPartitioner

__all__ = ["RuntimeDecode", "decode_on_runtime", "decode_pte", "lower_to_pte", "output_grid"]

PROGRAM_FORMS = (
    "an ExportedProgram, a module (with example_inputs), an EdgeProgramManager (from "
    "to_edge_transform_and_lower), an ExecutorchProgramManager (from .to_executorch()) or "
    "the .pte bytes (its .buffer)"
)
"""What the helpers take as ``program``, as their errors say it."""


@dataclass
class RuntimeDecode:
    """What the runtime computed (``trace.outputs``, one entry per call) and what it took."""

    trace: Trace
    notes: list[str] = field(default_factory=list)
    delegates: int = 0
    lower_seconds: float = 0.0
    pte_bytes: int = 0


@dataclass
class _Lowered:
    pte: bytes
    wrapper: BufferOwningPartitioner | None
    delegates: int
    notes: list[str]


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
            "argument tuple of one call, e.g. (x,), or pass the ExportedProgram")
    if isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    if not isinstance(example_inputs, tuple):
        raise ExecuTorchInputError(
            helper, "example_inputs", f"the argument tuple of one call, e.g. (x,); got "
            f"{_kind(example_inputs)}")
    signature = signature_of(program)
    reason = signature.mismatch(example_inputs, {})
    if reason:
        raise ExecuTorchInputError(
            helper, "example_inputs", f"{reason}; the module takes {signature}, "
            f"example_inputs gives {describe_inputs(example_inputs, {})}")
    return torch.export.export(copy.deepcopy(program), copy.deepcopy(example_inputs))


def _delegate_count(ep: ExportedProgram) -> int:
    return sum(1 for n in ep.graph.nodes
               if n.op == "get_attr" and str(n.target).startswith("lowered_module"))


def _serialize(edge: EdgeProgramManager, wrapper: BufferOwningPartitioner | None) -> _Lowered:
    ep = edge.exported_program()
    sig = ep.graph_signature
    if sig.parameters_to_mutate:
        raise ParameterMutationOnExecuTorchError(sorted(sig.parameters_to_mutate.values()))
    # ExecuTorch serializes only the shape of a mutated buffer unless asked: the runtime
    # must start from the program's state (e.g. a reset cache, a non-zero counter).
    mutated = set(sig.buffers_to_mutate.values())
    names = [name for name, fqn in sig.inputs_to_buffers.items() if fqn in mutated]
    # Their names go into the plan too, so that planned_memory can say which is which.
    config = ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(names)],
                                     emit_mutable_buffer_names=True)
    notes = list(wrapper.notes) if wrapper is not None else []
    return _Lowered(edge.to_executorch(config).buffer, wrapper, _delegate_count(ep), notes)


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


def _pte_delegates(helper: str, pte: bytes) -> int:
    try:
        plans = deserialize_pte_binary(pte).program.execution_plan
    except Exception as e:
        raise ExecuTorchInputError(
            helper, "program", f"the {len(pte)} bytes given are not a .pte program "
            f"({type(e).__name__}: {e}); pass an ExecutorchProgramManager's .buffer or a "
            ".pte file's bytes") from e
    return sum(len(plan.delegates) for plan in plans if plan.name == "forward")


def _no_partitioner(helper: str, partitioner: Any, program: Any) -> None:
    if partitioner is not None:
        raise ExecuTorchInputError(
            helper, "partitioner", f"{_kind(program)} is already lowered, so a partitioner "
            "has nothing to partition: pass the ExportedProgram to lower it with this "
            "partitioner, or drop the partitioner")


def _lower(helper: str, program: Any, example_inputs: Any, partitioner: Any) -> _Lowered:
    if isinstance(program, (bytes, bytearray, memoryview)):
        _no_partitioner(helper, partitioner, program)
        pte = bytes(program)
        return _Lowered(pte, None, _pte_delegates(helper, pte), [])
    if isinstance(program, ExecutorchProgramManager):
        _no_partitioner(helper, partitioner, program)
        ep = program.exported_program()
        if ep.graph_signature.parameters_to_mutate:
            raise ParameterMutationOnExecuTorchError(
                sorted(ep.graph_signature.parameters_to_mutate.values()))
        return _Lowered(program.buffer, None, _delegate_count(ep), _state_notes(program))
    # ExecuTorch's emitter writes buffers back in place; with autograd on, parameters that
    # require grad make those writes illegal.
    with torch.no_grad():
        if isinstance(program, EdgeProgramManager):
            _no_partitioner(helper, partitioner, program)
            return _serialize(copy.deepcopy(program), None)  # to_executorch edits its graph
        if isinstance(program, (ExportedProgram, torch.nn.Module)):
            # XNNPACK's partitioner gives its delegates no buffers: saying so spares the wrapper
            # the trial partition that decides which new buffer values an owner needs copied.
            wrapper = (BufferOwningPartitioner(XnnpackPartitioner(), own_buffers=False)
                       if partitioner is None else BufferOwningPartitioner(partitioner))
            ep = _exported(helper, program, example_inputs)
            return _serialize(to_edge_transform_and_lower(ep, partitioner=[wrapper]), wrapper)
    if isinstance(program, (str, os.PathLike)):
        raise ExecuTorchInputError(
            helper, "program", f"got the path {os.fspath(program)!r}; pass the .pte "
            "program's bytes: pathlib.Path(path).read_bytes()")
    raise ExecuTorchInputError(helper, "program", f"got {_kind(program)}; pass {PROGRAM_FORMS}")


def lower_to_pte(
    program: Any, example_inputs: tuple | None, partitioner: Partitioner | None = None
) -> tuple[bytes, BufferOwningPartitioner | None, int]:
    """``program`` as a ``.pte`` buffer, the wrapper used (None if it came lowered), delegates.

    Args:
        program: an ``ExportedProgram`` or a module (lowered with ``partitioner``, XNNPACK
            by default, wrapped in :class:`BufferOwningPartitioner`); an
            ``EdgeProgramManager`` (serialized as lowered, its mutable buffers' values
            kept); an ``ExecutorchProgramManager`` or ``.pte`` bytes (taken as serialized).
        example_inputs: the argument tuple of one call, to export a module; not used for
            the other forms (None is fine).
        partitioner: for a program not lowered yet; giving one with a lowered program is
            an error.

    Raises:
        ExecuTorchInputError: ``program`` is none of those forms, bytes that are not a
            ``.pte`` program, or a module without fitting ``example_inputs``; or a
            ``partitioner`` given with a lowered program.
        ParameterMutationOnExecuTorchError: ``program`` writes a parameter, which the
            runtime would not keep between calls.
    """
    lowered = _lower("lower_to_pte", program, example_inputs, partitioner)
    return lowered.pte, lowered.wrapper, lowered.delegates


def _positional_steps(program: Any, steps: Sequence[Any]) -> list[tuple]:
    """Each step's arguments, checked against what the Python program takes (before the
    lowering, which takes seconds)."""
    signature = signature_of(program) if isinstance(
        program, (ExportedProgram, torch.nn.Module)) else None
    checked = []
    for index, (args, kwargs) in enumerate(call_inputs(list(steps))):
        if kwargs:
            raise ExecuTorchInputError(
                "decode_on_runtime", f"steps[{index}]", "the ExecuTorch runtime takes "
                f"positional inputs only; got the keyword argument(s) {', '.join(kwargs)}")
        reason = signature.mismatch(args, {}) if signature is not None else None
        if reason:
            raise ExecuTorchInputError(
                "decode_on_runtime", f"steps[{index}]", f"{reason}; the program takes "
                f"{signature}, steps[{index}] gives {describe_inputs(args, {})}")
        checked.append(args)
    return checked


def _shapes_as_declared(args: tuple, meta: Any) -> bool:
    return all(
        not isinstance(a, torch.Tensor)
        or tuple(a.shape) == tuple(meta.input_tensor_meta(i).sizes())
        for i, a in enumerate(args)
    )


def _declared_inputs(meta: Any) -> str:
    return ", ".join(f"Tensor{list(meta.input_tensor_meta(i).sizes())}"
                     for i in range(meta.num_inputs()))


def decode_on_runtime(
    program: Any,
    example_inputs: tuple | None,
    steps: Sequence[Any],
    partitioner: Partitioner | None = None,
) -> RuntimeDecode:
    """Lower ``program``, load it once, and call it once per step (state persists).

    Args:
        program: what a user holds at any stage: an ``ExportedProgram`` or a module
            (lowered with ``partitioner``, XNNPACK by default, each delegate given the
            buffers it owns by :class:`BufferOwningPartitioner`); an
            ``EdgeProgramManager`` from ``to_edge_transform_and_lower`` (serialized here,
            its mutable buffers' values kept); an ``ExecutorchProgramManager`` from
            ``.to_executorch()``, or its ``.pte`` bytes (run as serialized).
        example_inputs: the argument tuple of one call, to export a module; not used for
            the other forms (None is fine).
        steps: one entry per call: an argument tuple (positional inputs only), checked
            against the program's inputs before anything is lowered.
        partitioner: for a program not lowered yet.

    Returns:
        The runtime's outputs per step, the wrapper's notes on buffer ownership (or, for
        a program serialized by the caller, on state it may not have kept), the number of
        delegates, the lowering time and the ``.pte`` size.

    Raises:
        ExecuTorchInputError: a ``program`` of none of those forms (the message lists
            them), bytes that are not a ``.pte`` program, a module without fitting
            ``example_inputs``, a ``partitioner`` with a lowered program, or a step that
            does not fit the program's inputs (keyword arguments, the wrong number of
            inputs, or inputs the runtime refuses).
        ParameterMutationOnExecuTorchError: ``program`` writes a parameter.
    """
    args_per_step = _positional_steps(program, steps)
    start = time.perf_counter()
    lowered = _lower("decode_on_runtime", program, example_inputs, partitioner)
    seconds = time.perf_counter() - start
    module = portable_lib._load_for_executorch_from_buffer(lowered.pte)
    meta = module.method_meta("forward")
    trace = Trace()
    for index, args in enumerate(args_per_step):
        if len(args) != meta.num_inputs():
            raise ExecuTorchInputError(
                "decode_on_runtime", f"steps[{index}]", f"gives {len(args)} input(s); the "
                f"lowered method takes {meta.num_inputs()} ({_declared_inputs(meta)})")
        flat = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        try:
            outputs = module.forward(flat)
        except RuntimeError as e:
            if _shapes_as_declared(args, meta):
                raise  # the inputs are as the method declares them: not theirs to fix
            raise ExecuTorchInputError(
                "decode_on_runtime", f"steps[{index}]", f"the runtime refused the call "
                f"({e}); steps[{index}] gives {describe_inputs(args, {})}, the lowered "
                f"method takes {_declared_inputs(meta)}") from e
        trace.outputs.append([o.clone() if isinstance(o, torch.Tensor) else o for o in outputs])
    return RuntimeDecode(trace, lowered.notes, lowered.delegates, seconds, len(lowered.pte))


def decode_pte(pte: bytes, steps: Sequence[Any]) -> Trace:
    """Load the already-lowered ``.pte`` program ``pte`` once and call its ``forward`` once
    per step: :func:`decode_on_runtime` without the lowering, for a program lowered once and
    decoded or inspected (:func:`passes.executorch.planned_memory`) several times."""
    return decode_on_runtime(bytes(pte), None, steps).trace


def output_grid(program: Any) -> float | None:
    """The step of the quantization grid of ``program``'s outputs (the largest output scale).

    A quantized program ends in ``dequantize_per_tensor(q, scale, ...)``; a runtime whose
    integer kernels round differently lands on a neighbouring grid point, so per-step
    outputs agree within this step. ``None`` when no output is dequantized.

    Raises:
        ExecuTorchInputError: ``program`` is not an ExportedProgram or GraphModule; a
            lowered program (edge, ExecuTorch or ``.pte``) is refused, since its outputs'
            dequantize may have moved into a delegate: pass the program before lowering.
    """
    if isinstance(program, (ExportedProgram, torch.fx.GraphModule)):
        graph = program.graph
    elif isinstance(program, (EdgeProgramManager, ExecutorchProgramManager, bytes, bytearray)):
        raise ExecuTorchInputError(
            "output_grid", "program", f"got {_kind(program)}, already lowered: a delegate "
            "may hold its outputs' dequantize; pass the quantized program you lowered (the "
            "ExportedProgram or GraphModule)")
    else:
        raise ExecuTorchInputError(
            "output_grid", "program", f"got {_kind(program)}; pass the quantized "
            "ExportedProgram or GraphModule")
    scales = []
    for node in graph.output_node().all_input_nodes:
        if node.op == "call_function" and "dequantize" in str(node.target):
            scale = node.args[1]
            if isinstance(scale, (float, int)):
                scales.append(float(scale))
    return max(scales, default=None)
