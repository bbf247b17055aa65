"""Handing buffers over to a delegate: rebuild its lowered module so that it owns them.

The operation behind :class:`passes.ConsumeBufferMutationsInDelegate`, which decides
*which* buffers may move (:mod:`passes.delegation.ownership`). For one delegate call of a
top-level graph, each handed-over buffer becomes a ``BUFFER`` input of the delegate's
sub-program (its tensor joins the delegate's state) and the result carrying its new value
a ``BUFFER_MUTATION`` output; the call stops passing the buffer, and that result stops
being returned unless the top level still uses it. The top level's own signature is the
caller's to update.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node

from pass_manager.program import graph_module_copy

from .delegate_runtime import LoweredBackendModule
from .subprogram import input_spec, make_program, output_spec, user_input_nodes

__all__ = ["Handover", "hand_over_buffers"]


@dataclass(frozen=True)
class Handover:
    """One buffer a delegate call takes over.

    Attributes:
        fqn: the buffer's fully-qualified name.
        argument: the top-level node the call passes the buffer as.
        result_index: which result of the call (``call[i]``) is the buffer's new value.
        tensor: the buffer's tensor, which the delegate's state will hold.
        persistent: whether the buffer is persistent (state dict) or not (constants).
        keep_result: whether the top level still uses the new value besides the update.
    """

    fqn: str
    argument: Node
    result_index: int
    tensor: torch.Tensor
    persistent: bool
    keep_result: bool


def hand_over_buffers(
    gm: torch.fx.GraphModule, call: Node, handovers: Sequence[Handover]
) -> LoweredBackendModule:
    """Give ``call``'s delegate the ``handovers`` buffers; edit ``gm`` in place.

    Registers a new :class:`LoweredBackendModule` under the call's attribute name (the old
    one, possibly shared with other copies of the program, is left untouched), removes the
    buffers from the call's arguments and renumbers the ``getitem`` users of its results.
    Returns the new lowered module.
    """
    old = gm.get_submodule(call.args[0].target)
    sub = old.program
    sub_gm = graph_module_copy(sub.graph_module)
    sub_nodes = {n.name: n for n in sub_gm.graph.nodes}
    inputs = {sub_nodes[s.arg.name]: s for s in sub.graph_signature.input_specs}
    user_inputs = [sub_nodes[n.name] for n in user_input_nodes(sub)]
    state, constants = dict(sub.state_dict), dict(sub.constants)
    call_args = list(call.args[1:])
    pairs = list(zip(sub_gm.graph.output_node().args[0], sub.graph_signature.output_specs,
                     strict=True))
    mutations = [(n, s) for n, s in pairs if s.kind == OutputKind.BUFFER_MUTATION]
    results = [(n, s) for n, s in pairs if s.kind != OutputKind.BUFFER_MUTATION]
    dropped_results = set()
    position: dict[Node, int] = {}  # the first position of each argument, as list.index
    for j, arg in enumerate(call_args):
        position.setdefault(arg, j)
    for handover in handovers:
        placeholder = user_inputs[position[handover.argument]]
        inputs[placeholder] = input_spec(
            placeholder, InputKind.BUFFER, handover.fqn, handover.persistent
        )
        (state if handover.persistent else constants)[handover.fqn] = handover.tensor
        new_value = results[handover.result_index][0]
        mutations.append(
            (new_value, output_spec(new_value, OutputKind.BUFFER_MUTATION, handover.fqn))
        )
        if not handover.keep_result:
            dropped_results.add(handover.result_index)
    kept = [i for i in range(len(results)) if i not in dropped_results]
    program = make_program(
        sub_gm, inputs, mutations + [results[i] for i in kept], state, constants, sub.verifiers
    )
    lowered = LoweredBackendModule(program, old.tag, old.backend_id, old.compile_specs)
    setattr(gm, call.args[0].target, lowered)

    taken = {handover.argument for handover in handovers}
    call.args = (call.args[0], *(a for a in call_args if a not in taken))
    renumber = {old_index: new_index for new_index, old_index in enumerate(kept)}
    for user in list(call.users):
        if user.target is operator.getitem and user.args[1] in renumber:
            user.args = (call, renumber[user.args[1]])
    old_values = call.meta.get("val")
    if isinstance(old_values, tuple):
        call.meta["val"] = tuple(old_values[i] for i in kept)
    return lowered
