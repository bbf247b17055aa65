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

from collections.abc import Callable, Iterable
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

    @property
    def consumable(self) -> bool:
        return self.reason is None

    @property
    def value_kept(self) -> bool:
        """Whether the top level uses the new value besides writing it back."""
        output = self.value.graph.output_node()
        uses = sum(1 for arg in output.args[0] if arg is self.value)
        return any(u is not output for u in self.value.users) or uses > 1


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


def _reach(start: Node, step: Callable[[Node], Iterable[Node]]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(step(start))
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


class _Lowered:
    """Data flow of a lowered program at the granularity of delegate outputs.

    A delegate call is one node, but its output ``i`` depends only on some of its
    arguments; reading that from the sub-program keeps two unrelated values that share
    a delegate from looking dependent.
    """

    word = "delegate"

    def __init__(self) -> None:
        self._deps: dict[Node, list[set[int]]] = {}

    def partition(self, node: Node) -> str | None:
        call = node if is_delegate_call(node) else _delegate_of(node)
        return None if call is None else _tag(call)

    def deps(self, call: Node) -> list[set[int]]:
        if call not in self._deps:
            program = call.graph.owning_module.get_submodule(call.args[0].target).program
            position = {n: i for i, n in enumerate(user_input_nodes(program))}
            returned = program.graph.output_node().args[0]
            self._deps[call] = [
                {position[a] for a in _reach(node, lambda n: n.all_input_nodes) | {node}
                 if a in position}
                for node, spec in zip(returned, program.graph_signature.output_specs, strict=True)
                if spec.kind != OutputKind.BUFFER_MUTATION
            ]
        return self._deps[call]

    def inputs(self, node: Node) -> list[Node]:
        call = _delegate_of(node)
        if call is not None:
            args = call.args[1:]
            return [call, *(args[j] for j in sorted(self.deps(call)[node.args[1]]))]
        return [] if is_delegate_call(node) else list(node.all_input_nodes)

    def users(self, node: Node) -> list[Node]:
        found = []
        for user in node.users:
            found.append(user)
            if is_delegate_call(user):
                positions = {j for j, a in enumerate(user.args[1:]) if a is node}
                deps = self.deps(user)
                found += [g for g in user.users if deps[g.args[1]] & positions]
        return [] if is_delegate_call(node) else found


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


def _decide(verdict: BufferOwnership, flow: _Partitioning) -> None:
    """Fill in the verdict on one buffer: the shared rules of both program forms."""
    placeholder, value = verdict.placeholder, verdict.value
    producer = flow.partition(value)
    path = _reach(placeholder, flow.users) & (_reach(value, flow.inputs) | {value})
    mutating = {p for p in map(flow.partition, path) if p is not None}
    if producer is not None:
        mutating.add(producer)
    readers = [u for u in placeholder.users if producer is None or flow.partition(u) != producer]
    reader_partitions = {p for p in map(flow.partition, readers) if p is not None}
    verdict.partitions = sorted(mutating | reader_partitions)
    verdict.mutated_by = sorted(mutating)
    outside = sorted(n.name for n in path if flow.partition(n) is None)
    word = flow.word
    if producer is None:
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
    verdicts = []
    for index, spec in enumerate(signature.output_specs):
        if spec.kind != OutputKind.BUFFER_MUTATION:
            continue
        verdict = BufferOwnership(spec.target, buffer_nodes[spec.target], index, returned[index])
        _decide(verdict, flow)
        verdicts.append(verdict)
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
