"""Making resident state explicit I/O: the rewrite :class:`passes.BuffersToInputs` plans.

Each buffer's node becomes an input placeholder; the value the program writes into it is
written into that input in place, or returned. Restoring an InputsToBuffers record puts every
input and output back where it was (same names, specs, example inputs); other buffers become
keyword inputs named by their FQN as a Python name (``layers_0_k_cache``), their new values
appended to the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.fx import Node

from .._analysis.buffers import INITIAL_META, MUTABLE_BUFFER_META, MUTABLE_INPUT_META
from .record import EXAMPLE_META, CarriedRecord, set_records
from .specs import with_leaves
from .view import ProgramView

__all__ = ["Explicit", "make_explicit"]


@dataclass
class Explicit:
    """One buffer to make an input.

    Attributes:
        buffer: its FQN.
        nodes: the nodes reading it (its placeholder, or every get_attr of it).
        value: the value the program writes into it (None: it is only read).
        in_place: write that value into the input (else return it).
        input_name: the input's name (a restored record's, or the buffer's FQN as a Python
            name).
        input_index: its flat input position (a restored record), else appended.
        output_indices: where its value is returned (a restored record), else appended
            once when not in place.
        keep_input: False for state a restored prefill created: no input comes back.
        tied: the other names of the buffer's tensor (their nodes are in ``nodes``): they
            leave the program's state with it.
    """

    buffer: str
    nodes: list[Node]
    value: Node | None
    in_place: bool
    input_name: str
    input_index: int | None = None
    output_indices: tuple[int, ...] = ()
    keep_input: bool = True
    tied: tuple[str, ...] = ()


def _remove_buffer(view: ProgramView, fqn: str) -> None:
    if view.exported:
        view.constants.pop(fqn, None)
        return
    *path, leaf = fqn.split(".")
    owner = view.gm
    for part in path:
        owner = getattr(owner, part)
    owner._buffers.pop(leaf, None)


def _clear_marks(node: Node, state: Explicit, exported: bool) -> None:
    node.meta.pop(MUTABLE_BUFFER_META, None)
    node.meta.pop(INITIAL_META, None)
    if state.in_place and state.value is not None:
        # The input's name, as MarkMutableBuffers gives it: a GraphModule's placeholder is
        # called by its target (its node may be ``total_1`` beside the buffer's ``total``).
        node.meta[MUTABLE_INPUT_META] = node.name if exported else str(node.target)


def make_explicit(view: ProgramView, explicit: list[Explicit], record: CarriedRecord | None,
                  records: tuple[CarriedRecord, ...] | None) -> torch.nn.Module:
    """The program of ``view`` with each of ``explicit`` an input; with ``record``, the call
    signature before it restored exactly, the buffers it did not move appended to it as
    keywords. ``records``: the InputsToBuffers records the result keeps (None: the
    program's, unchanged)."""
    graph = view.gm.graph
    inputs = list(view.inputs)
    outputs = list(view.outputs)
    placed: list[tuple[int, Node]] = []
    returned: list[tuple[int, Node]] = []
    new_keywords: dict[str, int] = {}
    replaced: dict[Node, Node] = {}  # each buffer read erased -> the input replacing it
    for state in explicit:
        for old in state.nodes:
            view.writes.pop(old, None)
        node = _input_node(view, state) if state.keep_input else None
        if node is not None and not view.exported:
            node.meta[EXAMPLE_META] = _held(view, state.buffer)
        for old in state.nodes:
            if old is not node:
                if node is not None:
                    old.replace_all_uses_with(node)
                    replaced[old] = node
                graph.erase_node(old)
        for fqn in (state.buffer, *state.tied):
            _remove_buffer(view, fqn)
        if node is not None:
            _clear_marks(node, state, view.exported)
            if view.exported:
                view.specs[node] = InputSpec(InputKind.USER_INPUT, TensorArgument(node.name),
                                             target=None)
            if state.input_index is None:
                inputs.append(node)
                new_keywords[state.input_name] = 0
            else:
                placed.append((state.input_index, node))
            if state.in_place and state.value is not None:
                view.writes[node] = state.value
        if (state.value is not None and not state.in_place) or state.output_indices:
            indices = state.output_indices or (None,)
            value = _returned_value(state.value, node)
            returned.extend((i, value) for i in indices)
    # A value that is itself a buffer's read (state passed through unchanged) is its input.
    view.writes = {k: replaced.get(v, v) for k, v in view.writes.items()}
    # One output paired with several states (one value into two) comes back once.
    returned = [(i, replaced.get(v, v)) for n, (i, v) in enumerate(returned)
                if i is None or all(j != i for j, _ in returned[:n])]
    outputs = [replaced.get(o, o) if isinstance(o, Node) else o for o in outputs]
    for index, node in sorted(placed, key=lambda p: p[0]):
        inputs.insert(index, node)
    for index, value in sorted((r for r in returned if r[0] is not None), key=lambda r: r[0]):
        outputs.insert(index, value)
    outputs.extend(value for index, value in returned if index is None)
    _order_placeholders(view, inputs)
    view.inputs, view.outputs = inputs, outputs
    # Restoring a record, its signature is the one the others are appended to.
    in_spec, out_spec = (record.in_spec, record.out_spec) if record is not None else (
        view.in_spec, view.out_spec)
    names = (list(record.arg_names) if record.arg_names is not None else None
             ) if record is not None else view.arg_names()
    example_inputs = (_restored_examples(view, explicit, record) if record is not None
                      else view.source.example_inputs if view.exported else None)
    if records is not None:
        set_records(view.gm.meta, records)
    if new_keywords:
        in_spec = with_leaves(in_spec, new_keywords)
    appended = sum(1 for index, _ in returned if index is None)
    if appended:
        leaves = [pytree.tree_structure(0)] * appended
        out_spec = (pytree.TreeSpec(tuple, None, [*out_spec.children(), *leaves])
                    if out_spec.type is tuple else
                    pytree.TreeSpec(tuple, None, [out_spec, *leaves]))
    if names is not None:
        names = names + list(new_keywords)
    if example_inputs is not None and new_keywords:
        args, kwargs = example_inputs
        kwargs = dict(kwargs)
        for state in explicit:
            if state.keep_input and state.input_index is None:
                kwargs[state.input_name] = _initial(view, state)
        example_inputs = (args, kwargs)
    return view.build(in_spec, out_spec, example_inputs, names)


def _returned_value(value: Node, node: Node | None) -> Node:
    """The value to return for state written in place with ``value``: the source of the
    functionalizer's own copy (``aten.copy(node, source)``, a mutation output's value of its
    own), so the output and the write stay two values as they were."""
    if (node is not None and value.target is torch.ops.aten.copy.default
            and value.args[0] is node):
        return value.args[1]
    return value


def _restored_examples(view: ProgramView, explicit: list[Explicit], record: CarriedRecord
                       ) -> Any:
    """The record's example inputs, an input restored given the buffer's value where the
    buffer no longer has the dtype or shape of the example (stored as integers since, by
    QuantizeMutableBuffers): the program's example inputs are a call it takes. A record read
    back from a saved program kept none: the program's own, each input restored given the
    buffer's value."""
    if not view.exported:
        return record.example_inputs
    if record.loaded:
        if view.source.example_inputs is None:
            return None
        leaves = pytree.tree_leaves(view.source.example_inputs)
        for state in sorted((s for s in explicit if s.keep_input and s.input_index is not None),
                            key=lambda s: s.input_index):
            leaves.insert(state.input_index, _initial(view, state))
        return pytree.tree_unflatten(leaves, record.in_spec)
    if record.example_inputs is None:
        return record.example_inputs
    leaves, spec = pytree.tree_flatten(record.example_inputs)
    for state in explicit:
        if not state.keep_input or state.input_index is None:
            continue
        leaf, held = leaves[state.input_index], _initial(view, state)
        if isinstance(leaf, torch.Tensor) and (leaf.dtype != held.dtype
                                               or leaf.shape != held.shape):
            leaves[state.input_index] = held
    return pytree.tree_unflatten(leaves, spec)


def _initial(view: ProgramView, state: Explicit) -> torch.Tensor:
    source = view.source
    held = source.constants if state.buffer in source.constants else source.state_dict
    return held[state.buffer].clone()


def _held(view: ProgramView, fqn: str) -> torch.Tensor:
    """A copy of the value a GraphModule's buffer ``fqn`` holds (before it is removed)."""
    *path, leaf = fqn.split(".")
    owner = view.gm
    for part in path:
        owner = getattr(owner, part)
    return owner._buffers[leaf].detach().clone()


def _input_node(view: ProgramView, state: Explicit) -> Node:
    """The placeholder the buffer becomes: its own placeholder (EP), or a new one (GM)."""
    graph = view.gm.graph
    if view.exported:
        node = state.nodes[0]
        if state.input_index is None and node.name != state.input_name:
            node._rename(state.input_name)
        return node
    placeholders = graph.find_nodes(op="placeholder")
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        with graph.inserting_before(next(iter(graph.nodes))):
            node = graph.placeholder(state.input_name)
    else:
        with graph.inserting_after(anchor):
            node = graph.placeholder(state.input_name)
    node.meta = dict(state.nodes[0].meta)
    return node


def _order_placeholders(view: ProgramView, inputs: list[Node]) -> None:
    """The user inputs last among the placeholders, in call order."""
    placeholders = view.gm.graph.find_nodes(op="placeholder")
    rest = [p for p in placeholders if p not in set(inputs)]
    anchor = rest[-1] if rest else None
    for node in inputs:
        if anchor is None:
            first = next(iter(view.gm.graph.nodes))
            if first is not node:
                first.prepend(node)
        else:
            anchor.append(node)
        anchor = node
