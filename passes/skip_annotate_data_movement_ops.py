"""SkipAnnotateDataMovementOps: data movement into or out of a mutable buffer is not quantized."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.fx import Node

from pass_manager import Effects, Pass, PassResult, graph_module_of

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.data_movement import (
    ANNOTATION_META,
    DATA_MOVEMENT_OPS,
    DataMovementNotAnnotated,
    buffer_of,
    data_movement_nodes,
)
from ._analysis.union_observers import averages_by_construction, class_name, union_observer_ctr

if TYPE_CHECKING:
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation

__all__ = ["SkipAnnotateDataMovementOps"]


def _replaced(node: Node, annotation: QuantizationAnnotation) -> QuantizationAnnotation:
    """A copy of ``annotation`` (with its own input map) put in its place in ``node.meta``."""
    new = copy.copy(annotation)
    new.input_qspec_map = dict(annotation.input_qspec_map)
    node.meta[ANNOTATION_META] = new
    return new


def _repoint_shared(gm: Any, removed: dict[tuple[Node, Node], Any],
                    statistics: Counter[str]) -> None:
    """Give each spec sharing a removed buffer edge the spec that edge had.

    A quantizer may make the written value share the buffer's edge (``QnnQuantizer``'s
    ``slice_scatter(cache, value, ...)``: the value's edge shares ``(cache, slice_scatter)``);
    with that edge unobserved, pt2e's grouping finds no root and fails with a bare
    ``KeyError``. The value's edge takes the buffer edge's own spec instead, so it is
    observed as the buffer would have been (its observer then becomes the union's below).
    """
    if not removed:
        return
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    def resolved(spec: Any) -> Any:
        seen: set[Any] = set()
        while (isinstance(spec, SharedQuantizationSpec) and spec.edge_or_node in removed
               and spec.edge_or_node not in seen):
            seen.add(spec.edge_or_node)
            spec = removed[spec.edge_or_node]
        return spec

    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION_META)
        if annotation is None:
            continue
        inputs = {arg: resolved(spec) for arg, spec in annotation.input_qspec_map.items()}
        changed = [arg for arg, spec in inputs.items()
                   if spec is not annotation.input_qspec_map[arg]]
        output = resolved(annotation.output_qspec)
        if not changed and output is annotation.output_qspec:
            continue
        annotation = _replaced(node, annotation)
        for arg in changed:
            annotation.input_qspec_map[arg] = inputs[arg]
        annotation.output_qspec = output
        statistics["specs sharing a removed buffer edge repointed"] += 1


@dataclass(frozen=True, repr=False)
class SkipAnnotateDataMovementOps(Pass):
    """Make a mutable buffer share the qparams of what is written into it.

    Runs after a quantizer's ``annotate`` (``PassQuantizer(after_annotate=[...])``). For
    every annotated data-movement op (:data:`passes._analysis.data_movement.DATA_MOVEMENT_OPS`:
    ``index_copy``, ``index_put``, ``copy_``, the ``*_scatter`` ops, views) that reads a
    marked mutable buffer:

    * the input annotation on the buffer is dropped: the buffer is never observed, so
      its initial (often all-zero) state cannot give the cache a tiny scale;
    * a write's output, and the written value's input edge, share the qspec of the
      written value (``SharedQuantizationSpec``), so the cache, the value written into it
      and later reads use one set of qparams;
    * a view of a buffer shares the qparams of the buffer value it views, or, when that
      value is not quantized, is not quantized either;
    * the value written into a buffer (annotated write or not), a compute op's read of a
      buffer (``acc.add_(x)``'s read of ``acc``), and every edge or output pt2e gives the
      same observer (torchao's sharing groups), is observed by the union of its ranges:
      a moving-average observer (``MovingAverageMinMaxObserver``, its per-channel kind,
      also as a ``FakeQuantize``'s ``observer``; QnnQuantizer's and CoreMLQuantizer's
      defaults) becomes the min-max one, with the spec's other arguments kept. A cache
      written a row per call holds every row written, an accumulator what every call
      added, and an average of per-call ranges clips them. Union observers (min-max, histogram) are
      left; a ``FusedMovingAvgObsFakeQuantize`` (XNNPACK's and QnnQuantizer's QAT
      configs), whose fused kernel averages whatever observer it holds, becomes a plain
      ``FakeQuantize`` around the min-max observer (the same fake quantization); one it
      cannot rebuild (positional arguments, an unknown observer) is left, with a note.

    Compute ops on a buffer (``add_``, ``mul_``) keep their annotations.

    Example (k is the written value; ``own`` = its own observer, ``k`` = shares k's;
    ``avg`` / ``minmax`` its observer class)::

        before:  %k = aten.linear(...) -> own(avg)
                 %index_copy = aten.index_copy(%k_cache[own], 2, %pos, %k[own]) -> own
        after:   %k = aten.linear(...) -> own(minmax)
                 %index_copy = aten.index_copy(%k_cache, 2, %pos, %k[k]) -> k

    Args:
        extra_ops: more data-movement ops, a tuple whose entries are an op (overload or
            packet, e.g. ``aten.roll.default``) that views or copies out its argument 0, or
            an ``(op, index)`` pair for an op writing its argument ``index`` into its
            argument 0. A mapping ``{op: index or None}`` is accepted and stored as such
            a tuple: ``SkipAnnotateDataMovementOps(extra_ops=(aten.roll.default,))``.
            Any other entry is a TypeError naming it, raised when the pass is built.

    Raises:
        PreconditionError: MutableBuffersMarked does not hold: mark the buffers first
            (MarkMutableBuffers, e.g. in ``PassQuantizer(transform=[...])``).
        ProgramFormError: the program is neither a GraphModule nor an ExportedProgram.
    """

    requires = frozenset({MutableBuffersMarked})
    provides = frozenset({DataMovementNotAnnotated})
    preserves = frozenset({MutableBuffersMarked, Functional})  # only annotations change
    # Each rewritten annotation is a new object in node.meta, never the quantizer's edited
    # in place.
    effects = Effects.only_meta(ANNOTATION_META)

    extra_ops: tuple = ()

    def __post_init__(self) -> None:
        entries = self.extra_ops
        if entries is None:
            entries = ()
        elif isinstance(entries, Mapping):
            entries = tuple(op if index is None else (op, index) for op, index in entries.items())
        else:
            entries = tuple(tuple(e) if isinstance(e, list) else e for e in entries)
        ops: dict[Any, int | None] = dict(DATA_MOVEMENT_OPS)
        for entry in entries:
            op, index = entry if isinstance(entry, tuple) else (entry, None)
            if not hasattr(op, "overloadpacket") and not hasattr(op, "overloads"):
                raise TypeError(f"{self.name}: extra_ops entry {entry!r} is not an operator")
            if index is not None and not isinstance(index, int):
                raise TypeError(f"{self.name}: extra_ops entry {entry!r}: index must be an int")
            ops[getattr(op, "overloadpacket", op)] = index
        # Frozen: the normalized option and the lookup table derived from it are set once.
        object.__setattr__(self, "extra_ops", entries)
        object.__setattr__(self, "_ops", ops)

    def call(self, program: Any) -> PassResult:
        gm = graph_module_of(program)
        shared: set[Node] = set()
        notes: list[str] = []
        statistics: Counter[str] = Counter()
        memo: dict[Node, str | None] = {}
        # The written value's edge into each buffer write (or, for a write the quantizer
        # left alone, the value itself), and each compute op's read of a buffer -> the
        # buffer.
        written: dict[tuple[Node, Node], str] = {}
        removed: dict[tuple[Node, Node], Any] = {}  # buffer edge -> the spec it had
        for node in data_movement_nodes(gm.graph, self._ops):
            packet = node.target.overloadpacket
            value = self._written_value(node, self._ops[packet])
            if value is not None and (fqn := buffer_of(node.args[0], memo)) is not None:
                written[(value, node)] = fqn
            annotation = node.meta.get(ANNOTATION_META)
            if annotation is None:
                continue
            buffer_inputs = [a for a in annotation.input_qspec_map
                             if buffer_of(a, memo) is not None]
            destination = node.args[0] if node.args else None
            fqn = buffer_of(destination, memo)
            if fqn is None and not buffer_inputs:
                continue
            annotation = _replaced(node, annotation)
            self._rewrite(node, annotation, buffer_inputs, self._ops[packet], shared, statistics,
                          removed)
            output = "shares the written value's qparams" if node in shared else "is not quantized"
            statistics["outputs sharing qparams" if node in shared
                       else "outputs left unquantized"] += 1
            notes.append(f"{node.name}: buffer {fqn or buffer_of(buffer_inputs[0], memo)!r} is not "
                         f"observed; the result {output}")
        _repoint_shared(gm, removed, statistics)
        self._observe_union(gm, written, memo, notes, statistics)
        return PassResult(program, bool(notes), notes, statistics)

    @staticmethod
    def _written_value(node: Node, value_index: int | None) -> Node | None:
        """The value ``node`` writes into its argument 0, or None (a view, no such value)."""
        if value_index is None or value_index >= len(node.args):
            return None
        value = node.args[value_index]
        return value if isinstance(value, Node) else None

    def _observe_union(self, gm: Any, written: dict[tuple[Node, Node], str],
                       memo: dict[Node, str | None], notes: list[str],
                       statistics: Counter[str]) -> None:
        """Give the observer a written value shares with its buffer, and a compute op's
        read of a buffer, a min-max kind.

        pt2e builds one observer per sharing group (explicit ``SharedQuantizationSpec`` and
        its implicit sharing of a producer's output with its consumers' edges), from the
        first member's spec in graph order; torchao's own grouping says which members those
        are, and each one's spec gets the min-max observer, so whichever comes first does.
        """
        from torchao.quantization.pt2e.prepare import (
            _get_edge_or_node_to_group_id,
            _get_edge_or_node_to_qspec,
        )
        from torchao.quantization.pt2e.quantizer import QuantizationSpec

        qspecs = _get_edge_or_node_to_qspec(gm)
        # Only averaging observers change: without any (XNNPACK's static config) torchao's
        # sharing groups, a walk over every edge, are not needed.
        distinct = {id(ctr): ctr for ctr in (qspec.observer_or_fake_quant_ctr for qspec in
                                             qspecs.values()
                                             if isinstance(qspec, QuantizationSpec))}
        if not any(union_observer_ctr(ctr) is not None or averages_by_construction(ctr)
                   for ctr in distinct.values()):
            return
        # A compute op's read of a buffer (``acc.add_(x)`` reads ``acc``) sees the state,
        # which holds every call's writes, as the value written into it does.
        for node in gm.graph.nodes:
            annotation = node.meta.get(ANNOTATION_META)
            if annotation is None or getattr(node.target, "overloadpacket", None) in self._ops:
                continue
            for arg in annotation.input_qspec_map:
                if (fqn := buffer_of(arg, memo)) is not None:
                    written[(arg, node)] = fqn
        if not written:
            return
        group_of = _get_edge_or_node_to_group_id(qspecs)
        groups: dict[int, str] = {}
        for (value, write), fqn in written.items():
            # The write's edge when the quantizer annotated the write, else the value's own
            # output observer (a Core ML linear feeding an unannotated index_copy).
            member = (value, write) if (value, write) in group_of else value
            if member in group_of:
                groups.setdefault(group_of[member], fqn)
        owned: set[Node] = set()  # nodes whose annotation is already this pass's copy
        for member, qspec in qspecs.items():
            fqn = groups.get(group_of[member])
            if fqn is None or not isinstance(qspec, QuantizationSpec):
                continue
            where = (member.name if isinstance(member, Node)
                     else f"{member[1].name}'s input {member[0].name}")
            ctr = qspec.observer_or_fake_quant_ctr
            union = union_observer_ctr(ctr)
            if union is None:
                if averages_by_construction(ctr):
                    statistics["averaging observers left (fused)"] += 1
                    notes.append(f"{where}: {class_name(ctr)} averages the ranges written into "
                                 f"buffer {fqn!r} and cannot take another observer; left as is")
                continue
            node = member if isinstance(member, Node) else member[1]
            annotation = node.meta[ANNOTATION_META]
            if node not in owned:
                annotation = _replaced(node, annotation)
                owned.add(node)
            new = dataclasses.replace(qspec, observer_or_fake_quant_ctr=union)
            if isinstance(member, Node):
                annotation.output_qspec = new
            else:
                annotation.input_qspec_map[member[0]] = new
            statistics["observers made min-max (state's union)"] += 1
            notes.append(f"{where}: observed by {class_name(union)} instead of {class_name(ctr)}"
                         f", for the union of the ranges written into buffer {fqn!r}")

    @staticmethod
    def _rewrite(
        node: Node,
        annotation: QuantizationAnnotation,
        buffer_inputs: list[Node],
        value_index: int | None,
        shared: set[Node],
        statistics: Counter[str],
        removed: dict[tuple[Node, Node], Any],
    ) -> None:
        # Imported here: importing torchao is slow and noisy, and `import passes` should not.
        from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

        qspecs = annotation.input_qspec_map
        for arg in buffer_inputs:
            if arg in shared:
                qspecs[arg] = SharedQuantizationSpec(arg)
                statistics["buffer input annotations shared"] += 1
            else:
                removed[(arg, node)] = qspecs.pop(arg)
                statistics["buffer input annotations removed"] += 1
        output = None
        if value_index is None:
            viewed = node.args[0] if node.args else None
            if viewed in shared and viewed in qspecs:
                output = SharedQuantizationSpec((viewed, node))
        elif value_index < len(node.args):
            value = node.args[value_index]
            if isinstance(value, Node) and qspecs.get(value) is not None:
                producer = value.meta.get(ANNOTATION_META)
                if producer is not None and producer.output_qspec is not None:
                    qspecs[value] = SharedQuantizationSpec(value)
                output = SharedQuantizationSpec((value, node))
        if not node.users:
            output = None
        annotation.output_qspec = output
        if output is not None:
            shared.add(node)
