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
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig
from executorch.exir.backend.partitioner import Partitioner
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from executorch.runtime import Runtime
from torch.export import ExportedProgram

from .._analysis.write_bounds import check_writes_within_state
from .._carried.pairs import method_pairing
from .._methods.shared_buffers import parameter_difference, shared_buffer_differences
from . import ExecuTorchInputError
from .buffer_layout import contiguous_buffers
from .dynamic_ranges import ExportedRangeSymShapeEval, exported_ranges
from .edge_ops import exact_view_scatters, to_edge_or_refuse
from .initial_state import repair_initial_state
from .method_state import checked_methods
from .partitioner import BufferOwningPartitioner
from .plan import StatePlan, planned_state
from .portable_kernels import refuse_aborting_kernels
from .runtime import (
    delegate_backends,
    refuse_missing_backends,
    refuse_missing_operators,
    refuse_written_parameters,
    runtime_pairs,
)
from .runtime_inputs import CarriedState, carried_outputs, flat_inputs, user_input_names
from .state_writes import refuse_mismatched_state_writes, refuse_state_written_in_subgraphs
from .tied_buffers import drop_unused_aliases

__all__ = ["MethodsRun", "lower_methods_to_pte", "run_methods_on_runtime"]

HELPER = "run_methods_on_runtime"


@dataclass
class MethodsRun:
    """What the runtime computed and what the lowering planned.

    Attributes:
        outputs: one list of output tensors per call, in call order (the methods' outputs,
            without the new values of inputs they write, which the runtime returns ahead).
        methods: the method each call ran.
        carried: per call, the new values of the inputs its method carries state in, by
            input name: written in place (``USER_INPUT_MUTATION``), or paired with an output
            returning the next value (``next_values``); a later call that passes the same
            tensor gets that value, as in Python eager (empty dicts when there are none).
        memory: the planned state of the ``.pte`` (:class:`StatePlan`):
            ``memory.shared_bytes`` is what the methods' shared buffers take, once.
        notes: the partitioner's notes on buffer ownership, per method.
        delegates: delegate calls per method.
        lower_seconds: the lowering and serialization time.
        pte_bytes: the ``.pte`` size.
    """

    outputs: list[list[Any]] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    carried: list[dict[str, torch.Tensor]] = field(default_factory=list)
    memory: StatePlan | None = None
    notes: list[str] = field(default_factory=list)
    delegates: dict[str, int] = field(default_factory=dict)
    lower_seconds: float = 0.0
    pte_bytes: int = 0


def _kind(value: Any) -> str:
    name = type(value).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _checked_programs(programs: Any, helper: str = HELPER) -> dict[str, ExportedProgram]:
    return checked_methods(helper, "programs", programs)


def _check_shared_state(programs: dict[str, ExportedProgram], helper: str) -> None:
    """A buffer the methods share is one tensor on the device (the planner gives it one place
    sized by any one method): one shape, dtype, initial value and grid in every method.
    ``helper``: the function the caller called, which the error names."""
    differences = shared_buffer_differences(programs)
    if differences:
        raise ExecuTorchInputError(
            helper, "programs", f"{differences[0]}; methods of one .pte share that buffer, so "
            "export them from one model (and quantize them together: "
            "passes.quantization.quantize_methods)")
    separate = parameter_difference(programs)
    if separate is not None:
        raise ExecuTorchInputError(helper, "programs", separate)


def _flat_calls(programs: dict[str, ExportedProgram], calls: Any) -> list[tuple[str, list]]:
    """Each call as (method, the flat positional inputs the runtime takes), checked against
    the method's inputs before anything is lowered."""
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
        flat = flat_inputs(HELPER, where, programs[method], (tuple(args), dict(kwargs)))
        checked.append((method, flat))
    return checked


def _wrapper(partitioner: Any, programs: dict[str, ExportedProgram],
             helper: str) -> BufferOwningPartitioner:
    if partitioner is None:
        # XNNPACK's delegates take no buffers: saying so spares the trial partition.
        return BufferOwningPartitioner(XnnpackPartitioner(), methods=programs, own_buffers=False)
    if isinstance(partitioner, BufferOwningPartitioner):
        return BufferOwningPartitioner(partitioner.partitioner, methods=programs,
                                       strict=partitioner.strict,
                                       own_buffers=partitioner.own_buffers,
                                       keep_precision=partitioner.keep_precision)
    if not isinstance(partitioner, Partitioner):
        raise ExecuTorchInputError(
            helper, "partitioner", f"an ExecuTorch Partitioner (e.g. XnnpackPartitioner()); "
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
            shared buffers differ, methods sharing state hold a parameter of one name
            differently (separate instances of the model), ``partitioner`` is not an
            ExecuTorch Partitioner, or a state's new value has another dtype or shape than
            the state (a decomposed method: see :mod:`passes.executorch.state_writes`).
        ParameterMutationOnExecuTorchError: a method writes a parameter.
        PortableKernelAbortError: a method keeps at the top level a quantize or dequantize
            whose ExecuTorch kernel would abort the process (a bfloat16 float side).
        NonContiguousStateError: a buffer that is not contiguous (lowered contiguous, a
            note says so) is read by an op computing by strides (``as_strided``).
    """
    lowered = _lower_methods(programs, partitioner, share_mutable_buffers)
    return lowered.pte, lowered.wrapper, lowered.delegates


@dataclass
class _LoweredMethods:
    pte: bytes
    wrapper: BufferOwningPartitioner
    backends: dict[str, list[str]]
    """method -> the backend ids of its delegates."""
    carried: dict[str, dict[int, int]]
    """method -> {output position: input position} of the inputs it writes in place."""
    input_names: dict[str, list[str]]
    repaired: list[str] = field(default_factory=list)
    """Buffers whose initial value the emitter pointed at another's bytes, now their own."""
    dropped: list[str] = field(default_factory=list)
    """Unused second names of written buffers, dropped before lowering (see tied_buffers),
    and buffers lowered contiguous (see buffer_layout)."""
    serialized: dict[str, ExportedProgram] = field(default_factory=dict)
    """method -> its program as serialized, naming the nodes the runtime calls."""

    @property
    def delegates(self) -> dict[str, int]:
        """method -> its delegate calls."""
        return {method: len(ids) for method, ids in self.backends.items()}


def _lower_methods(programs: Mapping[str, ExportedProgram], partitioner: Any,
                   share_mutable_buffers: bool = True,
                   helper: str = "lower_methods_to_pte") -> _LoweredMethods:
    programs = _checked_programs(programs, helper)
    _check_shared_state(programs, helper)
    # Private copies: lowering must not touch the caller's programs or their state.
    copies = {name: copy.deepcopy(ep) for name, ep in programs.items()}
    dropped = [f"[{name}] {note}" for name, ep in copies.items()
               for note in drop_unused_aliases(ep) + contiguous_buffers(ep, helper, name)]
    for name, ep in copies.items():  # what no copy_ is left to convert
        refuse_mismatched_state_writes(ep, helper, name)
        refuse_state_written_in_subgraphs(ep, helper, name)  # to_edge fails on it, untyped
    # A write through diagonal() has no Core ATen scatter: written by index instead.
    copies = {name: exact_view_scatters(ep) for name, ep in copies.items()}
    wrapper = _wrapper(partitioner, copies, helper)
    with torch.no_grad():  # the emitter writes buffers back in place
        edge = to_edge_or_refuse(helper, copies, [wrapper])
        names, backends = set(), {}
        for method in edge.methods:
            ep = edge.exported_program(method)
            sig = ep.graph_signature
            refuse_written_parameters(ep, helper)
            refuse_aborting_kernels(ep, helper, method)
            mutated = set(sig.buffers_to_mutate.values())
            names.update(n for n, fqn in sig.inputs_to_buffers.items() if fqn in mutated)
            backends[method] = delegate_backends(ep)["forward"]
        # Each method's dynamic sizes planned over its exported ranges (see dynamic_ranges).
        ranges = {method: exported_ranges(copies[method], edge.exported_program(method))
                  for method in edge.methods}
        config = ExecutorchBackendConfig(
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=share_mutable_buffers),
            passes=[InitializedMutableBufferPass(sorted(names))],
            emit_mutable_buffer_names=True,
            sym_shape_eval_pass={method: ExportedRangeSymShapeEval(found)
                                 for method, found in ranges.items()})
        et = edge.to_executorch(config)
        repaired = repair_initial_state(et, config)
    serialized = {method: et.exported_program(method) for method in edge.methods}
    return _LoweredMethods(
        et.buffer, wrapper, backends,
        {method: carried_outputs(ep) for method, ep in serialized.items()},
        {method: user_input_names(ep) for method, ep in serialized.items()}, repaired, dropped,
        serialized)


def run_methods_on_runtime(
    programs: Mapping[str, ExportedProgram],
    calls: Sequence[tuple[str, tuple, dict]],
    partitioner: Partitioner | None = None,
    *,
    next_values: Mapping[str, Any] | None = None,
    pair_by_name: tuple[str, str] | None = None,
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
        next_values: state carried as input/output pairs, as
            :func:`~passes.executorch.runtime.decode_on_runtime` takes it: one
            ``{input name: output name}`` for every method, or ``{method: {input: output}}``
            (a method left out is not said); each later call passing the same tensor for
            the input (in any method) is given the output the previous call returned.
            ``{}``: no method carries state so.
        pair_by_name: ``(input prefix, output prefix)`` for every method.

    State the methods carry in inputs (written in place, or paired) is threaded between
    calls as the runtime returns it; the caller's tensors are never written.

    Returns:
        :class:`MethodsRun`: per-call outputs, the planned state (shared bytes), notes,
        delegates and lowering time.

    Raises:
        ExecuTorchInputError: naming the argument: ``programs`` not a mapping of
            ExportedPrograms (or sharing a buffer they disagree on, or sharing state but
            holding a parameter of one name differently: exported from separate instances
            of the model), a call naming an
            unknown method or whose inputs do not fit it, a ``partitioner`` that is not one
            or delegates to a backend this runtime lacks (found before loading), or a
            state's new value of another dtype or shape than the state (a decomposed
            method: see :mod:`passes.executorch.state_writes`).
        ParameterMutationOnExecuTorchError: a method writes a parameter.
        PortableKernelAbortError: a method keeps at the top level a quantize or dequantize
            whose ExecuTorch kernel would abort the process (a bfloat16 float side, a
            per-channel quantize of float32 scales or int32 zero points).
        NonContiguousStateError: a buffer that is not contiguous (lowered contiguous, a
            note says so) is read by an op computing by strides (``as_strided``).
        StatePastEndError: a call writes a buffer past its end (more decode calls than the
            cache holds), found before lowering, where the runtime would fail with 0x12.
        UnpairedStateError: a method's output looks like one of its inputs' next value,
            and no pairing says whether it is (naming the method, input and output).
        StateNameError, StatePairingError: a pairing naming no input or output of a
            method, or pairing tensors of another shape or dtype.
    """
    programs = _checked_programs(programs)
    flat_calls = _flat_calls(programs, calls)
    pairs = {method: runtime_pairs(HELPER, program, method_pairing(
        next_values, method, list(programs)), pair_by_name, method)
        for method, program in programs.items()}
    check_writes_within_state(HELPER, programs, flat_calls,
                              lambda step, method: f"calls[{step}] ({method!r})", pairs)
    start = time.perf_counter()
    lowered = _lower_methods(programs, partitioner, helper=HELPER)
    seconds = time.perf_counter() - start
    pte = lowered.pte
    refuse_missing_backends(HELPER, lowered.backends)
    refuse_missing_operators(HELPER, pte, lowered.serialized)
    loaded = Runtime.get().load_program(pte)
    # Every method up front: loading one writes the shared buffers' initial values, which
    # must not land on state an earlier call wrote. (The pybind Module of
    # portable_lib gives each method arenas of its own: the decode would not see the
    # prefill's cache.)
    methods = {name: loaded.load_method(name) for name in sorted(loaded.method_names)}
    run = MethodsRun(memory=planned_state(pte),
                     notes=lowered.dropped + list(lowered.wrapper.notes) + lowered.repaired,
                     delegates=lowered.delegates, lower_seconds=seconds, pte_bytes=len(pte))
    state = CarriedState(HELPER)
    for index, (method, flat) in enumerate(flat_calls):
        meta = methods[method].metadata
        if len(flat) != meta.num_inputs():
            declared = [list(meta.input_tensor_meta(i).sizes())
                        for i in range(meta.num_inputs())]
            raise ExecuTorchInputError(
                HELPER, f"calls[{index}]", f"gives {len(flat)} input(s); method {method!r} "
                f"of the .pte takes {meta.num_inputs()} ({declared})")
        outputs = methods[method].execute(state.inputs(flat))
        returned, written = state.update(f"calls[{index}]", flat, outputs,
                                         lowered.carried[method], lowered.input_names[method],
                                         pairs[method])
        run.outputs.append(returned)
        run.carried.append(written)
        run.methods.append(method)
    run.notes += state.notes
    return run
