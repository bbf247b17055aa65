"""ConsumeBufferMutationsInDelegate: move each mutable buffer into the delegate that updates it.

After :func:`passes.delegation.to_delegate` the top level still owns every buffer: it
passes the buffer to the delegate and writes the delegate's result back (a
``BUFFER_MUTATION`` output). A backend that keeps its KV cache in device memory wants
the buffer itself. This pass hands it over wherever that is provably correct (the
rules are in :mod:`passes.delegation.ownership`), and reports why it kept the others.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
)
from torch.fx import Node

from pass_manager import EXPORTED_PROGRAM, Effects, Pass, PassResult
from pass_manager.program import graph_module_copy

from ._analysis.aliasing import alias_map
from ._analysis.buffer_conditions import Functional
from .delegation.buffer_handover import Handover, hand_over_buffers
from .delegation.errors import BufferAliasingError, BufferConsumptionError
from .delegation.ownership import BufferMutationsInDelegates, BufferOwnership, buffer_ownership
from .delegation.partitions_to_delegates import delegates
from .delegation.subprogram import user_input_nodes

__all__ = ["ConsumeBufferMutationsInDelegate"]


def _storage_key(tensor: Any) -> tuple[int, int] | None:
    if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().nbytes() == 0:
        return None
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


# The reasons ``buffer_ownership`` gives, by a phrase each contains (the reason itself
# names nodes and delegates, which would make every buffer its own statistic).
_REASON_KINDS = (
    ("computed outside any delegate", "update computed outside any delegate"),
    ("mutated in", "mutated in several delegates"),
    ("part of its update", "update partly computed outside delegates"),
    ("read outside", "read outside its delegate"),
)


def _old_value_outputs(call: Node) -> dict[Node, Node]:
    """Per argument of a delegate call, the first result of the delegate that is (a view
    of) that argument's value as passed in: one walk per delegate, not one per buffer."""
    sub = call.graph.owning_module.get_submodule(call.args[0].target).program
    aliases = alias_map(sub.graph.nodes)[0]
    first_view: dict[Node, Node] = {}
    for node in sub.graph.output_node().args[0]:
        alias = aliases.get(node) if isinstance(node, Node) else None
        if alias is not None:
            first_view.setdefault(alias.root, node)
    first_input: dict[Node, Node] = {}  # an argument passed twice is read as the first
    for arg, placeholder in zip(call.args[1:], user_input_nodes(sub), strict=True):
        if isinstance(arg, Node):
            first_input.setdefault(arg, placeholder)
    return {arg: first_view[p] for arg, p in first_input.items() if p in first_view}


def _reason_kind(reason: str) -> str:
    return next((kind for phrase, kind in _REASON_KINDS if phrase in reason), reason)


@dataclass(frozen=True, repr=False)
class ConsumeBufferMutationsInDelegate(Pass):
    """Move every mutable buffer that exactly one delegate updates into that delegate.

    Accepts an ExportedProgram only. It does not rewrite the program it is given: when it
    moves a buffer it returns a new ExportedProgram (``Effects.rewrite(in_place=False)``),
    and the input keeps working as before.

    Before (top level, and the delegate's sub-program)::

        b_cache: BUFFER 'cache'                 sub: cache: USER_INPUT, x: USER_INPUT
        d = call_delegate(lowered_0, b_cache, x)     index_copy: USER_OUTPUT
        getitem = d[0]                               mul: USER_OUTPUT
        getitem_1 = d[1]
        return (getitem, getitem_1)   # BUFFER_MUTATION 'cache', USER_OUTPUT

    After::

        d = call_delegate(lowered_0, x)         sub: cache: BUFFER 'cache', x: USER_INPUT
        getitem_1 = d[0]                             index_copy: BUFFER_MUTATION 'cache'
        return (getitem_1,)           # USER_OUTPUT  mul: USER_OUTPUT

    Rules: a buffer mutated and read only inside one delegate moves there (if its new
    value is also used outside, e.g. returned, the delegate returns it as a user output
    too). A buffer read outside its mutating delegate, or mutated by two delegates,
    stays at the top level (the program stays correct; the notes say why), or raises
    :class:`BufferConsumptionError` with ``strict=True``. A buffer whose update no
    delegate computes is simply not a candidate (a note, never an error). State that
    aliases other state,
    or a delegate output that is a view of the old buffer value, raises
    :class:`BufferAliasingError` and leaves the program unchanged.

    Raises:
        PreconditionError: Functional does not hold: the program still writes in place
            (run MarkMutableBuffers and InplaceToFunctional before lowering).
        ProgramFormError: a GraphModule (pass the ExportedProgram), or no program at all.
        PassFailedError: run by a PassManager or called as ``pass_(program)``, in place
            of the errors below (its ``__cause__``); the program is left as it was.
        BufferConsumptionError: raised by ``call`` with ``strict=True`` when a buffer a
            delegate mutates is also read outside it, or is mutated by several delegates.
        BufferAliasingError: raised by ``call`` when a buffer to move shares storage with
            other state, or a delegate returns (a view of) the buffer's old value.
    """

    requires = frozenset({Functional})
    provides = frozenset({BufferMutationsInDelegates})
    preserves = frozenset({Functional})
    accepts = (EXPORTED_PROGRAM,)
    effects = Effects.rewrite(in_place=False)  # a new program; its input is left untouched

    strict: bool = False

    def call(self, program: ExportedProgram) -> PassResult:
        verdicts = buffer_ownership(program)
        kept = [v for v in verdicts if not v.consumable]
        notes = [f"kept {v.fqn!r} at the top level: {v.reason}" for v in kept]
        refused = [v for v in kept if v.mutated_by]
        if self.strict and refused:
            v = refused[0]
            raise BufferConsumptionError(v.fqn, v.partitions, v.reason, self.name)
        consumed = [v for v in verdicts if v.consumable]
        statistics = {"buffers moved into a delegate": len(consumed)}
        for v in kept:
            key = f"buffers kept at the top level: {_reason_kind(v.reason or '')}"
            statistics[key] = statistics.get(key, 0) + 1
        if not consumed:
            return PassResult(program, False, notes, statistics)
        self._check_aliasing(program, consumed)
        new_program = self._consume(program, consumed)
        for v in consumed:
            shared = " (and returns its new value as a user output)" if v.value_kept else ""
            notes.append(f"moved {v.fqn!r} into delegate {v.mutated_by[0]!r}{shared}")
        return PassResult(new_program, True, notes, statistics)

    # -- checks, before anything changes ------------------------------------------------
    def _check_aliasing(self, ep: ExportedProgram, consumed: list[BufferOwnership]) -> None:
        holders: dict[tuple[int, int], list[str]] = defaultdict(list)
        stores = [("", ep.state_dict), ("", ep.constants)]
        stores += [(f"delegate {d.tag!r}: ", d.program.state_dict) for d in delegates(ep)]
        stores += [(f"delegate {d.tag!r}: ", d.program.constants) for d in delegates(ep)]
        for prefix, store in stores:
            for name, tensor in store.items():
                key = _storage_key(tensor)
                if key is not None:
                    holders[key].append(prefix + name)
        old_values: dict[Node, dict[Node, Node]] = {}  # per delegate call, read once
        for v in consumed:
            tag = v.mutated_by[0]
            tensor = ep.state_dict.get(v.fqn, ep.constants.get(v.fqn))
            others = [h for h in holders.get(_storage_key(tensor), []) if h != v.fqn]
            if others:
                shared = ", ".join(map(repr, others))
                raise BufferAliasingError(
                    v.fqn, tag, f"its tensor shares storage with {shared}", self.name
                )
            if v.owner not in old_values:
                old_values[v.owner] = _old_value_outputs(v.owner)
            node = old_values[v.owner].get(v.placeholder)
            if node is not None:
                raise BufferAliasingError(
                    v.fqn, tag,
                    f"delegate output {node.name} is (a view of) the buffer's value before "
                    "the update, which an in-place update inside the delegate would change",
                    self.name,
                )

    # -- the rewrite, on a copy ---------------------------------------------------------
    def _consume(self, ep: ExportedProgram, consumed: list[BufferOwnership]) -> ExportedProgram:
        gm = graph_module_copy(ep.graph_module)
        nodes = {n.name: n for n in gm.graph.nodes}
        by_owner: dict[str, list[BufferOwnership]] = defaultdict(list)
        for v in consumed:
            by_owner[v.owner.name].append(v)
        top_specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        for owner_name, owned in by_owner.items():
            handovers = []
            for v in owned:
                persistent = bool(top_specs[v.placeholder.name].persistent)
                tensor = (ep.state_dict if persistent else ep.constants)[v.fqn]
                argument = nodes[v.placeholder.name]
                handovers.append(
                    Handover(v.fqn, argument, v.value.args[1], tensor, persistent, v.value_kept)
                )
            hand_over_buffers(gm, nodes[owner_name], handovers)
        dropped_outputs = {v.output_index for v in consumed}
        output = gm.graph.output_node()
        output.args = (tuple(a for i, a in enumerate(output.args[0]) if i not in dropped_outputs),)
        for v in consumed:
            value = nodes[v.value.name]
            if not value.users:
                gm.graph.erase_node(value)
            gm.graph.erase_node(nodes[v.placeholder.name])
        gm.graph.lint()
        targets = {v.fqn for v in consumed}
        placeholders = {v.placeholder.name for v in consumed}
        signature = ExportGraphSignature(
            [s for s in ep.graph_signature.input_specs if s.arg.name not in placeholders],
            [s for i, s in enumerate(ep.graph_signature.output_specs) if i not in dropped_outputs],
        )
        return ep._update(
            gm,
            signature,
            state_dict={k: t for k, t in ep.state_dict.items() if k not in targets},
            constants={k: t for k, t in ep.constants.items() if k not in targets},
        )
