"""The state a graph module reads through ``get_attr``, as ``torch.export`` lifts it.

``ep.module()`` turns each lifted parameter, buffer and constant back into a ``get_attr``
node; lifting goes the other way. Each distinct tensor becomes one input, named and
ordered as export names and orders them: parameters, then buffers, then constants, each
in the order the graph first reads them (the order a trace meets them), named ``p_``,
``b_``, ``c_`` + the FQN (``placeholder_naming_pass``' rule), or as ``like`` named them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch._export.utils import placeholder_prefixes
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from .._analysis.buffers import BUFFER, CONSTANT, PARAMETER, state_nodes
from ..errors import LiftError

__all__ = ["LiftedState", "graph_state"]

_KINDS = {PARAMETER: InputKind.PARAMETER, BUFFER: InputKind.BUFFER,
          CONSTANT: InputKind.CONSTANT_TENSOR}
_ORDER = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclass(eq=False)  # one per tensor, hashed by identity
class LiftedState:
    """One tensor of state the graph reads, lifted to an input.

    Attributes:
        kind: PARAMETER, BUFFER or CONSTANT_TENSOR.
        target: its fully-qualified name in the graph module.
        value: the tensor itself (shared, not copied: as ``ep`` and ``ep.module()`` share).
        persistent: for a buffer, whether it belongs in the state dict.
        nodes: the ``get_attr`` nodes that read it.
        name: the placeholder's name, once chosen.
    """

    kind: InputKind
    target: str
    value: torch.Tensor
    persistent: bool | None
    nodes: list[Node] = field(default_factory=list)
    name: str = ""


def export_name(kind: InputKind, target: str) -> str:
    """The placeholder name export gives a piece of state (``b_layers_0_attn_k_cache``)."""
    return placeholder_prefixes[kind] + re.sub(r"[^a-zA-Z0-9]", "_", target).lower()


def _is_persistent(gm: GraphModule, target: str) -> bool:
    owner_name, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    return leaf not in owner._non_persistent_buffers_set


def graph_state(gm: GraphModule) -> tuple[list[LiftedState], dict[Node, LiftedState]]:
    """The tensors the graph reads through ``get_attr``, in export's input order, and the
    state each such node reads.

    A ``get_attr`` of a graph module (a higher-order op's subgraph) stays a ``get_attr``.
    Any other non-tensor attribute is refused: export would lift a script object as a
    custom object, which needs a trace to type.
    """
    kinds = state_nodes(gm)
    by_identity: dict[int, LiftedState] = {}
    of_node: dict[Node, LiftedState] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        state = kinds.get(node)
        if state is None:
            try:
                value = _attribute(gm, node)
            except AttributeError as e:
                raise LiftError(f"get_attr target {node.target!r} does not exist",
                                node.name) from e
            if isinstance(value, GraphModule):
                continue
            raise LiftError(
                f"get_attr reads a {type(value).__name__}; only tensors (parameters, "
                "buffers, constants) and subgraph modules can be lifted without a trace",
                node.name)
        value = _attribute(gm, node)
        # Tied state (one tensor under two names) is one input, as export makes it: two
        # inputs sharing storage would let a write through one go unseen by the other.
        lifted = by_identity.get(id(value))
        if lifted is None:
            kind = _KINDS[state.kind]
            persistent = _is_persistent(gm, node.target) if kind == InputKind.BUFFER else None
            lifted = by_identity[id(value)] = LiftedState(kind, node.target, value, persistent)
        lifted.nodes.append(node)
        of_node[node] = lifted
    ordered = sorted(by_identity.values(), key=lambda s: _ORDER.index(s.kind))  # stable
    return ordered, of_node


def _attribute(gm: GraphModule, node: Node) -> object:
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value
