"""Several methods of one model in one ``.pte``, sharing their state, on ExecuTorch's runtime.

Backends that need static shapes deploy a decoder as a prefill of N tokens and a one-token
decode: two methods of one program over one KV cache. :func:`run_methods_on_runtime` lowers
the mapping ``{method: ExportedProgram}`` into one ``.pte`` with
``to_edge_transform_and_lower(programs, partitioner=[BufferOwningPartitioner(p,
methods=programs)])`` (a buffer several methods use stays at the top level, never in one
method's delegate), serializes it with ``MemoryPlanningPass(share_mutable_buffers=True)`` (each
shared buffer planned once, at one place every method reads and writes) and the buffers'
initial values, loads it once and runs the calls in order, as a device does.

Example:
    >>> run = run_methods_on_runtime({"prefill": ep4, "decode": ep1},
    ...                              [("prefill", (x4, pos4), {}), ("decode", (x1, pos1), {})])
    >>> run.outputs[1], run.memory.shared_bytes
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.backend.partitioner import Partitioner
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from executorch.runtime import Runtime
from torch.export import ExportedProgram

from pass_manager import shared_buffer_differences
from pass_manager.call_signature import describe_inputs, signature_of

from . import ExecuTorchInputError, ParameterMutationOnExecuTorchError
from .method_state import checked_methods
from .partitioner import BufferOwningPartitioner
from .plan import StatePlan, planned_state

__all__ = ["MethodsRun", "lower_methods_to_pte", "run_methods_on_runtime"]

HELPER = "run_methods_on_runtime"


@dataclass
class MethodsRun:
    """What the runtime computed and what the lowering planned.

    Attributes:
        outputs: one list of output tensors per call, in call order.
        methods: the method each call ran.
        memory: the planned state of the ``.pte`` (:class:`StatePlan`):
            ``memory.shared_bytes`` is what the methods' shared buffers take, once.
        notes: the partitioner's notes on buffer ownership, per method.
        delegates: delegate calls per method.
        lower_seconds: the lowering and serialization time.
        pte_bytes: the ``.pte`` size.
    """

    outputs: list[list[Any]] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    memory: StatePlan | None = None
    notes: list[str] = field(default_factory=list)
    delegates: dict[str, int] = field(default_factory=dict)
    lower_seconds: float = 0.0
    pte_bytes: int = 0


def _kind(value: Any) -> str:
    name = type(value).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _checked_programs(programs: Any) -> dict[str, ExportedProgram]:
    return checked_methods(HELPER, "programs", programs)


def _check_shared_state(programs: dict[str, ExportedProgram]) -> None:
    """A buffer the methods share is one tensor on the device (the planner gives it one place
    sized by any one method): one shape, dtype, initial value and grid in every method."""
    differences = shared_buffer_differences(programs)
    if differences:
        raise ExecuTorchInputError(
            HELPER, "programs", f"{differences[0]}; methods of one .pte share that buffer, so "
            "export them from one model (and quantize them together: "
            "passes.quantization.quantize_methods)")


def _flat_calls(programs: dict[str, ExportedProgram], calls: Any) -> list[tuple[str, list]]:
    """Each call as (method, the flat positional inputs the runtime takes), checked against
    the method's signature before anything is lowered."""
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise ExecuTorchInputError(
            HELPER, "calls", "a list of (method, args, kwargs) in the order deployment runs "
            f"them; got {_kind(calls)}")
    checked = []
    for index, call in enumerate(calls):
        where = f"calls[{index}]"
        if not isinstance(call, (tuple, list)) or len(call) not in (2, 3):
            raise ExecuTorchInputError(
                HELPER, where, f"a (method, args, kwargs) tuple; got {_kind(call)}")
        method, args, kwargs = (*call, {}) if len(call) == 2 else call
        if method not in programs:
            raise ExecuTorchInputError(
                HELPER, where, f"no method {method!r}; the programs are "
                f"{', '.join(map(repr, programs))}")
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, Mapping):
            raise ExecuTorchInputError(
                HELPER, where, "args is a tuple and kwargs a mapping; got "
                f"{_kind(args)} and {_kind(kwargs)}")
        program = programs[method]
        signature = signature_of(program)
        reason = signature.mismatch(tuple(args), dict(kwargs))
        if reason:
            raise ExecuTorchInputError(
                HELPER, where, f"{reason}; method {method!r} takes {signature}, {where} "
                f"gives {describe_inputs(tuple(args), dict(kwargs))}")
        # The runtime takes the exported input tree flattened: keyword arguments in the
        # order the program was exported with.
        keywords = list(program.call_spec.in_spec.children()[1].context or ())
        flat = pytree.tree_leaves((tuple(args), {k: kwargs[k] for k in keywords}))
        reason = _tensor_mismatch(program, flat)
        if reason:
            raise ExecuTorchInputError(
                HELPER, where, f"{reason}; method {method!r} was exported for "
                f"{_exported_inputs(program)}, {where} gives "
                f"{describe_inputs(tuple(args), dict(kwargs))}")
        checked.append((method, flat))
    return checked


def _user_input_values(program: ExportedProgram) -> list[Any]:
    placeholders = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
    return [placeholders[name].meta.get("val") for name in program.graph_signature.user_inputs
            if name in placeholders]


def _exported_inputs(program: ExportedProgram) -> str:
    return ", ".join(f"Tensor{list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                     if isinstance(v, torch.Tensor) else repr(v)
                     for v in _user_input_values(program))


def _tensor_mismatch(program: ExportedProgram, flat: list) -> str | None:
    """Why the flat inputs do not fit the tensors ``program`` was exported for: a static
    size (what a method of a static-shape backend has) or a dtype that differs."""
    wanted = _user_input_values(program)
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    expected = [v for v in wanted if isinstance(v, torch.Tensor)]
    if len(tensors) != len(expected):
        return f"it gives {len(tensors)} tensor input(s), the method takes {len(expected)}"
    for position, (got, want) in enumerate(zip(tensors, expected, strict=True)):
        if got.dtype != want.dtype:
            return f"tensor input #{position} is {got.dtype}, the method takes {want.dtype}"
        static = [s if isinstance(s, int) else None for s in want.shape]
        if got.dim() != len(static) or any(
                s is not None and s != g for s, g in zip(static, got.shape, strict=True)):
            return (f"tensor input #{position} has shape {list(got.shape)}, the method takes "
                    f"{[s if s is not None else '*' for s in static]}")
    return None


def _wrapper(partitioner: Any, programs: dict[str, ExportedProgram]) -> BufferOwningPartitioner:
    if partitioner is None:
        # XNNPACK's delegates take no buffers: saying so spares the trial partition.
        return BufferOwningPartitioner(XnnpackPartitioner(), methods=programs, own_buffers=False)
    if isinstance(partitioner, BufferOwningPartitioner):
        return BufferOwningPartitioner(partitioner.partitioner, methods=programs,
                                       strict=partitioner.strict,
                                       own_buffers=partitioner.own_buffers)
    if not isinstance(partitioner, Partitioner):
        raise ExecuTorchInputError(
            HELPER, "partitioner", f"an ExecuTorch Partitioner (e.g. XnnpackPartitioner()); "
            f"got {_kind(partitioner)}")
    return BufferOwningPartitioner(partitioner, methods=programs)


def lower_methods_to_pte(
    programs: Mapping[str, ExportedProgram],
    partitioner: Partitioner | None = None,
    share_mutable_buffers: bool = True,
) -> tuple[bytes, BufferOwningPartitioner, dict[str, int]]:
    """The methods as one ``.pte`` (shared mutable buffers, their initial values kept), the
    wrapper used and the delegate calls per method. ``share_mutable_buffers=False`` plans
    each method's buffers apart, as ExecuTorch does by default (to measure what sharing
    saves; such a program's methods do not share state).

    Raises:
        ExecuTorchInputError: ``programs`` is not a mapping of ExportedPrograms, their
            shared buffers differ, or ``partitioner`` is not an ExecuTorch Partitioner.
        ParameterMutationOnExecuTorchError: a method writes a parameter.
    """
    programs = _checked_programs(programs)
    _check_shared_state(programs)
    # Private copies: lowering must not touch the caller's programs or their state.
    copies = {name: copy.deepcopy(ep) for name, ep in programs.items()}
    wrapper = _wrapper(partitioner, copies)
    with torch.no_grad():  # the emitter writes buffers back in place
        edge = to_edge_transform_and_lower(copies, partitioner=[wrapper])
        names, delegates = set(), {}
        for method in edge.methods:
            ep = edge.exported_program(method)
            sig = ep.graph_signature
            if sig.parameters_to_mutate:
                raise ParameterMutationOnExecuTorchError(
                    sorted(sig.parameters_to_mutate.values()))
            mutated = set(sig.buffers_to_mutate.values())
            names.update(n for n, fqn in sig.inputs_to_buffers.items() if fqn in mutated)
            delegates[method] = sum(1 for n in ep.graph.nodes if n.op == "get_attr"
                                    and str(n.target).startswith("lowered_module"))
        config = ExecutorchBackendConfig(
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=share_mutable_buffers),
            passes=[InitializedMutableBufferPass(sorted(names))],
            emit_mutable_buffer_names=True)
        pte = edge.to_executorch(config).buffer
    return pte, wrapper, delegates


def run_methods_on_runtime(
    programs: Mapping[str, ExportedProgram],
    calls: Sequence[tuple[str, tuple, dict]],
    partitioner: Partitioner | None = None,
) -> MethodsRun:
    """Lower ``programs`` into one ``.pte``, load it once and run ``calls`` in order.

    Args:
        programs: ``{method name: ExportedProgram}``, the methods of one model sharing its
            buffers by FQN (e.g. a prefill exported with ``x[1, 4, dim]`` and a decode with
            ``x[1, 1, dim]``); their buffers' current values are the initial state.
        calls: ``[(method, args, kwargs), ...]`` (or ``(method, args)``), as deployment
            runs them: state persists across calls and methods.
        partitioner: an ExecuTorch partitioner (XNNPACK by default), wrapped in
            :class:`BufferOwningPartitioner` told the methods.

    Returns:
        :class:`MethodsRun`: per-call outputs, the planned state (shared bytes), notes,
        delegates and lowering time.

    Raises:
        ExecuTorchInputError: naming the argument: ``programs`` not a mapping of
            ExportedPrograms (or sharing a buffer they disagree on), a call naming an
            unknown method or whose inputs do not fit it, a ``partitioner`` that is not one.
        ParameterMutationOnExecuTorchError: a method writes a parameter.
    """
    programs = _checked_programs(programs)
    flat_calls = _flat_calls(programs, calls)
    start = time.perf_counter()
    pte, wrapper, delegates = lower_methods_to_pte(programs, partitioner)
    seconds = time.perf_counter() - start
    loaded = Runtime.get().load_program(pte)
    # Every method up front: loading one writes the shared buffers' initial values, which
    # must not land on state an earlier call wrote. (The pybind Module of
    # portable_lib gives each method arenas of its own: the decode would not see the
    # prefill's cache.)
    methods = {name: loaded.load_method(name) for name in sorted(loaded.method_names)}
    run = MethodsRun(memory=planned_state(pte), notes=list(wrapper.notes),
                     delegates=delegates, lower_seconds=seconds, pte_bytes=len(pte))
    for index, (method, flat) in enumerate(flat_calls):
        meta = methods[method].metadata
        if len(flat) != meta.num_inputs():
            declared = [list(meta.input_tensor_meta(i).sizes())
                        for i in range(meta.num_inputs())]
            raise ExecuTorchInputError(
                HELPER, f"calls[{index}]", f"gives {len(flat)} input(s); method {method!r} "
                f"of the .pte takes {meta.num_inputs()} ({declared})")
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in flat]
        outputs = methods[method].execute(inputs)
        run.outputs.append([o.clone() if isinstance(o, torch.Tensor) else o for o in outputs])
        run.methods.append(method)
    return run
