"""Which new buffer values need a copy so that a delegate can own the buffer, and the copies.

ExecuTorch lowers a buffer into the delegate that updates it only if the buffer's new value
(its ``BUFFER_MUTATION`` output) is used by nothing outside that delegate. A use outside it
(a user output, an op the partitioner leaves out) must read a distinct node, which the
delegate then returns as an ordinary output: a copy of the new value. A partitioner may only
tag nodes, so that copy has to exist before ExecuTorch decomposes the program, when nobody
knows the partition yet; and a copy that only uses inside the owner read is a whole-buffer
copy per call for nothing (a KV cache copied per token).

So :class:`~passes.executorch.BufferOwningPartitioner` plans the copies first
(:func:`plan_new_value_copies`): it lowers, with ExecuTorch's own
``to_edge_transform_and_lower`` and the wrapped partitioner, a small program made of what
decides each buffer's ownership (:func:`buffer_neighbourhood`), reads which buffers that
trial partition would own and where their new values are used, and copies the new value of
a buffer only if it would be owned and some use of it lands outside the owner (a user output
always does). ``partition`` then decides ownership on the real program; where the trial
predicted wrong, a planned copy lands inside the owner (one copy too many) or a missing one
keeps the buffer at the top level (correct, and its note says why).

Before (the owner keeps ``index_copy``, the attention stays outside)::

    index_copy = aten.index_copy(b_cache, 2, pos, k)
    scores = aten.matmul(q, index_copy)
    return (index_copy, scores)                 # BUFFER_MUTATION 'cache', USER_OUTPUT

After::

    index_copy = aten.index_copy(b_cache, 2, pos, k)
    clone = aten.clone(index_copy)              # tagged into the owner, returned by it
    scores = aten.matmul(q, clone)
    return (index_copy, scores)
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.backend.partitioner import Partitioner, PartitionResult
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Node

from pass_manager.program import graph_module_copy

from ..delegation.ownership import BufferOwnership, update_paths
from ..delegation.partitioners import DELEGATION_TAG
from ..delegation.subprogram import input_spec, make_program, output_spec

__all__ = [
    "CopyPlan",
    "buffer_neighbourhood",
    "functional",
    "plan_new_value_copies",
    "separate_new_buffer_values",
]

# The verdicts of BufferOwningPartitioner on a tagged program: who may own each buffer.
Verdicts = Callable[[ExportedProgram, dict], list[BufferOwnership]]


def functional(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` with every buffer update a ``BUFFER_MUTATION`` output (our passes, no re-trace)."""
    from pass_manager import PassManager

    from ..conditions import Functional
    from ..inplace_to_functional import InplaceToFunctional
    from ..mark_mutable_buffers import MarkMutableBuffers

    if not Functional.check(ep):
        return ep
    # The passes rewrite in place: give them a graph of their own (state stays shared).
    gm = graph_module_copy(ep.graph_module)
    work = ep._update(gm, copy.deepcopy(ep.graph_signature))
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(work).program


@dataclass(frozen=True)
class _Update:
    """One buffer update of a functional program and the other uses of its new value."""

    fqn: str
    placeholder: Node
    value: Node
    returned: bool  # the program also returns the new value (a use outside any delegate)
    read: bool  # an op reads the new value

    @property
    def shared(self) -> bool:
        return self.returned or self.read


def _updates(ep: ExportedProgram) -> list[_Update]:
    signature = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    buffers = {s.target: placeholders[s.arg.name] for s in signature.input_specs
               if s.kind == InputKind.BUFFER}
    output = ep.graph.output_node()
    returned = list(output.args[0])
    updates = []
    for index, spec in enumerate(signature.output_specs):
        if spec.kind != OutputKind.BUFFER_MUTATION:
            continue
        value = returned[index]
        elsewhere = any(a is value for i, a in enumerate(returned) if i != index)
        read = any(u is not output for u in value.users)
        updates.append(_Update(spec.target, buffers[spec.target], value, elsewhere, read))
    return updates


def separate_new_buffer_values(
    ep: ExportedProgram, buffers: Collection[str] | None = None
) -> ExportedProgram:
    """A copy of ``ep`` in which a buffer's new value is written back and nothing else.

    Every other use of it (a user output, an op) reads a clone, so a delegate owning the
    buffer can hand the value out as an ordinary output. ``buffers``: the FQNs whose new
    values get a clone (default: every buffer). Semantics are unchanged; the state tensors
    are shared with ``ep``, which is not modified.
    """
    ep = functional(ep)
    needs_copy = [u.value.name for u in _updates(ep)
                  if u.shared and (buffers is None or u.fqn in buffers)]
    if not needs_copy:
        return ep
    specs = list(ep.graph_signature.output_specs)
    gm = graph_module_copy(ep.graph_module)
    nodes = {n.name: n for n in gm.graph.nodes}
    output = gm.graph.output_node()
    returned = list(output.args[0])
    for name in dict.fromkeys(needs_copy):
        value = nodes[name]
        with gm.graph.inserting_after(value):
            clone = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
        clone.meta.update(
            {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta", "stack_trace",
                                                         "nn_module_stack", "source_fn_stack")}
        )
        keep = (output, clone)
        value.replace_all_uses_with(clone, delete_user_cb=lambda user, keep=keep: user not in keep)
        for i, arg in enumerate(returned):
            if arg is value and specs[i].kind != OutputKind.BUFFER_MUTATION:
                returned[i] = clone
                specs[i] = OutputSpec(specs[i].kind, TensorArgument(clone.name), specs[i].target)
    output.args = (tuple(returned),)
    gm.graph.lint()
    gm.recompile()
    signature = ExportGraphSignature(list(ep.graph_signature.input_specs), specs)
    return ep._update(gm, signature)


def _is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _neighbourhood_nodes(ep: ExportedProgram, updates: list[_Update]) -> set[Node]:
    """The computation that decides ownership: update paths, old-value readers, new-value users."""
    ends = [(u.placeholder, u.value) for u in updates]
    kept: set[Node] = set()
    for update, path in zip(updates, update_paths(ep.graph, ends), strict=True):
        kept.update(path)
        kept.update(update.placeholder.users)
        kept.update(update.value.users)
    pending = [n for n in kept if n.op == "call_function"]
    kept = set(pending)
    while pending:  # a kept node's tuple results and non-tensor inputs come with it
        node = pending.pop()
        extra = [u for u in node.users if u.target is operator.getitem]
        extra += [a for a in node.all_input_nodes
                  if a.op == "call_function" and not _is_tensor(a)]
        for other in extra:
            if other not in kept:
                kept.add(other)
                pending.append(other)
    return kept


def buffer_neighbourhood(ep: ExportedProgram) -> ExportedProgram:
    """The part of a functional ``ep`` that decides who can own its mutated buffers.

    Each mutated buffer, the nodes computing its update, those reading its old value and
    those using its new value; any other value they read becomes a user input (parameters,
    buffers and constants stay what they are, their tensors shared with ``ep``). It returns
    each update as a ``BUFFER_MUTATION`` and, as user outputs, the values nothing in it reads.
    """
    updates = _updates(ep)
    kept = _neighbourhood_nodes(ep, updates)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    inputs: dict[Node, InputSpec] = {}
    state: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}

    def outer(node: Node) -> Node:
        """The neighbourhood's input standing for ``node`` of ``ep``."""
        if node not in env:
            if node.op == "get_attr":  # a submodule of a kept higher-order op
                env[node] = graph.node_copy(node)
                return env[node]
            placeholder = graph.placeholder(node.name)
            placeholder.meta.update(node.meta)
            spec = specs.get(node.name) if node.op == "placeholder" else None
            if spec is None or spec.kind == InputKind.USER_INPUT:
                spec = input_spec(placeholder, InputKind.USER_INPUT)
            elif spec.target in ep.state_dict:
                state[spec.target] = ep.state_dict[spec.target]
            else:
                constants[spec.target] = ep.constants[spec.target]
            inputs[placeholder] = spec
            env[node] = placeholder
        return env[node]

    for update in updates:
        outer(update.placeholder)
    for node in ep.graph.nodes:
        if node in kept:
            for arg in node.all_input_nodes:
                if arg not in kept:
                    outer(arg)
            env[node] = graph.node_copy(node, env.__getitem__)
    if all(spec.kind != InputKind.USER_INPUT for spec in inputs.values()):
        # Updates of state and constants alone (a decay `acc.mul_(0.9).add_(1.0)`): torch's
        # lift_constants_pass (to_edge lifts the scalars) misnames the constants of a
        # program with no user input (SpecViolationError), and the failed trial copied
        # every new value. One user input, unused, keeps its names right.
        first = next((n for n in ep.graph.find_nodes(op="placeholder")
                      if specs[n.name].kind == InputKind.USER_INPUT), None)
        if first is not None:
            outer(first)
    mutated = {u.value for u in updates}
    outputs = [(outer(u.value), output_spec(outer(u.value), OutputKind.BUFFER_MUTATION, u.fqn))
               for u in updates]
    outputs += [
        (env[n], output_spec(env[n], OutputKind.USER_OUTPUT))
        for n in ep.graph.nodes
        if n in kept and n not in mutated and _is_tensor(n) and not any(u in kept for u in n.users)
    ]
    graph.output(tuple(node for node, _ in outputs))
    gm = torch.fx.GraphModule(ep.graph_module, graph)
    return make_program(gm, inputs, outputs, state, constants, ep.verifiers,
                        range_constraints=ep.range_constraints)


class _TrialPartitioner(Partitioner):
    """Tags with the wrapped partitioner, records the verdicts and lowers nothing."""

    def __init__(self, partitioner: Partitioner, verdicts: Verdicts):
        super().__init__(getattr(partitioner, "spec", {}))
        self.partitioner = partitioner
        self.verdicts = verdicts
        self.leaves_owner: dict[str, bool] = {}  # owned buffer -> an op use lies outside
        self.partitioned = False

    def ops_to_not_decompose(self, ep: ExportedProgram):
        # Asked again after the partition, to check that each op kept whole was delegated:
        # the trial delegates nothing by design, so nothing is left to check (Core ML keeps
        # aten.sym_size whole, and the trial of a dynamic-shape program failed on it).
        if self.partitioned:
            return [], None
        return self.partitioner.ops_to_not_decompose(ep)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        self.partitioned = True
        result = self.partitioner.partition(exported_program)
        program = result.tagged_exported_program
        for verdict in self.verdicts(program, result.partition_tags):
            if verdict.consumable:
                output = verdict.value.graph.output_node()
                self.leaves_owner[verdict.fqn] = any(
                    u is not output and u.meta.get(DELEGATION_TAG) != verdict.owner_tag
                    for u in verdict.value.users
                )
        return PartitionResult(program, {})  # the tags were the question


@dataclass(frozen=True)
class CopyPlan:
    """Which buffers' new values get a copy, and what the trial said about the others.

    Attributes:
        copied: FQNs whose new value every use but the write-back reads through a copy.
        inside: FQNs the trial owns with every use of the new value inside the owner.
        failure: why the trial partition could not run (every shared new value is copied).
    """

    copied: frozenset[str]
    inside: frozenset[str] = frozenset()
    failure: str | None = None


def plan_new_value_copies(
    ep: ExportedProgram, partitioner: Partitioner, verdicts: Verdicts
) -> CopyPlan:
    """Decide, for a functional ``ep``, which new buffer values ``partitioner``'s owners need
    copied (see the module docstring); ``verdicts`` reads ownership off a tagged program."""
    shared = {u.fqn: u for u in _updates(ep) if u.shared}
    if not shared:
        return CopyPlan(frozenset())
    trial = _TrialPartitioner(partitioner, verdicts)
    try:
        to_edge_transform_and_lower(buffer_neighbourhood(ep), partitioner=[trial])
    except Exception as e:  # noqa: BLE001 - a failed prediction only costs copies
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return CopyPlan(frozenset(shared), failure=f"{type(e).__name__}: {first}")
    copied = {fqn for fqn, leaves in trial.leaves_owner.items()
              if fqn in shared and (leaves or shared[fqn].returned)}
    inside = {fqn for fqn in trial.leaves_owner if fqn in shared and fqn not in copied}
    return CopyPlan(frozenset(copied), frozenset(inside))
