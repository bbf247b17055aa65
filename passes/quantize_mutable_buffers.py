"""QuantizeMutableBuffers: a buffer holding only quantized values stores them as integers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, Node
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from pass_manager import Effects, Pass, PassResult, graph_module_of
from pass_manager.collector import collector_paused

from ._analysis.aliasing import aliased_argument
from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.buffers import (
    BUFFER,
    GRID_META,
    INITIAL_META,
    find_mutations,
    named_output_specs,
    replace_buffer_tensor,
    trailing_write_backs,
)
from ._analysis.data_movement import DataMovementNotAnnotated
from ._analysis.fake_values import FakeValues
from ._analysis.frozen_reads import NoFrozenMutableBuffers
from ._analysis.grid_flow import FUNCTIONAL_WRITES, MOVES, SELECTS, GridFlow, value_operands
from ._analysis.grids import Grid, dequantize_grid, quantize_grid
from ._analysis.marked_state import initial_copy
from ._analysis.op_schema import argument_value
from ._analysis.quantized_state import (
    FLOAT_STATE_OWNERS,
    BufferPlan,
    plan_quantized_state,
    resolver,
)
from ._carried.pairs import Pair, pairs_of, suspected_pairs
from .buffers_to_inputs import BuffersToInputs
from .errors import QuantizedStateError, StateOwnerError
from .inputs_to_buffers import InputsToBuffers

__all__ = ["QuantizeMutableBuffers", "QuantizedStateError", "StateOwnerError",
           "state_owner_of"]

_NAME = "QuantizeMutableBuffers"
# Buffers are replaced by new tensors, never written in place; of existing nodes only the
# fake values and the buffers' kept initial value and grid change.
_IN_PLACE = Effects.rewrite(meta_keys=(INITIAL_META, GRID_META, "val", "tensor_meta"))
# Storing paired state as integers changes the call signature: a new program.
_NEW_PROGRAM = Effects.rewrite(in_place=None)

_QUANTIZE = (torch.ops.quantized_decomposed.quantize_per_tensor.default,
             torch.ops.quantized_decomposed.quantize_per_channel.default)
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn", "from_node")


@dataclass(frozen=True, repr=False)
class QuantizeMutableBuffers(Pass):
    """Store each mutable buffer whose every write stores values of one quantization grid
    as that grid's integers; the program computes exactly what it did.

    Runs on a converted program (``convert_pt2e`` + UnfreezeMutableBuffer, the GraphModule
    torchao returns, or that program re-exported and functionalized). A buffer qualifies
    when each write stores ``dequantize(q, scale, zero_point, quant_min, quant_max,
    dtype)`` of one grid, or data movement of such values (views, ``cat``, ``index_copy``,
    ``index_put``, ``slice_scatter``, ``copy_``, ``where(mask, new, buffer)``, the buffer's
    own contents included; one
    channel axis per channel for ``dequantize_per_channel``), or zeros (``zero_()``,
    ``fill_(0)``, ``zeros_like``, ...: the grid's zero point dequantizes to ``+0.0``), and
    its contents and the
    initial value ``MarkMutableBuffers`` kept lie on that grid bit for bit. Such a buffer
    then holds the integers: each write stores the same data movement applied to ``q``,
    each read dequantizes it right where the float buffer was read, and a read that is
    re-quantized onto the same grid reads the integers. Any other buffer (an accumulator,
    two grids, a value computed after the dequantize) stays float, and the notes and
    statistics say why. The marks follow: ``mutable_buffers`` reports the grid,
    ``reset_mutable_buffers`` restores the integer initial value.

    State the caller carries, a user input the program mutates in place (transformers'
    exporter passes its KV caches so; a ``USER_INPUT_MUTATION`` output once functional),
    is read the same way but stays float unless ``carried_state=True``: stored as integers,
    the caller passes (and gets written back) integers instead of floats, a change of the
    call signature the notes and statistics name (input, old dtype -> new dtype;
    ``mutable_buffers(program)[name].grid.quantize(x)`` gives what to pass for float
    state ``x``). Otherwise the notes say why it stays float. A buffer a stateful delegate
    will own stays in a dtype that delegate takes (``state_owner``: Core ML keeps state as
    float only, and fails to lower integer state).

    State carried as an input/output pair (the program returns an input's next value
    instead of writing it, as static-shape backends take state) is stored as integers when
    paired (``next_values`` / ``pair_by_name``, as :class:`~passes.InputsToBuffers` takes
    them) and ``carried_state=True``: the input and its output become the grid's integers
    (InputsToBuffers makes the pair a buffer, rewritten as any buffer, BuffersToInputs puts
    it back; the pass then returns a new program), the notes and statistics name the
    signature change. Otherwise, and for an input and output that only look paired (the
    rules of :mod:`passes._carried.pairs`), the pair stays float and the notes say why.

    Requires MutableBuffersMarked; may touch the buffers' tensors (replaced, never written
    in place), their nodes' ``val``, kept initial value and grid, and the nodes reading or
    writing them.

    Example (GraphModule form, an int8 grid ``g``)::

        before:  %q = quantize_per_tensor(%k, *g)
                 %dq = dequantize_per_tensor(%q, *g)
                 %index_copy_ = aten.index_copy_(%k_cache, 2, %pos, %dq)     # float32
                 %t = aten.transpose(%index_copy_, 2, 3)
                 %matmul = aten.matmul(%x, %t)
        after:   %q = quantize_per_tensor(%k, *g)
                 %index_copy_ = aten.index_copy_(%k_cache, 2, %pos, %q)      # int8
                 %t = aten.transpose(%index_copy_, 2, 3)
                 %dq_t = dequantize_per_tensor(%t, *g)
                 %matmul = aten.matmul(%x, %dq_t)

    Args:
        strict: raise :class:`QuantizedStateError` when a floating-point mutable buffer
            (or mutated input) must stay float, instead of leaving it float with a note.
        carried_state: also store a mutated user input holding values of one grid as
            that grid's integers; the caller then passes integer tensors.
        state_owner: the stateful delegate that will own the mutable buffers, one of
            :data:`~passes._analysis.quantized_state.FLOAT_STATE_OWNERS` (``"coreml"``
            for ``CoreMLPartitioner(take_over_mutable_buffer=True)``;
            :func:`state_owner_of` reads it from a partitioner): the buffers it owns stay
            in a dtype it takes, each with a note naming the buffer and the owner.
        owned_buffers: the FQNs of the buffers ``state_owner`` will own; None: every
            mutable buffer.
        next_values: ``{input name: output name}``: state carried as input/output pairs
            (``{}``: none); stored as integers with ``carried_state``.
        pair_by_name: ``(input prefix, output prefix)`` pairing inputs and outputs by name.
        keep_float: ``{buffer FQN: why}``: buffers that stay float whatever their writes
            here, the note giving the reason (``quantize_methods`` keeps float, in every
            method, a buffer another method of the model writes off the grid).

    Raises:
        QuantizedStateError: a malformed quantize/dequantize node on the way to a buffer
            write, a buffer recorded as quantized whose tensor is float, an unknown
            ``state_owner`` or ``owned_buffers`` name, or (``strict``) a buffer or mutated
            input that stays float. The program is left unchanged.
        StateOwnerError: (``strict``) a buffer that could be stored as integers, which
            ``state_owner`` takes only as float. The program is left unchanged.
        StateNameError: ``next_values`` names no input or output of the program.
        StatePairingError: ``next_values`` pairs an input with an output of another
            shape or dtype.
    """

    requires = frozenset({MutableBuffersMarked})
    preserves = frozenset({MutableBuffersMarked, Functional, NoFrozenMutableBuffers,
                           DataMovementNotAnnotated})
    strict: bool = False
    carried_state: bool = False
    state_owner: str | None = None
    owned_buffers: tuple[str, ...] | None = None
    next_values: Mapping[str, str] | None = None
    pair_by_name: tuple[str, str] | None = None
    keep_float: Mapping[str, str] | None = None

    @property
    def effects(self) -> Effects:  # type: ignore[override]
        """In place, but a new program when it stores paired state (the call signature
        changes: InputsToBuffers, then BuffersToInputs)."""
        return _NEW_PROGRAM if self._stores_pairs() else _IN_PLACE

    def _stores_pairs(self) -> bool:
        return self.carried_state and bool(self.next_values or self.pair_by_name)

    def call(self, program: Any) -> PassResult:
        owners = self._owners(program)
        with collector_paused():  # nothing it allocates is garbage before it returns
            pairs, notes, statistics = self._pairs(program)
            target = _resident(program, pairs) if pairs else program
            plans, flow = plan_quantized_state(target, self.carried_state, owners,
                                               self.keep_float)
            by_buffer = {_paired_buffer(pair): pair for pair in pairs}
            more_notes, more_statistics = _report(
                [p for p in plans if p.fqn not in by_buffer])
            notes += more_notes
            statistics.update(more_statistics)
            for plan in plans:
                if plan.fqn in by_buffer:
                    _report_pair(plan, by_buffer[plan.fqn], notes, statistics)
            refused = [p for p in plans if p.grid is None and not p.skipped]
            if self.strict and refused:
                plan = refused[0]
                if plan.fqn in by_buffer:
                    _refuse_pair(by_buffer[plan.fqn], plan.reason)
                _refuse(plan)
            accepted = [p for p in plans if p.grid is not None]
            if accepted:
                _Rewrite(target, accepted, flow).run()
            if not accepted:
                return PassResult(program, False, notes, statistics)
            if pairs:  # the paired state back in the call signature, now as integers
                target = BuffersToInputs(buffers=list(by_buffer)).call(target).program
                _quantized_examples(target, {by_buffer[p.fqn].input: p.grid
                                             for p in accepted if p.fqn in by_buffer})
            # Inputs written in place now stored as integers: the example inputs say so too.
            _quantized_examples(target, {_user_input_index(target, p.root.name): p.grid
                                         for p in accepted if p.carried})
        return PassResult(target, True, notes, statistics)

    def _pairs(self, program: Any) -> tuple[list[Pair], list[str], Counter]:
        """The pairs to store as integers (given, with ``carried_state``), and notes on
        the ones left float (given without ``carried_state``, or only suspected)."""
        notes: list[str] = []
        statistics: Counter = Counter()
        if self.next_values is None and self.pair_by_name is None:
            found, given = suspected_pairs(program), False
        else:
            found, given = pairs_of(program, self.next_values, self.pair_by_name,
                                    _NAME), True
        if given and self.carried_state:
            return found, notes, statistics
        for pair in found:
            reason = (
                "it is state the caller carries as an input/output pair; storing it as "
                "integers changes the call signature (the caller would pass integers and get "
                "them back): pass carried_state=True to store it so, or make it resident "
                "with passes.InputsToBuffers" if given else
                f"it looks like state carried as an input/output pair ({pair.why}); pass "
                f"next_values={{{pair.input_name!r}: {pair.output_name!r}}} with "
                "carried_state=True to store the pair as integers")
            if self.strict:
                _refuse_pair(pair, reason)
            statistics["inputs left float"] += 1
            statistics[f"input {pair.input_name!r}: left float"] = 1
            notes.append(f"input {pair.input_name!r} (output {pair.output_name!r} returns "
                         f"its next value): stays float: {reason}")
        return [], notes, statistics

    def _owners(self, program: Any) -> dict[str, str]:
        """Buffer FQN -> the stateful delegate that will own it."""
        if self.state_owner is None:
            return {}
        if self.state_owner not in FLOAT_STATE_OWNERS:
            known = ", ".join(map(repr, sorted(FLOAT_STATE_OWNERS)))
            raise QuantizedStateError(str(self.state_owner), f"state_owner "
                                      f"{self.state_owner!r} is not a stateful delegate it "
                                      f"knows ({known})")
        buffers = _mutable_buffer_names(program)
        if self.owned_buffers is None:
            return dict.fromkeys(buffers, self.state_owner)
        unknown = [name for name in self.owned_buffers if name not in buffers]
        if unknown:  # a misspelt name would leave the buffer it meant stored as integers
            raise QuantizedStateError(unknown[0], f"owned_buffers names {unknown[0]!r}, not a "
                                      f"mutable buffer of the program ({', '.join(buffers)})")
        return dict.fromkeys(self.owned_buffers, self.state_owner)

    @classmethod
    def for_partitioner(cls, partitioner: Any, **options: Any) -> QuantizeMutableBuffers:
        """The pass for a program ``partitioner`` will lower: ``state_owner`` read from it
        (:func:`state_owner_of`), the other options as given."""
        return cls(state_owner=state_owner_of(partitioner), **options)


def state_owner_of(partitioner: Any) -> str | None:
    """The stateful delegate (a key of ``FLOAT_STATE_OWNERS``) that ``partitioner`` makes own
    the mutable buffers, or None: ``"coreml"`` for ExecuTorch's
    ``CoreMLPartitioner(take_over_mutable_buffer=True)``, also wrapped (an object holding
    it as ``.partitioner``, as ``BufferOwningPartitioner`` does)."""
    seen: set[int] = set()
    while partitioner is not None and id(partitioner) not in seen:
        seen.add(id(partitioner))
        kind = type(partitioner)
        if kind.__name__ == "CoreMLPartitioner" and kind.__module__.startswith(
                "executorch.backends.apple.coreml"):
            return "coreml" if getattr(partitioner, "take_over_mutable_buffer", False) else None
        partitioner = getattr(partitioner, "partitioner", None)
    return None


def _mutable_buffer_names(program: Any) -> list[str]:
    return [state.name for state in find_mutations(program).writers if state.kind == BUFFER]


def _refuse(plan: BufferPlan) -> None:
    """Raise the strict refusal of a plan that stays float."""
    if plan.owner is not None:
        raise StateOwnerError(plan.fqn, plan.owner, f"buffer {plan.fqn!r} stays float: "
                              f"{plan.reason}")
    what = f"input {plan.fqn!r}" if plan.carried else f"buffer {plan.fqn!r}"
    raise QuantizedStateError(plan.fqn, f"{what} stays float: {plan.reason}")


def _report(plans: list[BufferPlan]) -> tuple[list[str], Counter]:
    notes, statistics = [], Counter()
    for plan in plans:
        if plan.carried:
            _report_carried(plan, notes, statistics)
            continue
        before = plan.tensor.numel() * plan.tensor.element_size()
        if plan.grid is not None:
            after = plan.tensor.numel() * plan.grid.dtype.itemsize
            statistics["buffers stored as integers"] += 1
            statistics["state bytes before"] += before
            statistics["state bytes after"] += after
            statistics[f"{plan.fqn}: bytes {_name(plan.tensor.dtype)}"] = before
            statistics[f"{plan.fqn}: bytes {_name(plan.grid.dtype)}"] = after
            notes.append(f"{plan.fqn}: {_name(plan.tensor.dtype)} -> {_name(plan.grid.dtype)} "
                         f"({before} -> {after} bytes) on {plan.grid.describe()}")
        elif plan.skipped:
            notes.append(f"{plan.fqn}: left as it is ({plan.reason})")
        else:
            statistics["buffers left float"] += 1
            statistics["state bytes before"] += before
            statistics["state bytes after"] += before
            statistics[f"{plan.fqn}: left float"] = 1
            if plan.owner is not None:
                statistics[f"{plan.fqn}: kept float for {plan.owner}"] = 1
            notes.append(f"{plan.fqn}: stays {_name(plan.tensor.dtype)}: {plan.reason}")
    return notes, statistics


def _report_carried(plan: BufferPlan, notes: list[str], statistics: Counter) -> None:
    """A mutated user input: the call signature changed, or why it did not."""
    label = plan.label
    _report_signature_state(
        plan, label, [label], notes, statistics, "stays",
        lambda old, new: f"the caller passes {label} as {new} (was {old}), the grid's "
                         "integers of its state")


def _report_signature_state(plan: BufferPlan, label: str, keys: list[str], notes: list[str],
                            statistics: Counter, stays: str,
                            changed: Callable[[str, str], str]) -> None:
    """State in the call signature (a written input, or an input/output pair; ``keys``
    name its parts, the input first): stored as integers (the signature changed, as
    ``changed(old, new)`` says), or why not."""
    old = _name(plan.tensor.dtype)
    if plan.grid is not None:
        new = _name(plan.grid.dtype)
        statistics["inputs stored as integers"] += 1
        statistics["call signature changed"] = 1
        for key in keys:
            statistics[f"{key}: {old} -> {new}"] = 1
        notes.append(f"{label}: {old} -> {new} on {plan.grid.describe()}; the call signature "
                     f"changed: {changed(old, new)}")
    elif plan.skipped:
        notes.append(f"{label}: left as it is ({plan.reason})")
    else:
        statistics["inputs left float"] += 1
        statistics[f"{keys[0]}: left float"] = 1
        notes.append(f"{label}: {stays} {old}: {plan.reason}")


_PAIRED_BUFFERS = "_paired_state"
"""The module the paired inputs become buffers under while they are rewritten: their own
names may be taken (an input ``proj`` beside a module ``proj``), this path is the pass's."""


def _paired_buffer(pair: Pair) -> str:
    """The buffer a paired input is while it is rewritten (put back as the input after)."""
    return f"{_PAIRED_BUFFERS}.{pair.input_name}"


def _resident(program: Any, pairs: list[Pair]) -> Any:
    """``program`` with each paired input a resident buffer (zeros: the caller's values are
    not the program's to check), for the planning and rewrite buffers get."""
    nodes = _paired_inputs(program, pairs)
    zeros = {_paired_buffer(p): torch.zeros(nodes[p.input_name].meta["val"].shape,
                                            dtype=nodes[p.input_name].meta["val"].dtype)
             for p in pairs}
    return InputsToBuffers(buffers={p.input_name: _paired_buffer(p) for p in pairs},
                           next_values={p.input_name: p.output_name for p in pairs},
                           initial_values=zeros).call(program).program


def _quantized_examples(program: Any, grids: dict[int, Grid]) -> None:
    """An ExportedProgram's example inputs with each input now stored as integers given as
    its grid's integers (flat input position -> grid)."""
    if not isinstance(program, ExportedProgram) or program.example_inputs is None:
        return
    leaves, spec = pytree.tree_flatten(program.example_inputs)
    for index, grid in grids.items():
        if isinstance(leaves[index], torch.Tensor) and leaves[index].is_floating_point():
            leaves[index] = grid.quantize(leaves[index])
    program.example_inputs = pytree.tree_unflatten(leaves, spec)


def _user_input_index(program: Any, name: str) -> int:
    """The flat call position of the user input placeholder ``name`` (of an
    ExportedProgram; -1 for any other form, which keeps no example inputs)."""
    if not isinstance(program, ExportedProgram):
        return -1
    users = [s.arg.name for s in program.graph_signature.input_specs
             if s.kind == InputKind.USER_INPUT]
    return users.index(name)


def _paired_inputs(program: Any, pairs: list[Pair]) -> dict[str, Node]:
    """Each paired input's placeholder, by the pair's input name."""
    graph = graph_module_of(program).graph if not isinstance(
        program, ExportedProgram) else program.graph
    placeholders = graph.find_nodes(op="placeholder")
    if isinstance(program, ExportedProgram):
        users = set(program.graph_signature.user_inputs)
        placeholders = [n for n in placeholders if n.name in users]
    return {pair.input_name: placeholders[pair.input] for pair in pairs}


def _report_pair(plan: BufferPlan, pair: Pair, notes: list[str], statistics: Counter) -> None:
    """A paired input and output: the call signature changed, or why it did not."""
    _report_signature_state(
        plan, f"input {pair.input_name!r} and output {pair.output_name!r} (its next value)",
        [f"input {pair.input_name!r}", f"output {pair.output_name!r}"], notes, statistics,
        "stay",
        lambda old, new: f"the caller passes {pair.input_name} as {new} (was {old}) and "
                         f"gets output {pair.output_name} as {new}, the grid's integers")


def _refuse_pair(pair: Pair, reason: str | None) -> None:
    raise QuantizedStateError(pair.input_name, f"input {pair.input_name!r} (output "
                              f"{pair.output_name!r} returns its next value) stays float: "
                              f"{reason}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Rewrite:
    """The rewrite of one program for its accepted buffers (see the pass's docstring)."""

    def __init__(self, program: Any, plans: list[BufferPlan], flow: GridFlow):
        self.program, self.plans, self.flow = program, plans, flow
        self.gm = graph_module_of(program)
        self.graph: Graph = self.gm.graph
        scan = find_mutations(program)
        self.aliases = scan.aliases
        self.grids = {p.root: p for p in plans}
        self.alias_nodes: dict[Node, list[Node]] = {p.root: [] for p in plans}
        for node, alias in self.aliases.items():  # each buffer's nodes, views and writes
            if alias.root in self.alias_nodes:
                self.alias_nodes[alias.root].append(node)
        self.index = {n: i for i, n in enumerate(self.graph.nodes)}
        self.writers = {p.root: [self.index[w.node] for w in p.writes if w.output is None]
                        for p in plans}
        self.ints: dict[Node, Node] = {}
        self.storing: Grid | None = None  # the grid of the buffer a write stores into
        self.created: set[Node] = set()
        self.resolve = resolver(program, scan)
        self.stores = {w.node for p in plans for w in p.writes if w.output is None}
        self.kept_outputs = {w.output for p in plans for w in p.writes if w.output is not None}
        self.reads_integers: set[Node] = set()  # the readers of a quantize made direct
        self.constants: dict[str, Node] = {}  # get_attr nodes of per-channel scales
        write_backs = [] if isinstance(program, ExportedProgram) else trailing_write_backs(
            program)
        self.write_backs = set(write_backs)
        self.first_write_back = write_backs[0] if write_backs else None
        # Where each per-channel grid's scales and zero points are (taken before a rewrite
        # erases the dequantize nodes naming them).
        self.channel_sources = [(g, n.args[1:3]) for n, g in flow.sources if g.per_channel]

    def run(self) -> None:
        direct = self._direct_reads()  # decided before anything changes
        for plan in self.plans:  # every write stores the integers
            self.storing = plan.grid
            for write in plan.writes:
                self._store(write)
        for node, source, grid in direct:
            self.storing = grid  # a tensor of zeros it reads holds this grid's zero point
            self.reads_integers.update(node.users)
            node.replace_all_uses_with(self.int_of(source))
            self.graph.erase_node(node)
        self.storing = None
        self._float_reads_of_mirrored_nodes()
        self._drop_dead()
        for plan in self.plans:
            self._float_reads_of_buffer(plan)
        self._drop_dead()
        self._swap_tensors()
        self._refresh_values()
        if isinstance(self.program, ExportedProgram):
            self.program.graph_signature.output_specs[:] = named_output_specs(self.program)
        self.graph.lint()

    # -- integers of values -------------------------------------------------------------
    def _alias_plan(self, node: Node) -> BufferPlan | None:
        alias = self.aliases.get(node)
        return self.grids.get(alias.root) if alias is not None else None

    def int_of(self, node: Node) -> Node:
        """A node holding the integers of ``node``'s value on its grid, at its place."""
        if self._alias_plan(node) is not None:
            return node  # a quantized buffer, or a view of one: it holds the integers
        if node in self.ints:
            return self.ints[node]
        if dequantize_grid(node, self.resolve) is not None:
            self.ints[node] = node.args[0]
            return node.args[0]
        if node in self.flow.zero_fills:
            return self._zero_point_fill(node)
        schema = node.target._schema
        args, kwargs = list(node.args), dict(node.kwargs)
        for i in value_operands(node):
            value = argument_value(node, schema, i)
            new = [self.int_of(v) for v in value] if isinstance(value, (list, tuple)) else (
                self.int_of(value))
            if i < len(args):
                args[i] = new
            else:
                kwargs[schema.arguments[i].name] = new
        with self.graph.inserting_after(node):
            mirror = self._call(node.target, tuple(args), kwargs, like=node)
        self.ints[node] = mirror
        return mirror

    def _zero_point_fill(self, zeros: Node) -> Node:
        """The integers of a tensor of zeros on the grid being stored: its zero point (per
        channel: each channel's, along the channel axis the zeros have where they are
        used)."""
        grid = self.storing
        if grid is not None and grid.per_channel:
            return self._per_channel_zero_fill(zeros, grid)
        if grid is None:
            raise QuantizedStateError(zeros.name, "a tensor of zeros stored on no grid")
        value = zeros.meta["val"]
        size = zeros.args[0] if zeros.target is torch.ops.aten.zeros.default else list(
            value.shape)
        with self.graph.inserting_after(zeros):
            fill = self._call(torch.ops.aten.full.default, (size, int(grid.zero_point)),
                              {"dtype": grid.dtype, "device": value.device}, like=zeros)
        self.ints[zeros] = fill
        return fill

    def _per_channel_zero_fill(self, zeros: Node, grid: Grid) -> Node:
        """``quantize_per_channel`` of the zeros: each channel's zero point, the channel
        axis read from a user of the zeros that keeps their shape (the write the fresh
        cache is the destination of, a ``where``, a ``cat`` along another dim)."""
        value = zeros.meta.get("val")
        axes = set()
        for user in zeros.users:
            found = self.flow.grid(user)
            used = user.meta.get("val")
            if isinstance(found, Grid) and found.same_levels(grid) and isinstance(
                    used, torch.Tensor) and isinstance(value, torch.Tensor) and (
                    used.shape == value.shape or user.target is torch.ops.aten.cat.default):
                axes.add(found.axis)
        if len(axes) != 1 or not isinstance(value, torch.Tensor) or \
                value.dtype != torch.float32:
            raise QuantizedStateError(zeros.name, "a tensor of zeros stored on a per-channel "
                                      "grid, whose channel axis no user of it keeps (or "
                                      "not float32), is not supported")
        axis = axes.pop()
        scale, zero_point = self._channel_constants(zeros, grid)
        with self.graph.inserting_after(zeros):
            fill = self._call(_QUANTIZE[1], (zeros, scale, zero_point, axis, grid.quant_min,
                                             grid.quant_max, grid.dtype), {}, like=zeros)
        self.ints[zeros] = fill
        return fill

    def _call(self, target: Any, args: tuple, kwargs: dict, like: Node) -> Node:
        new = self.graph.call_function(target, args, kwargs)
        new.meta.update({k: like.meta[k] for k in _KEPT_META if k in like.meta})
        self.created.add(new)
        return new

    def _dequantize(self, value: Node, grid: Grid, like: Node) -> Node:
        scale = zero_point = None
        if grid.per_channel:
            scale, zero_point = self._channel_constants(value, grid)
        target, args, kwargs = grid.dequantize_args(value, scale, zero_point)
        return self._call(target, args, kwargs, like)

    def _channel_constants(self, value: Node, grid: Grid) -> tuple[Node, Node]:
        """Nodes holding the grid's scales and zero points, defined before any read."""
        constants = []
        for node in next(nodes for g, nodes in self.channel_sources if g.same_levels(grid)):
            if node.op == "get_attr":  # a graph module: one read of it, at the top
                if node.target not in self.constants:
                    with self.graph.inserting_before(next(iter(self.graph.nodes))):
                        self.constants[node.target] = self.graph.get_attr(node.target)
                    self.created.add(self.constants[node.target])
                node = self.constants[node.target]
            constants.append(node)
        return constants[0], constants[1]

    # -- writes and reads -------------------------------------------------------------
    def _store(self, write: Any) -> None:
        integers = self.int_of(write.value)
        if write.output is None:
            schema = write.node.target._schema
            index = value_operands(write.node)[-1]
            if index < len(write.node.args):
                write.node.update_arg(index, integers)
            else:
                write.node.update_kwarg(schema.arguments[index].name, integers)
            return
        output = self.graph.output_node()
        values = list(output.args[0])
        values[write.output] = integers
        output.args = (tuple(values), *output.args[1:])

    def _direct_reads(self) -> list[tuple[Node, Node, Grid]]:
        """The quantize nodes of a quantized buffer's value onto its own grid, that value
        and its grid: they read the integers."""
        found = []
        moving = (*MOVES, *FUNCTIONAL_WRITES, *SELECTS, torch.ops.aten.cat.default)
        quantizes = [n for op in _QUANTIZE for n in self.graph.find_nodes(
            op="call_function", target=op)]
        for node in sorted(quantizes):
            source = node.args[0] if node.args else None
            if not isinstance(source, Node) or not (
                    self._alias_plan(source) is not None or source.target in moving):
                continue
            grid = quantize_grid(node, self.resolve)
            value = self.flow.grid(source)
            if not (isinstance(value, Grid) and source in self.flow.carries_state
                    and value.same(grid) and grid.round_trip_exact()):
                continue
            plan = self._alias_plan(source)
            if plan is None or self._unwritten_while_read(node, plan):
                found.append((node, source, value))
        return found

    def _unwritten_while_read(self, node: Node, plan: BufferPlan) -> bool:
        """No write of the buffer lies between ``node`` and the last read of its value."""
        start, last, stack = self.index[node], self.index[node], [node]
        while stack:
            current = stack.pop()
            for user in current.users:
                last = max(last, self.index.get(user, last))
                found = aliased_argument(user)
                if found is not None and found[1] is current:
                    stack.append(user)
        return not any(start < w <= last for w in self.writers[plan.root])

    def _float_reads_of_mirrored_nodes(self) -> None:
        """A value computed from a quantized buffer that is now mirrored in integers is read
        as the dequantized mirror (one dequantize instead of the float computation)."""
        for node, mirror in list(self.ints.items()):
            if node not in self.flow.carries_state or mirror not in self.created:
                continue
            readers = [u for u in node.users if u not in self.created]
            if not readers:
                continue
            with self.graph.inserting_after(mirror):
                dequantized = self._dequantize(mirror, self.flow.grid(node), node)
            for user in readers:
                user.replace_input_with(node, dequantized)

    def _float_reads_of_buffer(self, plan: BufferPlan) -> None:
        """Every other reader of the buffer (or of a view of it, or of a write's result)
        reads it dequantized, right where it read it."""
        output = self.graph.output_node()
        kept = self.kept_outputs
        for node in self.alias_nodes[plan.root]:
            grid = self.flow.grid(node)
            for user in list(node.users):
                if user in self.created or user in self.stores or (
                        user in self.reads_integers or self._alias_plan(user) is plan):
                    continue
                if user is output:
                    self._dequantize_outputs(node, grid, kept)
                    continue
                # A write-back of another buffer stays among the trailing ones.
                place = self.first_write_back if user in self.write_backs else user
                with self.graph.inserting_before(place):
                    user.replace_input_with(node, self._dequantize(node, grid, node))

    def _dequantize_outputs(self, node: Node, grid: Grid, kept: set[int]) -> None:
        output = self.graph.output_node()
        flat = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else None
        if flat is None or not isinstance(self.program, ExportedProgram):
            with self.graph.inserting_before(output):
                output.replace_input_with(node, self._dequantize(node, grid, node))
            return
        positions = [i for i, v in enumerate(flat) if v is node and i not in kept]
        if positions:
            with self.graph.inserting_before(output):
                dequantized = self._dequantize(node, grid, node)
            for i in positions:
                flat[i] = dequantized
            output.args = (tuple(flat), *output.args[1:])

    def _drop_dead(self) -> None:
        """Erase the float nodes the rewrite left without readers (pure ops only)."""
        for node in reversed(list(self.graph.nodes)):
            if (node.op == "call_function" and not node.users and not node.is_impure()
                    and (node in self.ints or node in self.created)):
                self.graph.erase_node(node)
                self.ints.pop(node, None)
                self.created.discard(node)

    # -- state and fake values ---------------------------------------------------------
    def _swap_tensors(self) -> None:
        for plan in self.plans:
            if plan.carried:  # the caller's tensors: only the marks change
                for node in plan.nodes:
                    node.meta[GRID_META] = plan.grid
                continue
            integers = plan.grid.integers_of(plan.tensor.detach(), plan.fill)
            replace_buffer_tensor(self.program, plan.fqn, integers)
            for node in plan.nodes:
                node.meta[GRID_META] = plan.grid
                initial = node.meta.get(INITIAL_META)
                if initial is not None:
                    node.meta[INITIAL_META] = initial_copy(plan.grid.integers_of(initial))

    def _refresh_values(self) -> None:
        """Fake values for new nodes and for every node of a quantized buffer's storage."""
        values = FakeValues(self.graph)
        mode = values.mode
        if mode is None:
            return
        stale = set(self.created).union(*self.alias_nodes.values())
        for node in self.graph.nodes:
            if node not in stale:
                continue
            if node.op in ("placeholder", "get_attr"):
                old = node.meta.get("val")
                plan = self._alias_plan(node)
                if plan is not None and isinstance(old, torch.Tensor):
                    with mode:
                        new = torch.empty_strided(old.shape, old.stride(), dtype=plan.grid.dtype)
                    _set_value(node, new)
                continue
            values.infer(node)


def _set_value(node: Node, value: Any) -> None:
    node.meta["val"] = value
    if "tensor_meta" in node.meta and isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)
