"""What a ``.pte`` program plans in memory, read from its execution plan.

ExecuTorch's memory planner places every mutable buffer (a KV cache) in a planned arena;
the serialized plan gives each one's dtype, shape and place, and, when the program was
emitted with names (:func:`passes.executorch.runtime.lower_to_pte` does), its FQN.
:func:`planned_memory` reads them, so that the bytes a device holds for its state are
measured from the program it will load, not assumed from the Python program.

Several methods of one program (:func:`passes.executorch.run_methods_on_runtime`) may share
their mutable buffers: planned with ``MemoryPlanningPass(share_mutable_buffers=True)``, a
buffer every method places at the same spot of the state arena is held once;
:func:`planned_state` reads every method's plan and says which buffers are shared and what
the state takes in all.

Example:
    >>> pte, _, _ = lower_to_pte(program, example_inputs)
    >>> planned_memory(pte).mutable_buffer_bytes
    1024
"""

from __future__ import annotations

from dataclasses import dataclass, field

from executorch.exir._serialize._program import deserialize_pte_binary
from executorch.exir.scalar_type import ScalarType
from executorch.exir.schema import Tensor, TensorDataLocation
from executorch.exir.tensor import get_scalar_type

__all__ = ["MemoryPlan", "PlannedBuffer", "StatePlan", "planned_memory", "planned_state"]

# ExecuTorch plans activations in arena 1 of each method; with share_mutable_buffers it
# places the shared state in arena 2, which the runtime gives every method alike.
SHARED_STATE_ARENA = 2


@dataclass(frozen=True)
class PlannedBuffer:
    """One mutable buffer of an execution plan.

    Attributes:
        name: its FQN (None when the program was emitted without names).
        value: its index among the plan's values.
        dtype: its element type, as torch names it (``"int8"``, ``"float32"``).
        shape: its sizes.
        nbytes: the bytes the planner gives it.
        memory_id: the planned arena holding it.
        offset: its offset in that arena.
    """

    name: str | None
    value: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    memory_id: int
    offset: int


@dataclass
class MemoryPlan:
    """The planned memory of one method: its mutable buffers and its arenas' sizes."""

    method: str
    mutable_buffers: list[PlannedBuffer] = field(default_factory=list)
    arena_bytes: list[int] = field(default_factory=list)

    @property
    def mutable_buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.mutable_buffers)

    def by_name(self) -> dict[str, PlannedBuffer]:
        return {b.name: b for b in self.mutable_buffers if b.name is not None}


def _is_mutable_buffer(tensor: Tensor) -> bool:
    """Planned (an arena place) and state: named as a mutable buffer, or carrying the
    initial value ExecuTorch serializes for an initialized mutable buffer."""
    if tensor.allocation_info is None:
        return False
    info = tensor.extra_tensor_info
    if info is not None and info.fully_qualified_name is not None:
        return info.location == TensorDataLocation.SEGMENT
    return tensor.data_buffer_idx > 0


def planned_memory(pte: bytes, method: str = "forward") -> MemoryPlan:
    """The mutable buffers ``method`` of the ``.pte`` program ``pte`` plans, and its arenas.

    Raises:
        KeyError: the program has no method ``method``.
    """
    program = deserialize_pte_binary(pte).program
    plans = {plan.name: plan for plan in program.execution_plan}
    if method not in plans:
        raise KeyError(f"no method {method!r} in the program (it has {sorted(plans)})")
    plan = plans[method]
    found = MemoryPlan(method, arena_bytes=list(plan.non_const_buffer_sizes[1:]))
    for index, value in enumerate(plan.values):
        tensor = value.val
        if not isinstance(tensor, Tensor) or not _is_mutable_buffer(tensor):
            continue
        dtype = get_scalar_type(ScalarType(tensor.scalar_type))
        numel = 1
        for size in tensor.sizes:
            numel *= size
        info = tensor.extra_tensor_info
        found.mutable_buffers.append(PlannedBuffer(
            info.fully_qualified_name if info is not None else None, index,
            str(dtype).removeprefix("torch."), tuple(tensor.sizes), numel * dtype.itemsize,
            tensor.allocation_info.memory_id, tensor.allocation_info.memory_offset))
    return found


@dataclass
class StatePlan:
    """The mutable buffers of every method of a ``.pte``, and which the methods share.

    Attributes:
        methods: each method's :class:`MemoryPlan`.
        shared: the buffers (by FQN) that several methods place at one spot of the shared
            state arena, with that placement.
    """

    methods: dict[str, MemoryPlan] = field(default_factory=dict)
    shared: dict[str, PlannedBuffer] = field(default_factory=dict)

    @property
    def shared_bytes(self) -> int:
        """What the shared buffers take, once for all methods."""
        return sum(b.nbytes for b in self.shared.values())

    @property
    def state_bytes(self) -> int:
        """What every method's mutable buffers take in all, a shared buffer counted once."""
        own = sum(b.nbytes for plan in self.methods.values() for b in plan.mutable_buffers
                  if b.name not in self.shared)
        return own + self.shared_bytes


def planned_state(pte: bytes) -> StatePlan:
    """Every method's planned mutable buffers in the ``.pte`` program ``pte``, and the ones
    they share (the program must have been emitted with names, as
    :func:`passes.executorch.run_methods_on_runtime` does, to tell buffers apart)."""
    program = deserialize_pte_binary(pte).program
    found = StatePlan({plan.name: planned_memory(pte, plan.name)
                       for plan in program.execution_plan})
    places: dict[str, set[tuple[int, int, int]]] = {}
    users: dict[str, int] = {}
    for plan in found.methods.values():
        for buffer in plan.mutable_buffers:
            if buffer.name is None:
                continue
            places.setdefault(buffer.name, set()).add(
                (buffer.memory_id, buffer.offset, buffer.nbytes))
            users[buffer.name] = users.get(buffer.name, 0) + 1
    for plan in found.methods.values():
        for buffer in plan.mutable_buffers:
            if (buffer.name is not None and users[buffer.name] > 1
                    and len(places[buffer.name]) == 1
                    and buffer.memory_id == SHARED_STATE_ARENA):
                found.shared.setdefault(buffer.name, buffer)
    return found
