"""The conditions on a program's state: every mutated buffer is marked, nothing writes in place.

Defined beside the shared buffer view (:mod:`passes._analysis.buffers`) their checks read;
:mod:`passes.conditions` re-exports them for users.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from pass_manager import Condition, graph_module_of

from .buffers import (
    BUFFER,
    INITIAL_META,
    LIFTED_GRAPH_HINT,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    PARAMETER,
    USER_INPUT,
    State,
    find_mutations,
    hop_writes,
    lifted_state_kind,
    trailing_write_backs,
)
from .op_schema import may_write, written_nodes

__all__ = ["Functional", "MutableBuffersMarked"]


def _unmarked(program: Any, node: Node, state: State, written_by: str, key: str) -> str:
    """The violation of a written state node left unmarked, speaking of a buffer as a
    buffer: in the lifted graph of an ExportedProgram a buffer is an input, said so."""
    lifted = lifted_state_kind(program, node) if state.kind == USER_INPUT else None
    if lifted is not None:
        return (f"{node.name}: input {state.name!r}, named like a {lifted} torch.export "
                f"lifted to an input, is written by {written_by} but not marked "
                f"(meta[{key!r}]); {LIFTED_GRAPH_HINT}")
    kind = "user input" if state.kind == USER_INPUT else state.kind
    return (f"{node.name}: {kind} {state.name!r} is written by {written_by} but not marked "
            f"(meta[{key!r}])")


def _unmarked_mutable_buffers(program: Any) -> list[str]:
    scan = find_mutations(program)
    violations = []
    for state, writers in scan.writers.items():
        key = {BUFFER: MUTABLE_BUFFER_META, PARAMETER: MUTABLE_BUFFER_META,
               USER_INPUT: MUTABLE_INPUT_META}.get(state.kind)
        if key is None:
            continue
        written_by = ", ".join(n.name for n in writers if n is not None)
        for node in scan.nodes_of(state):
            if node.meta.get(key) != state.name:
                violations.append(_unmarked(program, node, state, written_by, key))
            elif state.kind != USER_INPUT and node.meta.get(INITIAL_META) is None:
                violations.append(
                    f"{node.name}: {state.kind} {state.name!r} has no initial value kept")
    return violations


MutableBuffersMarked = Condition(
    "MutableBuffersMarked",
    _unmarked_mutable_buffers,
    doc="Every buffer or parameter the program writes (in place, through views, by a "
    "trailing copy_ or a BUFFER_MUTATION / PARAMETER_MUTATION output) has "
    "meta['mutable_buffer'] = its FQN and a kept initial value "
    "on each of its nodes; every mutated user input has meta['mutable_user_input'].",
)


def _in_place_writes(program: Any) -> list[str]:
    is_ep = isinstance(program, ExportedProgram)
    allowed = set() if is_ep else set(trailing_write_backs(program))
    violations = []
    gm = graph_module_of(program)
    for node in _possible_writers(gm.graph):
        if node in allowed:
            continue
        written = written_nodes(node)
        if written:
            names = ", ".join(n.name for n in written)
            violations.append(f"{node.name}: {node.target} writes its argument(s) {names}")
        elif node.op == "call_method" and str(node.target).endswith("_"):
            violations.append(f"{node.name}: in-place method {node.target!r}")
        elif (hop := hop_writes(node, gm)) is not None:
            violations.append(f"{node.name}: {hop.reason}")
    return violations


def _possible_writers(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """In graph order, the nodes that may write: calls of an op whose schema writes, of a
    higher-order op, and every method call (an in-place method is named with a ``_``).

    Whether an op may write depends on the op alone, so it is asked once per distinct op
    and the graph's node index gives that op's calls: the check after a rewrite of a
    large graph then walks the graph once, cheaply, instead of asking of every node.
    """
    # By id: an OpOverload hashes in Python, an id in C.
    by_target = {id(n.target): n for n in graph.nodes if n.op == "call_function"}
    found = [
        node
        for example in by_target.values()
        if may_write(example) or isinstance(example.target, torch._ops.HigherOrderOperator)
        for node in graph.find_nodes(op="call_function", target=example.target, sort=False)
    ]
    found += graph.find_nodes(op="call_method", sort=False)
    return sorted(found)


Functional = Condition(
    "Functional",
    _in_place_writes,
    doc="No node writes to any of its arguments, except the trailing aten.copy_(state, value) "
    "write-backs of the GraphModule form; state updates of an ExportedProgram are "
    "PARAMETER_MUTATION / BUFFER_MUTATION / USER_INPUT_MUTATION outputs.",
)
