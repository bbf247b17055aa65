"""Which mutable buffers hold only values of one quantization grid, and how much they store.

:func:`plan_quantized_state` decides, per mutable floating-point buffer, whether every
write stores values of one :class:`~passes._analysis.grids.Grid` (through data movement,
:mod:`passes._analysis.grid_flow`) and its contents lie on that grid now and at the kept
initial value; if so the buffer can hold the grid's integers and the program compute exactly
what it did. Otherwise the plan says why it stays float. :func:`state_storage` reports the
dtype and bytes of each mutable buffer of a program, quantized or not.

State the program carries in user inputs it mutates in place is planned like a buffer
(its writes' grid is read the same way; the caller's tensors have no contents to check),
but stored as integers only when asked (``carried_state``): the caller then passes
integers. A buffer a stateful delegate will own stays in a dtype that delegate takes
(:data:`FLOAT_STATE_OWNERS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Node

from ..errors import QuantizedStateError
from .buffers import (
    BUFFER,
    CONSTANT,
    GRID_META,
    INITIAL_META,
    PARAMETER,
    USER_INPUT,
    Mutations,
    buffer_tensor,
    find_mutations,
)
from .grid_flow import IN_PLACE_WRITES, WILD, GridFlow, Refusal, is_element_view
from .grids import Grid
from .marked_state import fill_value
from .op_schema import argument_value

__all__ = [
    "FLOAT_STATE_OWNERS",
    "NO_GRID",
    "BufferPlan",
    "StateStorage",
    "Write",
    "plan_quantized_state",
    "state_storage",
]

FLOAT_STATE_OWNERS = {
    "coreml": "Core ML keeps state as float only (float16 on device; it casts float32 "
              "state to float16)",
}
"""Stateful delegates that take the mutable buffers they own only as floating point, by the
owner name :class:`~passes.QuantizeMutableBuffers` takes (``state_owner``): what they take.
ExecuTorch's ``CoreMLPartitioner(take_over_mutable_buffer=True)`` fails on integer state
(``slice_update ... update has dtype int8 whereas x has dtype fp32``)."""


NO_GRID = "no write stores a dequantized value"
"""Why a buffer whose writes lie on any grid (zeros, its own contents) stays float alone."""


@dataclass(frozen=True)
class Write:
    """One write of a buffer: an in-place ``node`` writing ``value`` into one of its
    aliases, or (``output`` = its index among the outputs) a ``BUFFER_MUTATION`` output."""

    node: Node
    value: Any
    output: int | None = None

    def __str__(self) -> str:
        if self.output is None:
            return self.node.name
        return "its mutation output"


@dataclass
class BufferPlan:
    """What to do with one mutable buffer.

    Attributes:
        fqn: the buffer's name.
        root: its storage root in the graph (its first node).
        nodes: every node denoting it (placeholder or get_attr).
        tensor: the tensor holding it.
        writes: how the program writes it.
        grid: the grid its values lie on, when it can be stored as integers.
        reason: why it stays as it is, otherwise.
        skipped: True for state that is not floating point (nothing to quantize).
        fill: the one value every element holds (a fresh cache's zeros), or None.
        carried: True for a user input the program mutates in place (state the caller
            carries); ``tensor`` is then its fake value (dtype and shape, no contents).
        owner: the stateful delegate whose dtypes keep it float (``"coreml"``), when
            that is why it stays float.
    """

    fqn: str
    root: Node
    nodes: list[Node]
    tensor: torch.Tensor
    writes: list[Write] = field(default_factory=list)
    grid: Grid | None = None
    reason: str | None = None
    skipped: bool = False
    fill: torch.Tensor | None = None  # the one value the buffer holds, when it holds one
    carried: bool = False
    owner: str | None = None
    _candidates: list[Grid] = field(default_factory=list, repr=False)

    def refuse(self, reason: str) -> None:
        self.grid, self.reason, self._candidates = None, reason, []

    @property
    def label(self) -> str:
        """How notes and errors name it: ``input 'cache'`` or the buffer's FQN."""
        return f"input {self.fqn!r}" if self.carried else self.fqn


def resolver(program: Any, scan: Mutations) -> Any:
    """``resolve(node)``: the tensor a constant, parameter or buffer node holds (or None)."""
    def resolve(node: Node) -> torch.Tensor | None:
        state = scan.states.get(node)
        if state is None or state.kind not in (CONSTANT, BUFFER, PARAMETER):
            return None
        try:
            return buffer_tensor(program, state.name)
        except (KeyError, AttributeError):
            return None
    return resolve


def _writes(program: Any, scan: Mutations, state: Any, plan: BufferPlan) -> None:
    """Fill ``plan.writes``, or refuse the buffer for a write that is not data movement."""
    outputs: dict[Node, list[int]] = {}
    mutation = OutputKind.USER_INPUT_MUTATION if plan.carried else OutputKind.BUFFER_MUTATION
    if isinstance(program, ExportedProgram):
        values = program.graph.output_node().args[0]
        for i, (spec, value) in enumerate(zip(program.graph_signature.output_specs, values,
                                              strict=True)):
            if spec.kind == mutation and spec.target == plan.fqn:
                outputs.setdefault(value, []).append(i)
    for node in scan.writers.get(state, []):
        if node is None or node in outputs:
            continue  # a BUFFER_MUTATION output's value
        index = IN_PLACE_WRITES.get(node.target)
        if index is None:
            target = getattr(node.target, "__name__", node.target)
            return plan.refuse(f"written by {node.name} ({target}), which computes the new "
                               "value: not a store of quantized values")
        if index == 2 and argument_value(node, node.target._schema, 3):
            return plan.refuse(f"written by {node.name}, which accumulates into it")
        plan.writes.append(Write(node, argument_value(node, node.target._schema, index)))
    output = program.graph.output_node() if outputs else None
    plan.writes += [Write(output, value, i) for value, found in outputs.items() for i in found]
    return None


def _candidates(flow: GridFlow, plan: BufferPlan) -> None:
    """Propose the buffer's grid from its writes (its own contents: any grid)."""
    proposed: Any = WILD
    for write in plan.writes:
        if write.output is None:
            result = flow.written_into(write.node, flow.grid(write.node.args[0]), write.value)
        else:
            result = flow.grid(write.value)
        if isinstance(result, Refusal):
            return plan.refuse(f"written by {write}: {result}")
        if result is WILD:
            continue
        if proposed is not WILD and not proposed.same_levels(result):
            return plan.refuse(f"written on two grids: {proposed.describe()} and "
                               f"{result.describe()} (by {write})")
        proposed = proposed if proposed is not WILD else result
    if proposed is WILD:
        return plan.refuse(NO_GRID)
    tensor = plan.tensor
    if tensor.dtype != proposed.out_dtype:
        return plan.refuse(f"its dtype {tensor.dtype} is not the grid's {proposed.out_dtype}")
    axes = [None] if not proposed.per_channel else [
        a for a in range(tensor.dim()) if tensor.shape[a] == proposed.scale.numel()]
    candidates = [proposed.on_axis(a) for a in axes]
    if plan.carried:  # the caller's tensors: no contents here to check
        plan._candidates = candidates[1:]
        plan.grid = candidates[0] if candidates else None
        if plan.grid is None:
            plan.refuse(f"no dim of its shape {tuple(tensor.shape)} holds the "
                        f"{proposed.scale.numel()} channels of {proposed.describe()}")
        return None
    initial = next((n.meta[INITIAL_META] for n in plan.nodes
                    if n.meta.get(INITIAL_META) is not None), None)
    plan.fill = fill_value(tensor)
    kept = None if initial is None else fill_value(initial)
    off: list[str] = []
    for grid in candidates:
        off = [what for what, value, fill in (("its contents", tensor, plan.fill),
                                              ("its initial value", initial, kept))
               if value is not None and not grid.holds(value, fill)]
        if not off:
            plan._candidates.append(grid)
    if not plan._candidates:
        return plan.refuse(f"{' and '.join(off)} not on the grid of its writes "
                           f"({proposed.describe()})")
    plan.grid = plan._candidates.pop(0)
    return None


def _verify(flow: GridFlow, plan: BufferPlan, views: list[Node]) -> str | None:
    """Why the buffer's writes do not all store values of its grid (None: they do)."""
    for write in plan.writes:
        if write.output is None:
            dest = flow.grid(write.node.args[0])
            result = flow.written_into(write.node, dest, write.value)
            expected = dest
        else:
            result, expected = flow.grid(write.value), plan.grid
        if isinstance(result, Refusal):
            return f"written by {write}: {result}"
        if not isinstance(expected, Grid) or not result.same(expected):
            return f"{write} writes values of {result.describe()}, not of its grid"
    for view in views:  # each read dequantizes where it reads: its grid must be known there
        found = flow.grid(view)
        if isinstance(found, Refusal):
            return f"read through {found}"
    return None


def plan_quantized_state(program: Any, carried_state: bool = False,
                         owners: dict[str, str] | None = None,
                         keep_float: Mapping[str, str] | None = None,
                         ) -> tuple[list[BufferPlan], GridFlow]:
    """A plan for every mutable buffer and mutated user input, and the grid flow the
    accepted grids verified.

    ``carried_state``: a user input the program mutates in place may be stored as integers
    (otherwise it stays float, the plan saying why). ``owners``: buffer FQN -> the stateful
    delegate (a key of :data:`FLOAT_STATE_OWNERS`) that will own it: it stays float.
    ``keep_float``: buffer FQN -> why it stays float whatever its writes here (another
    method of the model writes it off every grid); a buffer whose writes read it then
    stays float too.

    Raises:
        QuantizedStateError: a buffer recorded as quantized whose tensor is float, or a
            malformed quantize/dequantize node on the way to a write.
    """
    scan = find_mutations(program)
    aliases = scan.aliases
    names = {aliases[n].root: f"{s.kind} {s.name!r}" for n, s in scan.states.items()
             if n in aliases}
    plans: list[BufferPlan] = []
    for state in scan.writers:
        if state.kind not in (BUFFER, USER_INPUT):
            continue
        nodes = scan.nodes_of(state)
        if not nodes:
            continue
        if state.kind == USER_INPUT:
            tensor = nodes[0].meta.get("val")
            if not isinstance(tensor, torch.Tensor):
                continue  # no fake value: nothing says what the caller passes
        else:
            tensor = buffer_tensor(program, state.name)
        plan = BufferPlan(state.name, aliases[nodes[0]].root, nodes, tensor,
                          carried=state.kind == USER_INPUT)
        plans.append(plan)
        recorded = next((n.meta[GRID_META] for n in nodes if GRID_META in n.meta), None)
        if recorded is not None and plan.tensor.dtype != recorded.dtype:
            raise QuantizedStateError(nodes[0].name, f"buffer {state.name!r} is recorded as "
                                      f"stored on {recorded.describe()} but holds "
                                      f"{plan.tensor.dtype}")
        if not plan.tensor.is_floating_point():
            plan.skipped = True
            plan.reason = (f"stored as integers on {recorded.describe()}" if recorded
                           else f"{plan.tensor.dtype} state, not floating point")
            continue
        _writes(program, scan, state, plan)
        if plan.reason is None and state.name in (keep_float or {}):
            plan.refuse(keep_float[state.name])
    _refuse_shared_storage(program, [p for p in plans if p.reason is None and not p.carried])
    _refuse_reinterpreted(scan, [p for p in plans if p.reason is None])
    resolve = resolver(program, scan)
    live = [p for p in plans if p.reason is None]
    proposing = GridFlow(aliases, {p.root: WILD for p in live}, names, scan.written_roots,
                         resolve)
    for plan in live:
        _candidates(proposing, plan)
        if plan.grid is not None:
            _keep_float_for_its_owner(plan, carried_state, owners or {})
    views: dict[Node, list[Node]] = {p.root: [] for p in live}
    for node, alias in aliases.items():
        if alias.root in views and node.users:
            views[alias.root].append(node)
    while True:  # drop the buffers whose writes read a buffer that stays float
        accepted = [p for p in plans if p.grid is not None]
        flow = GridFlow(aliases, {p.root: p.grid for p in accepted}, names,
                        scan.written_roots, resolve)
        failed = [(p, why) for p in accepted
                  if (why := _verify(flow, p, views[p.root])) is not None]
        if not failed:
            return plans, flow
        for plan, why in failed:
            if plan._candidates:
                plan.grid = plan._candidates.pop(0)
            else:
                plan.refuse(why)


def _keep_float_for_its_owner(plan: BufferPlan, carried_state: bool,
                              owners: dict[str, str]) -> None:
    """Refuse a plan whose storage as integers its owner would not take: the caller (state
    it carries, unless ``carried_state``) or the stateful delegate owning the buffer."""
    grid = plan.grid.describe()
    if plan.carried and not carried_state:
        plan.refuse(f"it is state the caller carries: its writes store values of {grid}, "
                    f"but storing it as integers changes the call signature (the caller "
                    f"would pass {str(plan.grid.dtype).removeprefix('torch.')}); pass "
                    "carried_state=True to store it so, or make it resident with "
                    "passes.InputsToBuffers")
    elif not plan.carried and plan.fqn in owners:
        owner = owners[plan.fqn]
        plan.refuse(f"{owner} will own it: {FLOAT_STATE_OWNERS[owner]}, so it stays float "
                    f"(its writes store values of {grid})")
        plan.owner = owner


def _held_tensors(program: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the program holds, by each name it holds it under."""
    if isinstance(program, ExportedProgram):
        return [*program.state_dict.items(), *program.constants.items()]
    return [*program.named_buffers(remove_duplicate=False),
            *program.named_parameters(remove_duplicate=False)]


def _refuse_shared_storage(program: Any, plans: list[BufferPlan]) -> None:
    """A buffer whose storage the program also holds under another name (an aliased
    buffer) keeps its dtype: storing integers in one name would leave the other float."""
    names: dict[int, set[str]] = {}
    for name, tensor in _held_tensors(program):
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
            names.setdefault(tensor.untyped_storage().data_ptr(), set()).add(name)
    for plan in plans:
        others = names.get(plan.tensor.untyped_storage().data_ptr(), set()) - {plan.fqn}
        if others:
            plan.refuse(f"shares its storage with {', '.join(map(repr, sorted(others)))}")


def _refuse_reinterpreted(scan: Mutations, plans: list[BufferPlan]) -> None:
    """A buffer seen through an op that is neither an element view nor a write we rewrite
    (a ``view(dtype)``) cannot change its dtype underneath that op."""
    by_root = {p.root: p for p in plans}
    writes = {w.node for p in plans for w in p.writes}
    for node, alias in scan.aliases.items():
        plan = by_root.get(alias.root)
        if plan is None or node in plan.nodes or node in writes or is_element_view(node):
            continue
        if plan.reason is None:
            plan.refuse(f"{node.name} ({node.target}) sees its storage other than as elements")


@dataclass(frozen=True)
class StateStorage:
    """How one mutable buffer is stored: dtype, bytes, and its grid when quantized."""

    dtype: torch.dtype
    nbytes: int
    grid: Grid | None = None


def state_storage(program: Any) -> dict[str, StateStorage]:
    """The dtype and bytes of every mutable buffer ``program`` holds, by FQN (its grid when
    QuantizeMutableBuffers stores it as integers). Call it before and after the pass."""
    scan = find_mutations(program)
    found: dict[str, StateStorage] = {}
    for state in scan.writers:
        if state.kind != BUFFER:
            continue
        tensor = buffer_tensor(program, state.name)
        grid = next((n.meta[GRID_META] for n in scan.nodes_of(state) if GRID_META in n.meta),
                    None)
        found[state.name] = StateStorage(tensor.dtype, tensor.numel() * tensor.element_size(),
                                         grid)
    return found
