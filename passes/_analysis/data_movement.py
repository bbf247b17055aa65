"""Which ops only move data, and which mutable buffer a node's value lives in.

``SkipAnnotateDataMovementOps`` rewrites the annotations of these ops and the
``DataMovementNotAnnotated`` condition (defined here, beside its check) verifies it;
``UnfreezeMutableBuffer`` reads the table to tell writes from views.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from pass_manager import Condition, graph_of

from .aliasing import aliased_argument
from .buffers import MUTABLE_BUFFER_META

__all__ = [
    "ANNOTATION_META",
    "DATA_MOVEMENT_OPS",
    "DataMovementNotAnnotated",
    "buffer_of",
    "data_movement_nodes",
    "moved_from",
]

aten = torch.ops.aten

ANNOTATION_META = "quantization_annotation"
"""``node.meta`` key of a torchao ``QuantizationAnnotation``."""

DATA_MOVEMENT_OPS: dict[Any, int | None] = {
    # op overload packet -> argument index of the value written into the destination
    # (argument 0), or None for ops that only view or copy out their argument 0.
    aten.index_copy: 3,
    aten.index_copy_: 3,
    aten.index_put: 2,
    aten.index_put_: 2,
    aten._unsafe_index_put: 2,
    aten.copy: 1,
    aten.copy_: 1,
    aten.slice_scatter: 1,
    aten.select_scatter: 1,
    aten.diagonal_scatter: 1,
    aten.as_strided_scatter: 1,
    aten.view: None,
    aten._unsafe_view: None,
    aten.reshape: None,
    aten.transpose: None,
    aten.permute: None,
    aten.slice: None,
    aten.select: None,
    aten.squeeze: None,
    aten.unsqueeze: None,
    aten.expand: None,
    aten.clone: None,
    aten.contiguous: None,
    aten.alias: None,
}
"""The default data-movement ops: quantizing them only re-rounds values that some other
op already quantized. Extend it per pass with ``SkipAnnotateDataMovementOps(extra_ops=...)``."""

def buffer_of(node: Any, memo: dict[Node, str | None] | None = None) -> str | None:
    """The FQN of the marked mutable buffer ``node`` aliases (itself, a view of it, or an
    in-place result on it), or None. ``memo`` (a dict the caller keeps for one scan)
    remembers the answers along each chain walked."""
    chain: list[Node] = []
    fqn = None
    while isinstance(node, Node) and len(chain) < 64:
        if memo is not None and node in memo:
            fqn = memo[node]
            break
        chain.append(node)
        fqn = node.meta.get(MUTABLE_BUFFER_META)
        if fqn is not None:
            break
        found = aliased_argument(node)
        if found is None:
            break
        node = found[1]
    if memo is not None:
        memo.update(dict.fromkeys(chain, fqn))
    return fqn


def moved_from(node: Node, hops: int = 8) -> Node:
    """The node whose values ``node`` holds, through at most ``hops`` ops that only view or
    copy out their argument 0 (a reshape of a dequantize holds the dequantize's values, on
    its grid); ``node`` itself when its op computes."""
    for _ in range(hops):
        packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" \
            else None
        if packet not in DATA_MOVEMENT_OPS or DATA_MOVEMENT_OPS[packet] is not None or not (
                node.args and isinstance(node.args[0], Node)):
            break
        node = node.args[0]
    return node


def data_movement_nodes(graph: torch.fx.Graph, ops: Mapping[Any, int | None]) -> list[Node]:
    """The nodes of ``graph`` whose op's overload packet is a key of ``ops``, in order.

    Most nodes are not: they are skipped in C loops over the nodes' target identities
    (hashing an operator is a Python call), only the distinct targets are looked up.
    """
    nodes = list(graph.nodes)
    targets = list(map(operator.attrgetter("target"), nodes))
    ids = list(map(id, targets))
    wanted = {key for key, target in dict(zip(ids, targets, strict=True)).items()
              if getattr(target, "overloadpacket", None) in ops}
    return list(itertools.compress(nodes, map(wanted.__contains__, ids)))


def _annotated_buffer_reads(program: Any) -> list[str]:
    # Imported here: torchao is only needed once a program carries annotations.
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    violations = []
    memo: dict[Node, str | None] = {}
    for node in data_movement_nodes(graph_of(program), DATA_MOVEMENT_OPS):
        annotation = node.meta.get(ANNOTATION_META)
        if annotation is None:
            continue
        for arg, qspec in annotation.input_qspec_map.items():
            if qspec is None or isinstance(qspec, SharedQuantizationSpec):
                continue
            fqn = buffer_of(arg, memo)
            if fqn is not None:
                violations.append(f"{node.name}: its input {arg.name} (buffer {fqn!r}) has its "
                                  f"own {type(qspec).__name__}")
    return violations


DataMovementNotAnnotated = Condition(
    "DataMovementNotAnnotated",
    _annotated_buffer_reads,
    doc="No data-movement op (index_copy, index_put, copy_, *_scatter, views) reading a marked "
    "mutable buffer carries its own input annotation for it: the buffer is either not "
    "observed or shares the qparams of the value written into it.",
)
