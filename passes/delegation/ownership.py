"""Which delegate can own each mutable buffer of a lowered program, and if none, why.

Read on a functional top-level ExportedProgram after :func:`to_delegate`: a buffer
``b`` is a placeholder ``P`` and its update a ``BUFFER_MUTATION`` output ``V``. The
delegates *mutating* ``b`` are those on a path from ``P`` to ``V`` plus the one
producing ``V``. ``b`` can move into a delegate ``D`` when

* ``V`` is an output of ``D`` and ``D`` is the only delegate mutating ``b``,
  and no top-level node computes part of the update;
* nothing but ``D`` reads ``P`` (a reader elsewhere needs the value before the update,
  which only the top level still has once ``D`` updates in place).

``V`` may have other users (a user output, the attention outside the delegate): the
delegate then also returns the new value as an ordinary output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node

from pass_manager import Condition

from .delegate_runtime import LoweredBackendModule, is_delegate_call, is_delegate_output

__all__ = [
    "BufferMutationsInDelegates",
    "BufferOwnership",
    "buffer_ownership",
    "program_state",
    "unconsumed_buffer_mutations",
]


@dataclass
class BufferOwnership:
    """The verdict on one mutated buffer of the top level."""

    fqn: str
    placeholder: Node
    output_index: int
    value: Node
    owner: Node | None = None
    partitions: list[str] = field(default_factory=list)
    mutated_by: list[str] = field(default_factory=list)
    reason: str | None = None

    @property
    def consumable(self) -> bool:
        return self.reason is None


def _tag(call: Node) -> str:
    module = call.graph.owning_module.get_submodule(call.args[0].target)
    return module.tag if isinstance(module, LoweredBackendModule) else str(call.args[0].target)


def _delegate_of(node: Node) -> Node | None:
    return node.args[0] if is_delegate_output(node) else None


def _reach(start: Node, step) -> set[Node]:
    seen: set[Node] = set()
    stack = list(step(start))
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


class _Flow:
    """Data flow at the granularity of delegate outputs.

    A delegate call is one node, but its output ``i`` depends only on some of its
    arguments; reading that from the sub-program keeps two unrelated values that share
    a delegate from looking dependent.
    """

    def __init__(self) -> None:
        self._deps: dict[Node, list[set[int]]] = {}

    def deps(self, call: Node) -> list[set[int]]:
        if call not in self._deps:
            program = call.graph.owning_module.get_submodule(call.args[0].target).program
            kinds = {s.arg.name: s.kind for s in program.graph_signature.input_specs}
            placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
            user_inputs = [p for p in placeholders if kinds[p.name] == InputKind.USER_INPUT]
            position = {n: i for i, n in enumerate(user_inputs)}
            returned = program.graph.output_node().args[0]
            self._deps[call] = [
                {position[a] for a in _reach(node, lambda n: n.all_input_nodes) | {node}
                 if a in position}
                for node, spec in zip(returned, program.graph_signature.output_specs)
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


def _describe(node: Node) -> str:
    return f"delegate {_tag(node)!r}" if is_delegate_call(node) else f"node {node.name}"


def _names(nodes: Iterable[Node]) -> list[str]:
    return sorted({_tag(n) for n in nodes if is_delegate_call(n)})


def buffer_ownership(ep: ExportedProgram) -> list[BufferOwnership]:
    """One verdict per ``BUFFER_MUTATION`` output of ``ep``, in output order."""
    signature = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    buffer_nodes = {
        spec.target: placeholders[spec.arg.name]
        for spec in signature.input_specs
        if spec.kind == InputKind.BUFFER
    }
    returned = ep.graph.output_node().args[0]
    flow = _Flow()
    verdicts = []
    for index, spec in enumerate(signature.output_specs):
        if spec.kind != OutputKind.BUFFER_MUTATION:
            continue
        placeholder, value = buffer_nodes[spec.target], returned[index]
        verdict = BufferOwnership(spec.target, placeholder, index, value)
        verdicts.append(verdict)
        producer = _delegate_of(value)
        path = _reach(placeholder, flow.users) & (_reach(value, flow.inputs) | {value})
        mutating = {n for n in path if is_delegate_call(n)}
        if producer is not None:
            mutating.add(producer)
        readers = [u for u in placeholder.users if u is not producer]
        verdict.partitions = _names(mutating | set(readers))
        verdict.mutated_by = _names(mutating)
        outside = sorted(
            n.name for n in path if not is_delegate_call(n) and _delegate_of(n) is None
        )
        if producer is None:
            verdict.reason = f"its new value {value.name} is computed outside any delegate"
        elif len(mutating) > 1:
            names = ", ".join(_names(mutating))
            verdict.reason = f"it is mutated in {len(mutating)} delegates ({names})"
        elif outside:
            verdict.reason = (
                f"part of its update is computed outside delegates ({', '.join(outside)})"
            )
        elif readers:
            verdict.reason = (
                "it is read outside the delegate that mutates it, by "
                + ", ".join(_describe(u) for u in readers)
            )
        else:
            verdict.owner = producer
    return verdicts


def unconsumed_buffer_mutations(program: Any) -> list[str]:
    """Violations of ``BufferMutationsInDelegates``: consumable updates still at the top level."""
    if not isinstance(program, ExportedProgram):
        gm = program
        if isinstance(gm, torch.fx.GraphModule) and any(map(is_delegate_call, gm.graph.nodes)):
            return ["buffer ownership of delegates can only be checked on an ExportedProgram"]
        return []
    return [
        f"{v.value.name}: buffer {v.fqn!r} is updated only inside delegate "
        f"{_tag(v.owner)!r} but the top level still returns its BUFFER_MUTATION"
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
