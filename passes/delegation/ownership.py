"""Which partition can own each mutable buffer of a program, and if none, why.

One analysis, read on two forms of a functional ExportedProgram whose buffer ``b`` is a
placeholder ``P`` and whose update is a ``BUFFER_MUTATION`` output ``V``:

* lowered (after :func:`to_delegate`): a partition is a delegate call and its outputs
  (:func:`buffer_ownership`, used by ``ConsumeBufferMutationsInDelegate``);
* tagged (before lowering, ExecuTorch's convention ``node.meta["delegation_tag"]``): a
  partition is the set of nodes sharing a tag (:func:`tagged_buffer_ownership`, used
  by ``passes.executorch.BufferOwningPartitioner``).

The partitions *mutating* ``b`` are those on a path from ``P`` to ``V`` plus the one
producing ``V``. ``b`` can move into a partition ``D`` when

* ``V`` is computed by ``D`` and ``D`` is the only partition mutating ``b``,
  and no top-level node computes part of the update;
* nothing but ``D`` reads ``P`` (a reader elsewhere needs the value before the update,
  which only the top level still has once ``D`` updates in place).

``V`` may have other users (a user output, the attention outside the partition): the
partition then also returns the new value as an ordinary output.
"""

from __future__ import annotations

import operator
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node

from pass_manager import Condition

from .delegate_runtime import LoweredBackendModule, is_delegate_call, is_delegate_output
from .partitioners import DELEGATION_TAG
from .subprogram import user_input_nodes

__all__ = [
    "BufferMutationsInDelegates",
    "BufferOwnership",
    "buffer_ownership",
    "program_state",
    "tagged_buffer_ownership",
    "unconsumed_buffer_mutations",
    "update_paths",
]


@dataclass
class BufferOwnership:
    """The verdict on one mutated buffer of the top level.

    ``owner_tag`` names the partition that can own the buffer (``None`` when it stays
    at the top level, and ``reason`` says why); on a lowered program ``owner`` is that
    partition's delegate call node.
    """

    fqn: str
    placeholder: Node
    output_index: int
    value: Node
    owner_tag: str | None = None
    owner: Node | None = None
    partitions: list[str] = field(default_factory=list)
    mutated_by: list[str] = field(default_factory=list)
    reason: str | None = None
    returned: int = 1  # how many outputs of the top level are ``value``

    @property
    def consumable(self) -> bool:
        return self.reason is None

    @property
    def value_kept(self) -> bool:
        """Whether the top level uses the new value besides writing it back."""
        output = self.value.graph.output_node()
        return any(u is not output for u in self.value.users) or self.returned > 1


class _Partitioning(Protocol):
    """How one form of a program groups its nodes into partitions, and its data flow."""

    word: str  # what a partition is called in the reasons: "delegate" or "partition"

    def partition(self, node: Node) -> str | None: ...
    def inputs(self, node: Node) -> list[Node]: ...
    def users(self, node: Node) -> list[Node]: ...


def _tag(call: Node) -> str:
    module = call.graph.owning_module.get_submodule(call.args[0].target)
    return module.tag if isinstance(module, LoweredBackendModule) else str(call.args[0].target)


def _delegate_of(node: Node) -> Node | None:
    return node.args[0] if is_delegate_output(node) else None


def _earlier_delegate(node: Node) -> str | None:
    """``"<lowered module> on <backend> via <call>"`` when ``node`` reads a result of a
    delegate call already in the graph (this package's ``call_delegate`` or ExecuTorch's
    ``executorch_call_delegate``: a call whose first argument is a lowered module); else
    ``None``.

    On a tagged program such a call is untagged, so it looks like top-level computation: a
    second partitioner of one lowering sees the first one's delegates that way.
    """
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    call = node.args[0]
    if not isinstance(call, Node) or call.op != "call_function" or not call.args:
        return None
    module_node = call.args[0]
    if not isinstance(module_node, Node) or module_node.op != "get_attr":
        return None
    module = getattr(call.graph.owning_module, str(module_node.target), None)
    backend = getattr(module, "backend_id", None)
    if backend is None:
        return None
    via = getattr(call.target, "__name__", call.target)
    return f"{module_node.target} on {backend} via {via}"


def _described(node: Node) -> str:
    """A node's name, with the earlier delegate it reads a result of (if it does)."""
    earlier = _earlier_delegate(node)
    return node.name if earlier is None else f"{node.name} (an output of {earlier})"


def _members(bits: int) -> list[int]:
    """The indices of the set bits of ``bits``, lowest first."""
    found = []
    while bits:
        low = bits & -bits
        found.append(low.bit_length() - 1)
        bits ^= low
    return found


@dataclass
class _Call:
    """What the data flow needs of one delegate call, read once from its sub-program."""

    tag: str
    deps: list[set[int]]  # result i -> the argument positions it depends on
    positions: dict[Node, list[int]]  # argument node -> its positions in the call
    dependents: dict[int, list[Node]]  # argument position -> getitems of dependent results


class _Lowered:
    """Data flow of a lowered program at the granularity of delegate outputs.

    A delegate call is one node, but its output ``i`` depends only on some of its
    arguments; reading that from the sub-program keeps two unrelated values that share
    a delegate from looking dependent.
    """

    word = "delegate"

    def __init__(self) -> None:
        self._calls: dict[Node, _Call] = {}

    def _call(self, call: Node) -> _Call:
        info = self._calls.get(call)
        if info is None:
            program = call.graph.owning_module.get_submodule(call.args[0].target).program
            position = {n: 1 << i for i, n in enumerate(user_input_nodes(program))}
            # Which user inputs each sub-program node depends on, as bits, in one walk.
            depends: dict[Node, int] = {}
            for node in program.graph.nodes:
                bits = position.get(node, 0)
                for arg in node.all_input_nodes:
                    bits |= depends[arg]
                depends[node] = bits
            returned = program.graph.output_node().args[0]
            deps = [
                set(_members(depends.get(node, 0)))
                for node, spec in zip(returned, program.graph_signature.output_specs, strict=True)
                if spec.kind != OutputKind.BUFFER_MUTATION
            ]
            positions: dict[Node, list[int]] = defaultdict(list)
            for j, arg in enumerate(call.args[1:]):
                if isinstance(arg, Node):
                    positions[arg].append(j)
            dependents: dict[int, list[Node]] = defaultdict(list)
            for result in call.users:
                for j in deps[result.args[1]]:
                    dependents[j].append(result)
            info = self._calls[call] = _Call(_tag(call), deps, positions, dependents)
        return info

    def partition(self, node: Node) -> str | None:
        call = node if is_delegate_call(node) else _delegate_of(node)
        return None if call is None else self._call(call).tag

    def deps(self, call: Node) -> list[set[int]]:
        return self._call(call).deps

    def inputs(self, node: Node) -> list[Node]:
        call = _delegate_of(node)
        if call is not None:
            args = call.args[1:]
            return [call, *(args[j] for j in sorted(self.deps(call)[node.args[1]]))]
        return [] if is_delegate_call(node) else list(node.all_input_nodes)

    def users(self, node: Node) -> list[Node]:
        if is_delegate_call(node):
            return []
        found = []
        for user in node.users:
            found.append(user)
            if is_delegate_call(user):
                info = self._call(user)
                found += dict.fromkeys(
                    g for j in info.positions[node] for g in info.dependents[j])
        return found


class _Tagged:
    """Data flow of a tagged program: plain node edges; a partition is a tag."""

    word = "partition"

    def __init__(self, tag_key: str) -> None:
        self.tag_key = tag_key

    def partition(self, node: Node) -> str | None:
        # Only computation counts: a placeholder's tag is the ownership being decided.
        if node.op != "call_function":
            return None
        tag = node.meta.get(self.tag_key)
        return None if tag is None else str(tag)

    def inputs(self, node: Node) -> list[Node]:
        return list(node.all_input_nodes)

    def users(self, node: Node) -> list[Node]:
        return list(node.users)


def _update_paths(
    graph: torch.fx.Graph, flow: _Partitioning, ends: list[tuple[Node, Node]]
) -> list[list[Node]]:
    """Per ``(placeholder, value)`` pair: the nodes on a path from the placeholder to the
    value (the value included, the placeholder not), in graph order.

    One forward and one backward walk for all pairs at once: each node carries, as the
    bits of an int, the pairs whose placeholder reaches it and those whose value it reaches
    (a walk per buffer would make the analysis quadratic in the size of a decoder). Flow
    edges run forward in graph order, so graph order is a topological order for both.
    """
    starts: dict[Node, int] = defaultdict(int)
    finals: dict[Node, int] = defaultdict(int)
    for i, (placeholder, value) in enumerate(ends):
        starts[placeholder] |= 1 << i
        finals[value] |= 1 << i
    nodes = list(graph.nodes)
    reached: dict[Node, int] = defaultdict(int)  # pairs whose placeholder reaches the node
    for node in nodes:
        bits = reached.get(node, 0) | starts.get(node, 0)
        if bits:
            for user in flow.users(node):
                reached[user] |= bits
    reaching: dict[Node, int] = defaultdict(int)  # pairs whose value the node reaches
    for node in reversed(nodes):
        bits = reaching.get(node, 0) | finals.get(node, 0)
        if bits:
            for source in flow.inputs(node):
                reaching[source] |= bits
    paths: list[list[Node]] = [[] for _ in ends]
    for node in nodes:
        on = reached.get(node, 0) & (reaching.get(node, 0) | finals.get(node, 0))
        for i in _members(on):
            paths[i].append(node)
    return paths


def update_paths(graph: torch.fx.Graph, ends: list[tuple[Node, Node]]) -> list[list[Node]]:
    """Per ``(placeholder, value)`` pair of ``graph``: the nodes on a path from the placeholder
    to the value (the value included), in graph order, following plain node edges."""
    return _update_paths(graph, _Tagged(DELEGATION_TAG), ends)


def _decide(verdict: BufferOwnership, flow: _Partitioning, path: list[Node]) -> None:
    """Fill in the verdict on one buffer: the shared rules of both program forms."""
    placeholder, value = verdict.placeholder, verdict.value
    producer = flow.partition(value)
    mutating = {p for p in map(flow.partition, path) if p is not None}
    if producer is not None:
        mutating.add(producer)
    readers = [u for u in placeholder.users if producer is None or flow.partition(u) != producer]
    reader_partitions = {p for p in map(flow.partition, readers) if p is not None}
    verdict.partitions = sorted(mutating | reader_partitions)
    verdict.mutated_by = sorted(mutating)
    outside = sorted(_described(n) for n in path if flow.partition(n) is None)
    word = flow.word
    earlier = _earlier_delegate(value) if producer is None else None
    if earlier is not None:
        verdict.reason = (
            f"its new value {value.name} is an output of an earlier delegate ({earlier}) "
            f"that did not take the buffer; these {word}s cannot move it into that delegate"
        )
    elif producer is None:
        verdict.reason = f"its new value {value.name} is computed outside any {word}"
    elif len(mutating) > 1:
        names = ", ".join(verdict.mutated_by)
        verdict.reason = f"it is mutated in {len(mutating)} {word}s ({names})"
    elif outside:
        verdict.reason = f"part of its update is computed outside {word}s ({', '.join(outside)})"
    elif readers:
        described = dict.fromkeys(
            f"{word} {p!r}" if p is not None else f"node {u.name}"
            for u, p in ((u, flow.partition(u)) for u in readers)
        )
        verdict.reason = (
            f"it is read outside the {word} that mutates it, by " + ", ".join(described)
        )
    else:
        verdict.owner_tag = producer


def _verdicts(ep: ExportedProgram, flow: _Partitioning) -> list[BufferOwnership]:
    signature = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    buffer_nodes = {
        spec.target: placeholders[spec.arg.name]
        for spec in signature.input_specs
        if spec.kind == InputKind.BUFFER
    }
    returned = ep.graph.output_node().args[0]
    times = Counter(a for a in returned if isinstance(a, Node))
    verdicts = [
        BufferOwnership(spec.target, buffer_nodes[spec.target], index, returned[index],
                        returned=times[returned[index]])
        for index, spec in enumerate(signature.output_specs)
        if spec.kind == OutputKind.BUFFER_MUTATION
    ]
    paths = _update_paths(ep.graph, flow, [(v.placeholder, v.value) for v in verdicts])
    for verdict, path in zip(verdicts, paths, strict=True):
        _decide(verdict, flow, path)
    return verdicts


def buffer_ownership(ep: ExportedProgram) -> list[BufferOwnership]:
    """One verdict per ``BUFFER_MUTATION`` output of a lowered ``ep``, in output order."""
    verdicts = _verdicts(ep, _Lowered())
    for v in verdicts:
        if v.owner_tag is not None:
            v.owner = _delegate_of(v.value)
    return verdicts


def tagged_buffer_ownership(
    ep: ExportedProgram, tag_key: str = DELEGATION_TAG
) -> list[BufferOwnership]:
    """One verdict per ``BUFFER_MUTATION`` output of a tagged, not yet lowered ``ep``."""
    return _verdicts(ep, _Tagged(tag_key))


def unconsumed_buffer_mutations(program: Any) -> list[str]:
    """Violations of ``BufferMutationsInDelegates``: consumable updates still at the top level."""
    if not isinstance(program, ExportedProgram):
        gm = program
        if isinstance(gm, torch.fx.GraphModule) and any(map(is_delegate_call, gm.graph.nodes)):
            return ["buffer ownership of delegates can only be checked on an ExportedProgram"]
        return []
    return [
        f"{v.value.name}: buffer {v.fqn!r} is updated only inside delegate "
        f"{v.owner_tag!r} but the top level still returns its BUFFER_MUTATION"
        for v in buffer_ownership(program)
        if v.consumable
    ]


BufferMutationsInDelegates = Condition(
    "BufferMutationsInDelegates",
    unconsumed_buffer_mutations,
    doc="Every buffer that exactly one delegate mutates, and nothing else reads, is owned by "
    "that delegate: a BUFFER input and BUFFER_MUTATION output of its sub-program, absent "
    "from the top-level signature.",
)


def program_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of a runnable program by FQN: its own and those its delegates own.

    A state reader for :func:`pass_manager.run_program` / ``assert_same_behaviour``
    (``state=program_state``); on an eager module it is just its named buffers.
    """
    state = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    for sub in module.modules():
        if isinstance(sub, LoweredBackendModule):
            state.update({fqn: t.detach().clone() for fqn, t in sub.owned_buffers().items()})
    return state
