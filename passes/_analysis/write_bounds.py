"""Where a sequence of calls writes state at positions the state does not have.

A static KV cache holds ``max_seq`` positions; a decode loop given more steps than that
writes past its end: eager raises ``IndexError`` at that step, ExecuTorch's runtime an
untyped ``RuntimeError`` (its ``index_put.out`` failing with error ``0x12``). The positions
a call writes at are computed from its inputs (``input_pos``, ``cache_position``) and from
integer state (a step counter the program advances), rarely from anything else. So they
can be found before anything runs, cheaply and exactly: the part of each program that
computes its write positions and its integer state, and nothing of the model, is run on
the calls in order, threading that integer state from call to call and from method to
method (methods share a buffer by name). Integer state the caller carries is threaded as
the runtime helpers and eager thread it: an input the program writes in place, or whose
next value an output returns (``pairs``), is given to a later call passing the same
tensor with the value the earlier call left. A position wrapped into the state (a ring
buffer, ``pos % window``) is in range and passes.

Which writes: ``index_copy`` along a dimension and ``index_put`` with integer indices,
into a buffer or an input the program carries state in, or into a tensor that becomes
one's next value (HF's prefill fills a fresh cache, then copies it in). Positions computed from
floating-point values (a position chosen by the model's own output) are not looked at: the
run finds those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Graph, GraphModule, Node

from pass_manager.call_signature import signature_of

from ..errors import StatePastEndError
from .buffers import BUFFER, USER_INPUT, find_mutations, placeholder_specs

__all__ = ["WritePastEnd", "check_writes_within_state", "first_write_past_end",
           "flat_user_inputs"]

_aten = torch.ops.aten
_INDEX_COPIES = {_aten.index_copy.default, _aten.index_copy_.default}
_INDEX_PUTS = {_aten.index_put.default, _aten.index_put_.default}
_STATE_KINDS = (InputKind.BUFFER, InputKind.USER_INPUT)


@dataclass(frozen=True)
class WritePastEnd:
    """The first call writing state at a position the state does not have."""

    step: int
    """The call's index in the sequence."""
    method: str
    state: str
    """The buffer's fully-qualified name, or the input's name."""
    dim: int
    position: int
    length: int
    """How many positions the state holds along ``dim``."""


Pairs = Mapping[int, int]
"""State carried as input/output pairs: ``{flat user input: flat user output}`` (the
positions :func:`passes._carried.pairs.pairs_of` gives)."""

_Key = tuple[str, str]
"""A slice input: ``("user", flat position)`` or ``("buffer", FQN)`` (a constant too)."""


@dataclass
class _Slice:
    """What of one program computes its write positions and its integer state."""

    module: GraphModule
    inputs: list[_Key]
    writes: list[tuple[str, int, int]]  # (state, dim, length) per index output
    updates: list[str]  # FQNs of the integer buffers whose next values follow the indices
    carried: list[int]  # user inputs (flat) whose next values follow the updates
    advanced: set[str]  # FQNs of the buffers it advances (by ``updates`` or in place)
    reads: set[str]  # FQNs of the buffers it reads


def first_write_past_end(programs: Mapping[str, ExportedProgram],
                         calls: Sequence[tuple[str, Sequence[Any]]],
                         pairs: Mapping[str, Pairs] | None = None,
                         ) -> WritePastEnd | None:
    """The first of ``calls`` (``(method, its user inputs flat in the exported order)``, in
    order, over the methods' shared state) that writes past the end of a buffer or carried
    input; None when every write is within range, or where the positions depend on more
    than integer inputs and integer state (then the run itself finds it).
    :func:`flat_user_inputs` flattens a call as Python takes it.

    An integer input a method writes in place, or whose next value it returns (``pairs``,
    per method: the pairing the runtime helpers thread), is state the caller carries: a
    later call passing the same tensor reads the value the earlier call left, as eager
    and the runtime helpers run it. The caller's tensors are not written."""
    slices = {method: _slice(program, (pairs or {}).get(method, {}))
              for method, program in programs.items()}
    # The methods share what some method writes, by name; a read-only tensor is each
    # method's own (HF's lifted counter steps: one name, 4 in the prefill, 1 in the decode).
    written = {method: _integers_written(program) for method, program in programs.items()}
    shared: dict[str, torch.Tensor] = {}
    own: dict[str, dict[str, torch.Tensor]] = {}
    for method, program in programs.items():
        own[method] = {name: tensor.clone() for name, tensor in (
            *program.state_dict.items(), *program.constants.items())
            if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()}
        for name in written[method] & set(own[method]):
            shared.setdefault(name, own[method][name])
    # A counter some method advances where this analysis cannot follow (a method writing
    # no state by position, a count computed from floats): its positions are the run's.
    untracked = set().union(*(names - (slices[m].advanced if slices[m] else set())
                              for m, names in written.items()))
    if any(found and found.reads & untracked for found in slices.values()):
        return None
    advancing = {method: _integer_inputs_advanced(program, (pairs or {}).get(method, {}))
                 for method, program in programs.items()}
    # The caller's tensors carrying integer state, by identity: (the tensor, its value now).
    carried: dict[int, tuple[Any, torch.Tensor]] = {}
    lost: set[int] = set()  # advanced by a call this analysis does not follow
    for step, (method, leaves) in enumerate(calls):
        found = slices.get(method)
        if found is None:
            lost.update(id(leaves[i]) for i in advancing.get(method, ()) if i < len(leaves))
            continue
        try:
            values = [_user_value(leaves[int(name)], carried, lost) if kind == "user" else
                      shared[name] if name in shared else own[method][name]
                      for kind, name in found.inputs]
            with torch.no_grad():
                results = found.module(*values)
        except _Untracked:
            return None  # state a call this analysis could not follow advanced
        except (IndexError, KeyError, RuntimeError, TypeError, ValueError):
            return None  # the run says what is wrong with this call
        count = len(found.writes)
        positions = results[:count]
        nexts = results[count:count + len(found.updates)]
        carried_nexts = results[count + len(found.updates):]
        for (name, dim, length), position in zip(found.writes, positions, strict=True):
            outside = position[(position >= length) | (position < -length)]
            if outside.numel():
                return WritePastEnd(step, method, name, dim, int(outside.flatten()[0]), length)
        shared.update(zip(found.updates, nexts, strict=True))
        for index, value in zip(found.carried, carried_nexts, strict=True):
            carried[id(leaves[index])] = (leaves[index], value)
        lost.update(id(leaves[i]) for i in advancing[method] - set(found.carried)
                    if i < len(leaves))
    return None


class _Untracked(Exception):
    """A call reads a tensor whose value a call this analysis did not follow changed."""


def _user_value(leaf: Any, carried: Mapping[int, tuple[Any, torch.Tensor]],
                lost: set[int]) -> Any:
    """What a call's input holds now: the value an earlier call left in that tensor, else
    the tensor's own; a copy, since the slice may write it in place."""
    if id(leaf) in lost:
        raise _Untracked
    if id(leaf) in carried:
        return carried[id(leaf)][1].clone()
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def flat_user_inputs(program: ExportedProgram, args: tuple, kwargs: Mapping[str, Any],
                     ) -> list[Any]:
    """A call as Python makes it (one that fits the program), flat in the exported order."""
    return [leaf for _, leaf in signature_of(program).leaves(args, kwargs)]


def _user_inputs(program: ExportedProgram) -> dict[str, int]:
    """Each user input placeholder's flat position, by its name in the graph and in the
    signature (a deep copy may rename a placeholder and not its spec)."""
    positions: dict[str, int] = {}
    user = 0
    for node, spec in placeholder_specs(program):
        if spec.kind == InputKind.USER_INPUT:
            positions[node.name] = user
            positions.setdefault(getattr(spec.arg, "name", node.name), user)
            user += 1
    return positions


def _integer_inputs_advanced(program: ExportedProgram, pairs: Pairs) -> set[int]:
    """The user inputs (flat) holding integers that ``program`` writes in place or whose
    next value it returns (``pairs``)."""
    positions = _user_inputs(program)
    placeholders = {node.name: node for node, _ in placeholder_specs(program)}
    names = {state.name for state in find_mutations(program).writers if state.kind == USER_INPUT}
    advanced = {positions[name] for name in names if name in positions}
    advanced |= set(pairs)
    by_position = {position: placeholders.get(name) for name, position in positions.items()}
    return {i for i in advanced if isinstance(by_position.get(i), Node)
            and _is_integer(by_position[i])}


def _slice(program: ExportedProgram, pairs: Pairs) -> _Slice | None:
    """The program's write positions and integer state updates as one small graph module,
    or None when it writes no state by position or its positions read a float."""
    kinds: dict[Node, _Key] = {}
    user = 0
    for node, spec in placeholder_specs(program):
        if spec.kind == InputKind.USER_INPUT:
            kinds[node] = ("user", str(user))
            user += 1
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kinds[node] = ("buffer", str(spec.target))
    names = {node: (spec.target if spec.kind == InputKind.BUFFER else node.name)
             for node, spec in placeholder_specs(program) if spec.kind in _STATE_KINDS}
    # The state advanced call by call, as slice inputs: integer buffers and integer inputs
    # the caller carries (written in place, or returned as their next value).
    users = _user_inputs(program)
    counters: set[_Key] = {("buffer", name) for name in _integers_written(program)}
    counters |= {("user", str(i)) for i in _integer_inputs_advanced(program, pairs)}
    outputs = program.graph.output_node().args[0]
    specs = program.graph_signature.output_specs
    next_values: dict[_Key, Node] = {}
    returned = [value for spec, value in zip(specs, outputs, strict=True)
                if spec.kind == OutputKind.USER_OUTPUT]
    for spec, value in zip(specs, outputs, strict=True):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            next_values[("buffer", str(spec.target))] = value
        elif spec.kind == OutputKind.USER_INPUT_MUTATION and spec.target in users:
            next_values[("user", str(users[spec.target]))] = value
    for position, output in pairs.items():
        if output < len(returned) and isinstance(returned[output], Node):
            next_values.setdefault(("user", str(position)), returned[output])
    # State written in place (export's IR before functionalization) is advanced by running
    # its writers on the tensor itself; functional state, by its mutation output.
    writers: dict[_Key, list[Node]] = {}
    for state, nodes in find_mutations(program).writers.items():
        if state.kind == BUFFER:
            writers[("buffer", state.name)] = nodes
        elif state.kind == USER_INPUT and state.name in users:
            writers[("user", str(users[state.name]))] = nodes
    # Writes into the state itself, and into a tensor that becomes state's next value (HF's
    # prefill writes a fresh cache, ``zeros(...).index_copy(...)``, then copies it in):
    # named for that state, as the write past the end of either fails alike.
    state_of = {key: str(names[node]) for node, key in kinds.items() if node in names}
    computed_from: dict[_Key, set[Node]] = {}  # each state's new value's inputs, when asked

    def becomes(node: Node) -> str | None:
        for key, name in state_of.items():
            if key not in computed_from:
                computed_from[key] = _needed([*writers.get(key, ()), *(
                    [next_values[key]] if key in next_values else [])])
            if node in computed_from[key]:
                return name
        return None

    writes, positions = [], []
    for node in program.graph.nodes:
        for dim, position in _positions(node):
            destination = node.args[0]
            val = destination.meta.get("val") if isinstance(destination, Node) else None
            if not (isinstance(val, torch.Tensor) and isinstance(val.shape[dim], int)):
                continue
            state = names.get(destination) or becomes(node)
            if state is not None:
                writes.append((str(state), dim % val.dim(), val.shape[dim]))
                positions.append(position)
    if not writes and not counters:
        return None

    def written_reads(nodes: set[Node]) -> set[_Key]:
        return {kinds[node] for node in nodes if node in kinds
                and (kinds[node] in writers or kinds[node] in next_values)}

    roots, advanced, updates = list(positions), set(), []
    needed = _needed(roots)
    more = counters | written_reads(needed)
    while more:  # the state the positions read and the counters, advanced call by call
        advanced |= more
        updates += sorted(key for key in more if key in next_values)
        roots += [writer for key in sorted(more) for writer in writers.get(key, ())
                  if writer not in next_values.values()]
        needed = _needed([*roots, *(next_values[key] for key in updates)])
        more = written_reads(needed) - advanced
    if any(_is_float(node) for node in needed if node.op == "placeholder"):
        return None
    graph, env, taken = Graph(), {}, {}
    inputs = []
    for node in program.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            inputs.append(kinds.get(node, ("missing", node.name)))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
        if node in positions:  # as the write reads it: a counter advances later in place
            taken[node] = graph.call_function(_aten.clone.default, (env[node],))
    if any(kind == "missing" for kind, _ in inputs):
        return None
    # A carried input advanced in place has its next value in the input itself.
    placeholder = {kinds[node]: env[node] for node in needed if node in kinds}
    carried = sorted(int(i) for kind, i in advanced if kind == "user" and (
        ("user", i) in next_values or ("user", i) in placeholder))
    carried_values = [env[next_values[("user", str(i))]] if ("user", str(i)) in next_values
                      else placeholder[("user", str(i))] for i in carried]
    buffer_updates = [key for key in updates if key[0] == "buffer"]
    graph.output(tuple([*(taken[n] for n in positions),
                        *(env[next_values[key]] for key in buffer_updates), *carried_values]))
    reads = {name for kind, name in inputs if kind == "buffer"}
    return _Slice(GraphModule(program.graph_module, graph), inputs, writes,
                  [name for _, name in buffer_updates], carried,
                  {name for kind, name in advanced if kind == "buffer"}, reads)


def _integers_written(program: ExportedProgram) -> set[str]:
    """The integer buffers ``program`` writes (FQNs)."""
    values = {**program.state_dict, **program.constants}
    return {state.name for state in find_mutations(program).writers
            if state.kind == BUFFER and isinstance(values.get(state.name), torch.Tensor)
            and not values[state.name].is_floating_point()}


def _positions(node: Node) -> list[tuple[int, Node]]:
    """(dimension, index node) of each position ``node`` writes state at by index."""
    if node.op != "call_function":
        return []
    if node.target in _INDEX_COPIES and isinstance(node.args[2], Node):
        return [(int(node.args[1]), node.args[2])]
    if node.target in _INDEX_PUTS:
        return [(dim, index) for dim, index in enumerate(node.args[1])
                if isinstance(index, Node) and not _is_float(index) and not _is_bool(index)]
    return []


def _needed(roots: list[Node]) -> set[Node]:
    """Every node ``roots`` are computed from, and the roots."""
    needed, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack += node.all_input_nodes
    return needed


def _is_float(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _is_integer(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and not (
        val.is_complex() or val.dtype == torch.bool)


def _is_bool(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def check_writes_within_state(helper: str, programs: Mapping[str, ExportedProgram],
                              calls: Sequence[tuple[str, Sequence[Any]]],
                              name: Callable[[int, str], str],
                              pairs: Mapping[str, Pairs] | None = None) -> None:
    """:func:`first_write_past_end`, raised: ``name(step, method)`` names the call.

    Raises:
        StatePastEndError: a call writes past the end of a buffer or carried input.
    """
    found = first_write_past_end(programs, calls, pairs)
    if found is not None:
        raise StatePastEndError(helper, name(found.step, found.method), found.step, found.state,
                                found.dim, found.position, found.length)
