"""Which ops only move data, and which mutable buffer a node's value lives in.

``SkipAnnotateDataMovementOps`` rewrites the annotations of these ops and the
``DataMovementNotAnnotated`` condition (defined here, beside its check) verifies it;
``UnfreezeMutableBuffer`` reads the table to tell writes from views.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from pass_manager import Condition, graph_of

from ._aliasing import aliased_argument
from ._buffers import MUTABLE_BUFFER_META

__all__ = ["ANNOTATION_META", "DATA_MOVEMENT_OPS", "DataMovementNotAnnotated", "buffer_of"]

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

def buffer_of(node: Any) -> str | None:
    """The FQN of the marked mutable buffer ``node`` aliases (itself, a view of it, or an
    in-place result on it), or None."""
    seen = 0
    while isinstance(node, Node) and seen < 64:
        fqn = node.meta.get(MUTABLE_BUFFER_META)
        if fqn is not None:
            return fqn
        found = aliased_argument(node)
        if found is None:
            return None
        node = found[1]
        seen += 1
    return None


def _annotated_buffer_reads(program: Any) -> list[str]:
    # Imported here: torchao is only needed once a program carries annotations.
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    violations = []
    for node in graph_of(program).nodes:
        annotation = node.meta.get(ANNOTATION_META)
        packet = getattr(node.target, "overloadpacket", None)
        if annotation is None or packet not in DATA_MOVEMENT_OPS:
            continue
        for arg, qspec in annotation.input_qspec_map.items():
            fqn = buffer_of(arg)
            if fqn is not None and qspec is not None and not isinstance(
                qspec, SharedQuantizationSpec
            ):
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
