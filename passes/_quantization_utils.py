"""Shared glue between the mutable-buffer passes and torchao's pt2e quantization.

* which ops only move data (:data:`DATA_MOVEMENT_OPS`) and where a node's value lives
  (:func:`buffer_of`: the mutable buffer it aliases, through views and in-place results);
* the record :class:`~passes.quantization.PassQuantizer` keeps of the observers that
  watch a mutable buffer (:data:`OBSERVED_READS_META`, :class:`BufferRead`);
* finding the ``_frozen_param`` constants ``convert_pt2e(fold_quantize=True)`` made out
  of a buffer read (:func:`frozen_buffer_reads`), used by ``UnfreezeMutableBuffer`` and
  by the ``NoFrozenMutableBuffers`` condition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # defines the quantized_decomposed ops
from torch.fx import GraphModule, Node

from pass_manager import PassManagerError

from ._aliasing import aliased_argument
from ._buffers import BUFFER, MUTABLE_BUFFER_META, buffer_nodes, find_mutations

__all__ = [
    "ANNOTATION_META",
    "DATA_MOVEMENT_OPS",
    "FROZEN_PREFIX",
    "OBSERVED_READS_META",
    "AmbiguousFrozenBufferError",
    "BufferRead",
    "FrozenRead",
    "QuantizationFlowError",
    "ViewStep",
    "buffer_attr_nodes",
    "buffer_of",
    "frozen_buffer_reads",
    "frozen_nodes",
    "view_chain",
]

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

ANNOTATION_META = "quantization_annotation"
"""``node.meta`` key of a torchao ``QuantizationAnnotation``."""
OBSERVED_READS_META = "mutable_buffer_observed_reads"
"""``node.meta`` key (on a mutable buffer's node) listing the :class:`BufferRead` observed."""
FROZEN_PREFIX = "_frozen_param"
"""Name prefix of the attributes torchao's constant folding creates."""

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

_QUANTIZE = qd.quantize_per_tensor.default
_DEQUANTIZE_OPS = (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor)


class QuantizationFlowError(PassManagerError):
    """The quantization flow met a graph it cannot handle correctly; nothing was rewritten."""

    def __init__(self, message: str, *, pass_name: str | None = None, node: str | None = None):
        prefix = f"{pass_name}: " if pass_name else ""
        where = f"node {node!r}: " if node else ""
        super().__init__(prefix + where + message, pass_name=pass_name)
        self.node = node


class AmbiguousFrozenBufferError(QuantizationFlowError):
    """A frozen constant matches more than one mutable buffer read; refusing to guess."""

    def __init__(self, pass_name: str, node: str, candidates: list[str]):
        super().__init__(
            "frozen constant matches several mutable buffer reads: "
            + ", ".join(candidates)
            + "; mark the buffers with MarkMutableBuffers before prepare_pt2e (and quantize "
            "with PassQuantizer) so the provenance is recorded",
            pass_name=pass_name,
            node=node,
        )
        self.candidates = candidates


def _packet(node: Node) -> Any:
    target = node.target
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else None


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


@dataclass(frozen=True)
class ViewStep:
    """One view op applied to a buffer: ``target(previous, *args, **kwargs)``."""

    target: Any
    args: tuple
    kwargs: tuple


@dataclass
class BufferRead:
    """A read of a mutable buffer: the buffer, the views on the way and, when recorded at
    prepare time, the observer that watched it and the names of the nodes consuming it."""

    fqn: str
    chain: tuple[ViewStep, ...]
    observer: torch.nn.Module | None = None
    consumers: frozenset[str] = frozenset()

    def describe(self) -> str:
        views = "".join(f".{step.target.overloadpacket.__name__}(...)" for step in self.chain)
        return f"{self.fqn}{views}"

    def replay(self, value: torch.Tensor) -> torch.Tensor:
        for step in self.chain:
            value = step.target(value, *step.args, **dict(step.kwargs))
        return value


def view_chain(node: Node) -> tuple[Node, tuple[ViewStep, ...]] | None:
    """``(buffer node, views)`` when ``node`` is a marked buffer seen through pure views.

    None otherwise. In-place results do not count: their value is not the buffer's value
    as it was before the op.
    """
    steps: list[ViewStep] = []
    while isinstance(node, Node):
        if MUTABLE_BUFFER_META in node.meta and node.op in ("get_attr", "placeholder"):
            return node, tuple(reversed(steps))
        found = aliased_argument(node)
        if found is None or found[0] != 0 or found[2]:
            return None
        if any(isinstance(a, Node) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        steps.append(ViewStep(node.target, _frozen(node.args[1:]), _frozen(node.kwargs.items())))
        node = found[1]
    return None


def _frozen(value: Any) -> Any:
    """Lists to tuples, recursively, so that a view's arguments can be hashed."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "dict_items":
        return tuple(_frozen(v) for v in value)
    return value


@dataclass
class FrozenRead:
    """A frozen constant standing for a quantized read of a mutable buffer."""

    node: Node
    read: BufferRead
    qparams: tuple


def _qparams(dequantize: Node) -> tuple | None:
    if dequantize.target is not qd.dequantize_per_tensor.default:
        return None
    scale, zero_point, qmin, qmax, dtype = dequantize.args[1:6]
    return float(scale), int(zero_point), int(qmin), int(qmax), dtype


def _observer_agrees(observer: torch.nn.Module | None, qparams: tuple) -> bool:
    if observer is None or not hasattr(observer, "calculate_qparams"):
        return True
    try:
        scale, zero_point = observer.calculate_qparams()
    except (RuntimeError, ValueError, AttributeError):
        return True
    if scale.numel() != 1:
        return False
    return bool(torch.isclose(scale.float().reshape(()), torch.tensor(qparams[0]), rtol=1e-6)) and (
        int(zero_point.reshape(())) == qparams[1]
    )


def _candidate_reads(gm: GraphModule) -> list[BufferRead]:
    """The buffer reads a frozen constant may stand for.

    Recorded reads (see ``PassQuantizer``) carry their views and observer; a marked buffer
    without a record, or every buffer the graph writes when nothing is marked, is a
    candidate as a direct read.
    """
    recorded: dict[str, list[BufferRead]] = {}
    marked: set[str] = set()
    for node in gm.graph.nodes:
        if MUTABLE_BUFFER_META in node.meta:
            marked.add(node.meta[MUTABLE_BUFFER_META])
        for read in node.meta.get(OBSERVED_READS_META, ()):
            known = recorded.setdefault(read.fqn, [])
            if read not in known:
                known.append(read)
    if not marked:
        marked = {s.name for s in find_mutations(gm).writers if s.kind == BUFFER}
    reads = [r for fqn in sorted(recorded) for r in recorded[fqn]]
    reads.extend(BufferRead(fqn, ()) for fqn in sorted(marked - set(recorded)))
    return reads


def _buffer_value(gm: GraphModule, fqn: str) -> torch.Tensor | None:
    try:
        return gm.get_buffer(fqn)
    except AttributeError:
        return None


def frozen_nodes(gm: GraphModule) -> list[Node]:
    """The ``get_attr`` nodes of constants torchao's folding created (``_frozen_param*``)."""
    return [
        n for n in gm.graph.nodes
        if n.op == "get_attr" and str(n.target).rsplit(".", 1)[-1].startswith(FROZEN_PREFIX)
    ]


def frozen_buffer_reads(
    gm: GraphModule,
    pass_name: str,
    on_ambiguous: Callable[[Node, list[str]], None] | None = None,
) -> list[FrozenRead]:
    """Every frozen constant that is a quantized read of a mutable buffer, with its read.

    Exact when the reads were recorded at prepare time (``PassQuantizer``): the constant
    stands for the read whose observer fed the same consumer nodes, with the same qparams.
    Otherwise a constant matches a read when quantizing the buffer's current value (seen
    through the read's views) with the qparams of the constant's dequantize gives exactly
    the constant. Zero matches: a real constant. Several:
    :class:`AmbiguousFrozenBufferError` (or ``on_ambiguous``).
    """
    reads = _candidate_reads(gm)
    found = []
    for node in frozen_nodes(gm):
        constant = getattr(gm, str(node.target), None)
        users = list(node.users)
        if not isinstance(constant, torch.Tensor) or not users:
            continue
        if not all(u.target in _DEQUANTIZE_OPS and u.args[0] is node for u in users):
            continue
        params = {_qparams(u) for u in users}
        if len(params) != 1 or None in params:
            continue
        qparams = params.pop()
        consumers = {c.name for u in users for c in u.users}
        # Recorded provenance first: the observer that watched a buffer read fed exactly
        # these consumer nodes, and its qparams are the constant's.
        matches = [r for r in reads if r.consumers & consumers
                   and _observer_agrees(r.observer, qparams) and _same_shape(gm, r, constant)]
        if not matches:
            unrecorded = [r for r in reads if not r.consumers]
            matches = _matching_reads(gm, unrecorded, constant, qparams)
        names = sorted({m.describe() for m in matches})
        if len(names) > 1:
            if on_ambiguous is None:
                raise AmbiguousFrozenBufferError(pass_name, node.name, names)
            on_ambiguous(node, names)
            continue
        if matches:
            found.append(FrozenRead(node, matches[0], qparams))
    return found


def _same_shape(gm: GraphModule, read: BufferRead, constant: torch.Tensor) -> bool:
    value = _buffer_value(gm, read.fqn)
    if value is None:
        return False
    try:
        with torch.no_grad():
            return read.replay(value).shape == constant.shape
    except RuntimeError:
        return False


def _matching_reads(
    gm: GraphModule, reads: Iterable[BufferRead], constant: torch.Tensor, qparams: tuple
) -> list[BufferRead]:
    scale, zero_point, qmin, qmax, dtype = qparams
    matches = []
    for read in reads:
        value = _buffer_value(gm, read.fqn)
        if value is None or not _observer_agrees(read.observer, qparams):
            continue
        with torch.no_grad():
            try:
                value = read.replay(value)
            except RuntimeError:
                continue
            if value.shape != constant.shape or not value.is_floating_point():
                continue
            quantized = _QUANTIZE(value, scale, zero_point, qmin, qmax, dtype)
        if quantized.dtype == constant.dtype and torch.equal(quantized, constant):
            matches.append(read)
    return matches


def buffer_attr_nodes(gm: GraphModule) -> Mapping[str, Node]:
    """The first ``get_attr`` node of each buffer, by FQN."""
    found: dict[str, Node] = {}
    for node, fqn in buffer_nodes(gm).items():
        found.setdefault(fqn, node)
    return found
