"""Making carried state resident: the rewrite :class:`passes.InputsToBuffers` plans.

Each :class:`Carried` is one piece of state: an input (or, for state the graph creates, no
input) that becomes a non-persistent buffer, the value the program writes into it, and the
outputs that carried that value out, which leave the call signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.fx import GraphModule, Node

from .._analysis.buffers import INITIAL_META, MUTABLE_BUFFER_META, MUTABLE_INPUT_META
from .._analysis.marked_state import initial_copy
from .._lifting.state import export_name
from .record import EXAMPLE_META, CarriedRecord, Moved, records_of, set_records
from .specs import kept_arg_names, output_names, without_leaves
from .view import ProgramView

__all__ = ["Carried", "make_resident", "register_buffer"]


@dataclass
class Carried:
    """One piece of state to make resident.

    Attributes:
        buffer: the buffer's FQN.
        input: the input placeholder (None: state the graph creates and returns).
        value: the node whose value the program writes into the state.
        output_indices: flat positions of the outputs that return that value and go.
        in_place: the program writes the input in place.
        initial: the buffer's initial value.
    """

    buffer: str
    input: Node | None
    value: Node
    output_indices: tuple[int, ...]
    in_place: bool
    initial: torch.Tensor


def register_buffer(gm: torch.nn.Module, fqn: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` as the non-persistent buffer ``fqn`` of ``gm``, making the
    submodules on its path as needed."""
    *path, leaf = fqn.split(".")
    owner = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    owner.register_buffer(leaf, tensor, persistent=False)


def _mark(node: Node, state: Carried) -> None:
    node.meta.pop(MUTABLE_INPUT_META, None)
    node.meta.pop(EXAMPLE_META, None)
    node.meta[MUTABLE_BUFFER_META] = state.buffer
    node.meta[INITIAL_META] = initial_copy(state.initial)


def make_resident(view: ProgramView, carried: list[Carried], refuse: Any) -> Any:
    """The program of ``view`` with each of ``carried`` a resident buffer; ``refuse(what,
    names)`` gives the ``refuse`` of :func:`~.specs.without_leaves` for the inputs or the
    outputs (``names``: their flat names), the error for one that cannot leave its container
    alone."""
    inputs_before = list(view.inputs)
    dropped_inputs = {inputs_before.index(c.input) for c in carried if c.input is not None}
    dropped_outputs = {i for c in carried for i in c.output_indices}
    in_spec = without_leaves(view.in_spec, dropped_inputs,
                             refuse("input", [p.name for p in inputs_before]), keep=2)
    out_spec = without_leaves(view.out_spec, dropped_outputs,
                              refuse("output", output_names(view.out_spec)))
    example_inputs = None
    if view.exported and view.source.example_inputs is not None:
        leaves = pytree.tree_leaves(view.source.example_inputs)
        kept = [v for i, v in enumerate(leaves) if i not in dropped_inputs]
        example_inputs = pytree.tree_unflatten(kept, in_spec)
    view.inputs = [p for p in view.inputs if p not in {c.input for c in carried}]
    view.outputs = [o for i, o in enumerate(view.outputs) if i not in dropped_outputs]
    if view.exported:
        _into_exported(view, carried)
    else:
        _into_graph_module(view, carried)
    _own_values(view)
    moved = tuple(Moved(c.buffer, c.input.name if c.input is not None else None,
                        inputs_before.index(c.input) if c.input is not None else None,
                        c.output_indices, c.in_place) for c in carried)
    names = view.arg_names()
    record = CarriedRecord(view.in_spec, view.out_spec, moved,
                           view.source.example_inputs if view.exported else None,
                           tuple(names) if names is not None else None, in_spec, out_spec)
    set_records(view.gm.meta, (*records_of(view.gm), record))
    arg_names = kept_arg_names(view.arg_names(), view.in_spec, in_spec, dropped_inputs)
    return view.build(in_spec, out_spec, example_inputs, arg_names)


def _own_values(view: ProgramView) -> None:
    """Each write its own value, as the functionalizer leaves them: a value that is a piece
    of state's read (state paired with another's old value: ``return x, b, a``) becomes a
    ``clone`` taken before any write-back, or the GraphModule's trailing ``copy_`` nodes
    would read a state already written; a value written into two pieces of state (two
    inputs paired with one output) gets ``aten.copy(state, value)`` for the second, since
    torch's signature keys mutations by output name and would collapse them."""
    graph = view.gm.graph
    output = graph.output_node()
    seen: set[Node] = set()
    for target, value in list(view.writes.items()):
        if value.op in ("placeholder", "get_attr"):
            with graph.inserting_before(output):
                value = graph.call_function(torch.ops.aten.clone.default, (value,))
        elif value in seen:
            with graph.inserting_before(output):
                value = graph.call_function(torch.ops.aten.copy.default, (target, value))
        else:
            seen.add(value)
            continue
        value.meta["val"] = target.meta.get("val")
        seen.add(value)
        view.writes[target] = value


def _into_exported(view: ProgramView, carried: list[Carried]) -> None:
    graph = view.gm.graph
    for state in carried:
        node = state.input
        if node is None:
            anchor = view.inputs[0] if view.inputs else None
            with graph.inserting_before(anchor) if anchor is not None else graph.inserting_after(
                    graph.find_nodes(op="placeholder")[-1]):
                node = graph.placeholder(export_name(InputKind.BUFFER, state.buffer))
            node.meta["val"] = state.value.meta["val"]
        elif view.inputs:
            view.inputs[0].prepend(node)  # state comes before the user inputs
        _mark(node, state)
        view.specs[node] = InputSpec(InputKind.BUFFER, TensorArgument(node.name),
                                     target=state.buffer, persistent=False)
        view.writes[node] = state.value
        view.constants[state.buffer] = state.initial


def _into_graph_module(view: ProgramView, carried: list[Carried]) -> None:
    gm: GraphModule = view.gm
    graph = gm.graph
    anchor = graph.find_nodes(op="placeholder")[-1] if graph.find_nodes(
        op="placeholder") else None
    reads: dict[Node, Node] = {}  # each input made a buffer -> the get_attr replacing it
    for state in carried:
        register_buffer(gm, state.buffer, state.initial)
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                read = graph.get_attr(state.buffer)
        else:
            with graph.inserting_after(anchor):
                read = graph.get_attr(state.buffer)
        if state.input is not None:
            read.meta = dict(state.input.meta)
            state.input.replace_all_uses_with(read)
            view.writes = {(read if k is state.input else k): v for k, v in view.writes.items()}
            if anchor is state.input:
                anchor = read
            graph.erase_node(state.input)
            reads[state.input] = read
        else:
            read.meta["val"] = state.value.meta["val"]
        anchor = read
        _mark(read, state)
        view.writes[read] = state.value
    # A value that is itself an input made a buffer (a pass-through pair ``return x, h``, a
    # state written with another's old value) is that buffer's read now.
    view.writes = {k: reads.get(v, v) for k, v in view.writes.items()}
    view.outputs = [reads.get(o, o) if isinstance(o, Node) else o for o in view.outputs]
