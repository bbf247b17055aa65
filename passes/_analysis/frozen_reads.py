"""Finding the constants ``convert_pt2e(fold_quantize=True)`` folded out of buffer reads.

torchao's constant folding turns ``quantize(buffer)`` into a ``_frozen_param*`` attribute
when it does not recognise the buffer as mutable; :func:`frozen_buffer_reads` matches each
such constant with the read it stands for. ``UnfreezeMutableBuffer`` rewrites them and the
``NoFrozenMutableBuffers`` condition (defined here, beside its check) verifies none is left.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # defines the quantized_decomposed ops
from torch.fx import GraphModule, Node

from pass_manager import Condition, graph_module_of
from pass_manager.analysis import Same, cached
from pass_manager.program import modules_of

from ..errors import AmbiguousFrozenBufferError, UnreplayableFrozenReadError
from .buffer_reads import (
    OBSERVED_READS_META,
    UNREPLAYABLE_READS_META,
    BufferRead,
    JoinedRead,
    UnreplayableRead,
)
from .buffers import BUFFER, MUTABLE_BUFFER_META, PARAMETER, find_mutations

__all__ = [
    "FROZEN_PREFIX",
    "FrozenRead",
    "NoFrozenMutableBuffers",
    "frozen_buffer_reads",
    "frozen_nodes",
]

qd = torch.ops.quantized_decomposed

FROZEN_PREFIX = "_frozen_param"
"""Name prefix of the attributes torchao's constant folding creates."""

_QUANTIZE = qd.quantize_per_tensor.default
# What that op takes (float16 and bfloat16 it converts first); it refuses any other dtype, so
# no constant it folded is the quantized value of a read of another (a float64 cache).
_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)
_DEQUANTIZE_OPS = (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor)


@dataclass
class FrozenRead:
    """A frozen constant standing for a quantized read of a mutable buffer."""

    node: Node
    read: BufferRead | JoinedRead
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


def _candidate_reads(gm: GraphModule) -> list[BufferRead | JoinedRead]:
    """The buffer reads a frozen constant may stand for.

    Recorded reads (see ``PassQuantizer``) carry their views and observer; a marked buffer
    without a record, or every buffer the graph writes when nothing is marked, is a
    candidate as a direct read.
    """
    recorded: dict[str, list[BufferRead | JoinedRead]] = {}
    marked: set[str] = set()
    for node in gm.graph.nodes:
        if MUTABLE_BUFFER_META in node.meta:
            marked.add(node.meta[MUTABLE_BUFFER_META])
        for read in node.meta.get(OBSERVED_READS_META, ()):
            known = recorded.setdefault(read.fqn, [])
            if read not in known:
                known.append(read)
    if not marked:
        marked = {s.name for s in find_mutations(gm).writers if s.kind in (BUFFER, PARAMETER)}
    reads = [r for fqn in sorted(recorded) for r in recorded[fqn]]
    reads.extend(BufferRead(fqn, ()) for fqn in sorted(marked - set(recorded)))
    return reads


def _buffer_value(gm: GraphModule, fqn: str) -> torch.Tensor | None:
    """The live value of a mutable buffer or written parameter."""
    for get in (gm.get_buffer, gm.get_parameter):
        try:
            return get(fqn)
        except AttributeError:
            continue
    return None


def frozen_nodes(gm: GraphModule) -> list[Node]:
    """The ``get_attr`` nodes of constants torchao's folding created (``_frozen_param*``)."""
    return [  # the graph's index of get_attr nodes, in graph order: no walk of every node
        n for n in gm.graph.find_nodes(op="get_attr")
        if str(n.target).rsplit(".", 1)[-1].startswith(FROZEN_PREFIX)
    ]


def frozen_buffer_reads(
    gm: GraphModule,
    pass_name: str,
    on_ambiguous: Callable[[Node, list[str]], None] | None = None,
    on_unreplayable: Callable[[Node, UnreplayableRead], None] | None = None,
) -> list[FrozenRead]:
    """Every frozen constant that is a quantized read of a mutable buffer, with its read.

    Exact when the reads were recorded at prepare time (``PassQuantizer``): the constant
    stands for the read whose observer fed the same consumer nodes, with the same qparams.
    Otherwise a constant matches a read when quantizing the buffer's current value (seen
    through the read's views) with the qparams of the constant's dequantize gives exactly
    the constant. Zero matches: a real constant, unless the constant fed the consumers of
    a value recorded as computed from buffers alone that no read replays:
    :class:`UnreplayableFrozenReadError` (or ``on_unreplayable``). Several:
    :class:`AmbiguousFrozenBufferError` (or ``on_ambiguous``).

    The scan is cached (``pass_manager.analysis``) while the graph, the marks and the
    tensors it reads are unchanged, so UnfreezeMutableBuffer and NoFrozenMutableBuffers
    share it.
    """
    found, ambiguous, unreplayable = cached(gm, "frozen_buffer_reads", _scan_frozen,
                                            _frozen_scan_inputs)
    for node, names in ambiguous:
        if on_ambiguous is None:
            raise AmbiguousFrozenBufferError(pass_name, node.name, names)
        on_ambiguous(node, names)
    for node, read in unreplayable:
        if on_unreplayable is None:
            raise UnreplayableFrozenReadError(pass_name, node.name, list(read.buffers),
                                              read.source)
        on_unreplayable(node, read)
    return list(found)


def _frozen_scan_inputs(gm: GraphModule) -> tuple:
    """What the frozen-read scan reads besides the graph: marks, records, tensor data."""
    marks = tuple(
        (Same(n), n.meta.get(MUTABLE_BUFFER_META),
         tuple(map(Same, n.meta.get(OBSERVED_READS_META, ()))),
         tuple(n.meta.get(UNREPLAYABLE_READS_META, ())))
        for n in gm.graph.nodes
        if MUTABLE_BUFFER_META in n.meta or OBSERVED_READS_META in n.meta
    )
    constants = [getattr(gm, str(n.target), None) for n in frozen_nodes(gm)]
    # Straight from each module's registries: ``gm.buffers()`` / ``parameters()`` chain a
    # generator per module and cost three times as much (a tensor listed twice is fine).
    registered = [t for _, m in modules_of(gm)
                  for t in (*m._buffers.values(), *m._parameters.values())]
    tensors = tuple(
        (Same(t), t._version) for t in (*registered, *constants)
        if isinstance(t, torch.Tensor)
    )
    return marks, tensors


def _scan_frozen(gm: GraphModule) -> tuple[list[FrozenRead], list[tuple[Node, list[str]]],
                                            list[tuple[Node, UnreplayableRead]]]:
    reads = _candidate_reads(gm)
    unreplayable_reads = list(dict.fromkeys(
        read for n in gm.graph.nodes for read in n.meta.get(UNREPLAYABLE_READS_META, ())))
    values = _ReadValues(gm, [r for r in reads if not r.consumers])
    # The recorded reads by the nodes they fed: a constant is compared with those that fed
    # its consumers, not with every read (a constant per weight, a read per cache).
    position = {id(r): i for i, r in enumerate(reads)}
    by_consumer: dict[str, list[BufferRead | JoinedRead]] = {}
    for read in reads:
        for name in read.consumers:
            by_consumer.setdefault(name, []).append(read)
    found: list[FrozenRead] = []
    ambiguous: list[tuple[Node, list[str]]] = []
    unreplayable: list[tuple[Node, UnreplayableRead]] = []
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
        fed = {id(r): r for name in consumers for r in by_consumer.get(name, ())}
        matches = [r for r in sorted(fed.values(), key=lambda r: position[id(r)])
                   if _observer_agrees(r.observer, qparams)
                   and getattr(values.of(r), "shape", None) == constant.shape]
        if not matches:
            matches = _matching_reads(values, constant, qparams)
        names = sorted({m.describe() for m in matches})
        if len(names) > 1:
            ambiguous.append((node, names))
        elif matches:
            found.append(FrozenRead(node, matches[0], qparams))
        else:
            stale = next((r for r in unreplayable_reads if r.consumers & consumers
                          and not _still_read_live(gm, r, r.consumers & consumers)), None)
            if stale is not None:
                unreplayable.append((node, stale))
    return found, ambiguous, unreplayable


def _still_read_live(gm: GraphModule, read: UnreplayableRead, consumers: set[str]) -> bool:
    """Whether each of ``consumers`` still reads ``read``'s value from its node (through a
    quantize and dequantize): then that value was not folded, and a constant beside it (a
    folded weight multiplying a position bias) stands for something else."""
    nodes = {n.name: n for n in gm.graph.nodes if n.name in consumers or n.name == read.source}
    source = nodes.get(read.source)
    if source is None:
        return False

    def reads_source(arg: Node) -> bool:
        while arg is not source and (arg.target is _QUANTIZE or arg.target in _DEQUANTIZE_OPS
                                     ) and isinstance(arg.args[0], Node):
            arg = arg.args[0]
        return arg is source

    return all(name in nodes and any(reads_source(a) for a in nodes[name].all_input_nodes)
               for name in consumers)


class _ReadValues:
    """The current value of each read (its buffer seen through its views), taken once per
    scan, and the unrecorded reads grouped by the shape of that value.

    A quantized model has a frozen constant per weight and a read per cache: comparing
    every constant with every read would look up and replay each read once per constant.
    """

    def __init__(self, gm: GraphModule, unrecorded: list[BufferRead]):
        self._gm = gm
        self._values: dict[int, torch.Tensor | None] = {}
        self._unrecorded = unrecorded
        self._by_shape: dict[torch.Size, list[tuple[BufferRead, torch.Tensor]]] | None = None

    def of(self, read: BufferRead | JoinedRead) -> torch.Tensor | None:
        """The read's value, or None (no such buffer, or its views fail on it)."""
        if id(read) not in self._values:
            try:
                with torch.no_grad():
                    value = read.evaluate(functools.partial(_buffer_value, self._gm))
            except RuntimeError:
                value = None
            self._values[id(read)] = value
        return self._values[id(read)]

    def unrecorded_of_shape(self, shape: torch.Size) -> list[tuple[BufferRead, torch.Tensor]]:
        """The unrecorded reads whose value has ``shape``, in candidate order."""
        if self._by_shape is None:
            self._by_shape = {}
            for read in self._unrecorded:
                value = self.of(read)
                if value is not None:
                    self._by_shape.setdefault(value.shape, []).append((read, value))
        return self._by_shape.get(shape, [])


def _matching_reads(
    values: _ReadValues, constant: torch.Tensor, qparams: tuple
) -> list[BufferRead]:
    """The unrecorded reads whose value, quantized with ``qparams``, is ``constant``."""
    scale, zero_point, qmin, qmax, dtype = qparams
    matches = []
    for read, value in values.unrecorded_of_shape(constant.shape):
        if value.dtype not in _QUANTIZABLE or not _observer_agrees(read.observer, qparams):
            continue
        with torch.no_grad():
            quantized = _QUANTIZE(value, scale, zero_point, qmin, qmax, dtype)
        if quantized.dtype == constant.dtype and torch.equal(quantized, constant):
            matches.append(read)
    return matches


def _frozen_buffer_reads(program: Any) -> list[str]:
    ambiguous: list[str] = []
    found = frozen_buffer_reads(
        graph_module_of(program),
        "NoFrozenMutableBuffers",
        on_ambiguous=lambda node, names: ambiguous.append(
            f"{node.name}: frozen constant {node.target!r} may stand for {', '.join(names)}"
        ),
        on_unreplayable=lambda node, read: ambiguous.append(
            f"{node.name}: frozen constant {node.target!r} stands for {read.source!r}, "
            f"computed from {', '.join(read.buffers)} alone"
        ),
    )
    return [f"{f.node.name}: frozen constant {f.node.target!r} is a quantized read of "
            f"{f.read.describe()}" for f in found] + ambiguous


NoFrozenMutableBuffers = Condition(
    "NoFrozenMutableBuffers",
    _frozen_buffer_reads,
    doc="No constant that torchao's folding made (_frozen_param*) stands for a read of a "
    "mutable buffer: every read of a buffer reads its current value.",
)
