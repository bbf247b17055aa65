"""BufferOwningPartitioner: ExecuTorch partitioning that gives each delegate the buffers it owns.

ExecuTorch decides buffer ownership with ``tag_mutated_buffer``: a mutated buffer goes to
the smallest tag among its readers. That fails where our ``ConsumeBufferMutationsInDelegate``
succeeds: a buffer also returned as a user output (an assertion in ``to_backend``), an
update whose new value is read outside the delegate (a crash erasing a used getitem), a
buffer mutated in two partitions (a spec violation), and a buffer read in two
partitions but mutated in one (a silently wrong program). The wrapper runs any ExecuTorch
partitioner, then re-decides ownership with the same analysis as
``ConsumeBufferMutationsInDelegate`` (:func:`passes.delegation.ownership.tagged_buffer_ownership`):
a buffer exactly one partition mutates and reads is tagged into it; any other stays at the
top level and a note says why (``strict=True``: :class:`BufferConsumptionError`).

ExecuTorch lets a partitioner change tags only, so the rewrite an owned buffer needs when
its new value is used outside the owner (returned, or read by ops the partition leaves out)
happens in ``transform_for_pre_decomposition``, the hook ``to_edge_transform_and_lower``
runs first: those uses read a copy of the new value, a distinct node that ``partition``
tags into the owning delegate, so the delegate returns it as an ordinary output. The
partition is not known yet there, so a trial partition of the program's buffers decides
which new values need that copy (:mod:`passes.executorch.new_value_copies`): none where
every use stays inside the owner, which would otherwise copy a KV cache per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from executorch.exir.backend.partitioner import Partitioner, PartitionResult
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from ..delegation.errors import BufferConsumptionError
from ..delegation.ownership import BufferOwnership, tagged_buffer_ownership
from ..delegation.partitioners import DELEGATION_TAG
from .new_value_copies import (
    CopyPlan,
    functional,
    plan_new_value_copies,
    separate_new_buffer_values,
)

__all__ = ["BufferOwningPartitioner", "executorch_state", "separate_new_buffer_values"]

PASS_NAME = "BufferOwningPartitioner"


def _is_value_copy(node: Node) -> bool:
    """A clone of one value, in any dialect (the copies ``separate_new_buffer_values`` adds
    become ``_clone_dim_order`` in Edge; any other clone is as pure, so it may move too)."""
    name = str(getattr(node.target, "__name__", node.target))
    return node.op == "call_function" and "clone" in name and len(node.all_input_nodes) == 1


class BufferOwningPartitioner(Partitioner):
    """An ExecuTorch partitioner wrapping ``partitioner`` that decides buffer ownership.

    Args:
        partitioner: any ExecuTorch ``Partitioner`` (``AllNodePartitioner``,
            ``XnnpackPartitioner``, a backend's own); it tags the nodes, this decides which
            mutable buffers each partition owns.
        strict: raise :class:`BufferConsumptionError` (naming the buffer and the partitions)
            instead of keeping a buffer that a partition mutates at the top level.
        own_buffers: whether the backends can own mutable buffers. ``None`` (default): a
            backend can if the wrapped partitioner gave any of its partitions a mutable
            buffer (as stateful backends' partitioners do, e.g. with ExecuTorch's
            ``tag_mutated_buffer``); XNNPACK's gives none, and an XNNPACK delegate handed a
            buffer to update crashes the runtime, so its buffers stay at the top level.

    After ``transform_for_pre_decomposition``, ``copy_plan`` says which new buffer values
    got a copy for their uses outside the owner (:class:`CopyPlan`). After each
    ``partition`` call, ``notes`` says what happened to every mutable buffer and
    ``ownership`` holds the verdicts (:class:`BufferOwnership`).

    Example:
        >>> wrapped = BufferOwningPartitioner(XnnpackPartitioner())
        >>> to_edge_transform_and_lower(ep, partitioner=[wrapped])
    """

    def __init__(
        self, partitioner: Partitioner, strict: bool = False, own_buffers: bool | None = None
    ):
        super().__init__(getattr(partitioner, "spec", {}))
        self.partitioner = partitioner
        self.strict = strict
        self.own_buffers = own_buffers
        self.notes: list[str] = []
        self.ownership: list[BufferOwnership] = []
        self.copy_plan: CopyPlan | None = None

    def __repr__(self) -> str:
        return (f"{PASS_NAME}({self.partitioner!r}, strict={self.strict}, "
                f"own_buffers={self.own_buffers})")

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[Node], bool] | None]:
        return self.partitioner.ops_to_not_decompose(ep)

    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        program = self.partitioner.transform_for_pre_decomposition(exported_program)
        # The copies only serve a delegate that owns the buffer and leave it by a use outside
        # (any other copy is one whole-buffer copy per call for nothing), so the trial
        # partition decides which new values need one.
        if self.own_buffers is False:
            self.copy_plan = CopyPlan(frozenset())
            return program
        program = functional(program)
        self.copy_plan = plan_new_value_copies(program, self.partitioner, self._verdicts)
        return separate_new_buffer_values(program, self.copy_plan.copied)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        graph = exported_program.graph
        before = {node: node.meta.get(DELEGATION_TAG) for node in graph.nodes}
        result = self.partitioner.partition(exported_program)
        program = result.tagged_exported_program
        verdicts = self._verdicts(program, result.partition_tags)
        owned = []
        for verdict in verdicts:
            if verdict.consumable:
                copies = self._value_copies(verdict)
                if copies is None:
                    verdict.reason = self._unreturnable(verdict)
                    verdict.owner_tag = None
                else:
                    owned.append((verdict, copies))
        refused = [v for v in verdicts if not v.consumable and v.mutated_by]
        if self.strict and refused:
            self._restore(graph, before)
            v = refused[0]
            raise BufferConsumptionError(v.fqn, v.partitions, v.reason, PASS_NAME)
        notes = []
        if self.copy_plan is not None and self.copy_plan.failure is not None:
            notes.append(
                f"the trial partition deciding the copies of new buffer values failed "
                f"({self.copy_plan.failure}): every such value used besides its write-back "
                "was copied"
            )
        for verdict in verdicts:
            if not verdict.consumable:
                # ExecuTorch reads ownership from the placeholder's tag; untagged stays on top.
                verdict.placeholder.meta.pop(DELEGATION_TAG, None)
                notes.append(f"kept {verdict.fqn!r} at the top level: {verdict.reason}")
        for verdict, copies in owned:
            verdict.placeholder.meta[DELEGATION_TAG] = verdict.owner_tag
            for node in copies:
                node.meta[DELEGATION_TAG] = verdict.owner_tag
            copied = copies or [u for u in verdict.value.users if _is_value_copy(u)]
            shared = " (and returns its new value as an ordinary output)" if copied else ""
            notes.append(f"{verdict.fqn!r} owned by partition {verdict.owner_tag!r}{shared}")
        self.notes, self.ownership = notes, verdicts
        return PartitionResult(program, result.partition_tags)

    def _verdicts(
        self, program: ExportedProgram, partition_tags: dict[str, Any]
    ) -> list[BufferOwnership]:
        """Who may own each mutated buffer of tagged ``program``, copies aside."""
        verdicts = tagged_buffer_ownership(program)
        stateful = self._stateful_backends(verdicts, partition_tags)
        for verdict in verdicts:
            backend = self._backend(partition_tags, verdict.owner_tag)
            if verdict.consumable and backend not in stateful:
                verdict.reason = (
                    f"partition {verdict.owner_tag!r} runs on {backend}, whose partitioner gives "
                    "its delegates no mutable buffers (own_buffers=True overrides)"
                )
                verdict.owner_tag = None
        return verdicts

    @staticmethod
    def _backend(partition_tags: dict[str, Any], tag: str | None) -> str | None:
        spec = partition_tags.get(tag) if tag is not None else None
        return getattr(spec, "backend_id", None)

    def _stateful_backends(
        self, verdicts: list[BufferOwnership], partition_tags: dict[str, Any]
    ) -> set[str | None]:
        """Backends whose delegates may own buffers: all, none, or those given one."""
        backends = {self._backend(partition_tags, tag) for tag in partition_tags}
        if self.own_buffers is not None:
            return backends if self.own_buffers else set()
        return {
            self._backend(partition_tags, v.placeholder.meta.get(DELEGATION_TAG))
            for v in verdicts if v.placeholder.meta.get(DELEGATION_TAG) in partition_tags
        }

    @staticmethod
    def _value_copies(verdict: BufferOwnership) -> list[Node] | None:
        """The copies carrying the new value out of the owner, or None if another use does."""
        tag = verdict.owner_tag
        output = verdict.value.graph.output_node()
        returned = output.args[0]
        if sum(1 for arg in returned if arg is verdict.value) > 1:
            return None
        outside = [
            u for u in verdict.value.users
            if u is not output and u.meta.get(DELEGATION_TAG) != tag
        ]
        if not all(_is_value_copy(u) for u in outside):
            return None
        return outside

    def _unreturnable(self, verdict: BufferOwnership) -> str:
        users = ", ".join(sorted(u.name for u in verdict.value.users if u.op != "output"))
        used = (
            f"its new value {verdict.value.name} is also used outside partition "
            f"{verdict.owner_tag!r} ({users or 'returned'}), which ExecuTorch cannot lower for "
            "an owned buffer"
        )
        if self.copy_plan is not None and verdict.fqn in self.copy_plan.inside:
            return (f"{used}; the trial partition run before decomposition kept every use "
                    "inside its owner, so no copy carries the value out")
        return (f"{used}; lower with to_edge_transform_and_lower, whose "
                "transform_for_pre_decomposition hook gives those uses a copy")

    @staticmethod
    def _restore(graph: torch.fx.Graph, before: dict[Node, Any]) -> None:
        for node in graph.nodes:
            tag = before.get(node)
            if tag is None:
                node.meta.pop(DELEGATION_TAG, None)
            else:
                node.meta[DELEGATION_TAG] = tag


def executorch_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of a program lowered by ExecuTorch, by FQN: its own and its delegates'.

    A state reader for :func:`pass_manager.assert_same_behaviour` on
    ``lowered.exported_program()``: a buffer a delegate owns lives in that delegate's
    original program (which ExecuTorch's Python execution of the delegate updates).
    """
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    state = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    for sub in module.modules():
        if isinstance(sub, LoweredBackendModule):
            owned = sub.original_module
            for spec in owned.graph_signature.input_specs:
                if spec.kind == InputKind.BUFFER and spec.target in owned.state_dict:
                    state[spec.target] = owned.state_dict[spec.target].detach().clone()
                elif spec.kind == InputKind.BUFFER and spec.target in owned.constants:
                    state[spec.target] = owned.constants[spec.target].detach().clone()
    return state
