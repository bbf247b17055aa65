"""One observer per shared buffer across the prepared methods of one model.

torchao gives the edges and nodes of one sharing group (``SharedQuantizationSpec``, and the
implicit sharing of an output with its users' input edges) one observer instance, which is
what makes them one grid. Methods are prepared one by one, so a buffer they share gets an
observer in each; :func:`buffer_observers` finds, from the map ``prepare_pt2e`` hands the
quantizer's ``prepare_obs_or_fq_callback``, the observers standing for a buffer in one
method, and :func:`share_observers` makes them one instance in every method, so that
calibration over all the methods' calls fills one min/max and ``convert_pt2e`` gives every
method the same grid. A buffer's observers are:

* the values written into it: the written argument of each write (``index_copy``,
  ``index_put``, ``copy_``, the ``*_scatter`` ops) whose destination is its contents, and
  what that argument is a view or a copy of, back to the op that computed it, through a
  ``cat`` to each operand putting values into it;
* its contents: the buffer and every value carrying it on: any view of it (whatever op,
  read from the op's schema: ``t``, ``narrow``, ``select``, ``slice``, ...), a copy of it,
  a functional write's result on it, and so on transitively, so that a write through a
  transposed view, a narrow or a sliding window is found as a direct one is;
* its reads: each input edge of a consumer of those contents, when that edge's observer
  quantizes like the buffer's (the same dtype, range and scheme); a read re-quantized on
  a grid of another kind keeps its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .._analysis.aliasing import aliased_argument
from .._analysis.buffer_reads import OBSERVED_READS_META
from .._analysis.buffers import MUTABLE_BUFFER_META, MUTABLE_INPUT_META
from .._analysis.data_movement import DATA_MOVEMENT_OPS
from .._analysis.grid_flow import holds_no_values
from ..errors import QuantizationFlowError

__all__ = ["BufferObservers", "buffer_observers", "share_observers"]

# What must agree for two observers to stand for one grid. Not their class: one quantizer
# observes one buffer's values with several (QnnQuantizer: a ConcatObserver on a key written
# from a `cat`, a MovingAverageMinMaxObserver on its reads), and one instance of either
# gives every method the grid of all the values it saw.
_CONFIG = ("dtype", "qscheme", "quant_min", "quant_max", "ch_axis", "is_dynamic")


def _config(observer: torch.nn.Module) -> tuple:
    return tuple(getattr(observer, key, None) for key in _CONFIG)


def _describe(observer: torch.nn.Module) -> str:
    parts = [f"{key}={getattr(observer, key)}" for key in _CONFIG if hasattr(observer, key)]
    return f"{type(observer).__name__}({', '.join(parts)})"


def _written_value_index(node: Node) -> int | None:
    """The argument index of the value a write op (functional or in place: ``index_put``,
    ``copy_``, the ``*_scatter`` ops) writes into its argument 0, or None."""
    if node.op != "call_function":
        return None
    return DATA_MOVEMENT_OPS.get(getattr(node.target, "overloadpacket", None))


def _carried(node: Node) -> Node | None:
    """The argument whose values ``node``'s value carries on unchanged, or None.

    A view or an in-place result (any op whose schema says its result aliases an
    argument: ``t``, ``narrow``, ``select``, ``as_strided``, ``copy_``, ...), a copy of an
    argument (``clone``, ``contiguous``) and a functional write (``index_put``,
    ``slice_scatter``, ``copy``: a new version of its destination, argument 0).
    """
    found = aliased_argument(node)
    if found is not None:
        return found[1]
    if node.op == "call_function" and node.args and isinstance(node.args[0], Node) and \
            getattr(node.target, "overloadpacket", None) in DATA_MOVEMENT_OPS:
        return node.args[0]
    return None


def _joined(node: Node) -> list[Node]:
    """The operands of a ``cat`` whose values its result holds: each but the empty ones
    (HF's rotary ``cat([k_rot, k_pass])`` with every dim rotated passes an empty ``k_pass``
    of another grid, which puts nothing into the key cache)."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
        return []
    operands = node.args[0] if node.args else node.kwargs.get("tensors", ())
    return [o for o in operands if isinstance(o, Node) and not holds_no_values(o)]


@dataclass
class BufferObservers:
    """The observers standing for each marked buffer in one prepared method.

    Attributes:
        grid: per buffer, the observers of its contents and of the values written into it.
        reads: per buffer, the observers of input edges reading its contents.
    """

    grid: dict[str, list[torch.nn.Module]] = field(default_factory=dict)
    reads: dict[str, list[torch.nn.Module]] = field(default_factory=dict)


def buffer_observers(model: GraphModule, observer_of: Mapping[Any, Any],
                     inputs: Mapping[str, str] | None = None,
                     paired: Mapping[str, int] | None = None) -> BufferObservers:
    """The observers of each marked buffer, read from ``prepare_pt2e``'s map of edges and
    nodes to observers (the annotated graph, before the observers are inserted).

    ``inputs`` maps the names of user inputs carrying state to the label of the state each
    carries: inputs the method writes in place (marked by MarkMutableBuffers), and the
    inputs of ``paired`` (input name -> the flat position of the output returning its next
    value). Their observers are found as a buffer's are, under that label; a paired
    output's value counts as a value written into its input."""
    inputs, paired = inputs or {}, paired or {}
    contents: dict[Node, str] = {}
    for node in model.graph.nodes:  # in order: an argument comes before its users
        if node.op in ("get_attr", "placeholder"):
            fqn = node.meta.get(MUTABLE_BUFFER_META)
            if fqn is None and node.meta.get(MUTABLE_INPUT_META) in inputs:
                fqn = inputs[node.meta[MUTABLE_INPUT_META]]
            elif fqn is None and node.op == "placeholder" and node.name in paired:
                fqn = inputs.get(node.name)
        else:
            fqn = contents.get(_carried(node))
        if fqn is not None:
            contents[node] = fqn
    found = BufferObservers()

    def add(into: dict[str, list], fqn: str, key: Any) -> None:
        observer = observer_of.get(key)
        if observer is not None and all(observer is not o for o in into.setdefault(fqn, [])):
            into[fqn].append(observer)

    def written(fqn: str, value: Any, consumer: Node) -> None:
        pending = [(value, consumer)]
        seen: set[Node] = set()
        while pending:  # the written value, and what it carries on, back to its producers
            value, consumer = pending.pop()
            if not isinstance(value, Node) or value in contents or value in seen:
                continue
            seen.add(value)
            add(found.grid, fqn, (value, consumer))
            add(found.grid, fqn, value)
            pending.append((_carried(value), value))
            # A write into a fresh tensor (a prefill's index_copy into zeros) carries the
            # values it writes too.
            index = _written_value_index(value)
            if index is not None and index < len(value.args):
                pending.append((value.args[index], value))
            pending.extend((joined, value) for joined in _joined(value))

    for node, fqn in contents.items():
        add(found.grid, fqn, node)
        for user in node.users:
            add(found.grid if user in contents else found.reads, fqn, (node, user))
        index = _written_value_index(node)
        if index is not None and index < len(node.args):
            written(fqn, node.args[index], node)
    if paired:
        output = model.graph.output_node()
        values = output.args[0]
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        for node in model.graph.find_nodes(op="placeholder"):
            if node.name in paired and node in contents:
                index = paired[node.name]
                if index < len(values):
                    written(contents[node], values[index], output)
    return found


class _Groups:
    """Union-find over observer instances (by identity)."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self.module: dict[int, torch.nn.Module] = {}

    def add(self, observer: torch.nn.Module) -> int:
        key = id(observer)
        if key not in self.parent:
            self.parent[key] = key
            self.module[key] = observer
        return key

    def find(self, key: int) -> int:
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: torch.nn.Module, b: torch.nn.Module) -> None:
        ra, rb = self.find(self.add(a)), self.find(self.add(b))
        if ra != rb:
            self.parent[rb] = ra


def share_observers(
    prepared: Mapping[str, GraphModule], observers: Mapping[str, BufferObservers]
) -> dict[str, int]:
    """Make every buffer's observers one instance in all the prepared methods.

    The observers ``PassQuantizer`` recorded for each buffer's reads are the shared ones
    too. Returns, per buffer, how many observer instances became its one. Observers of one
    buffer that quantize differently (another dtype, range or scheme; the methods' quantizer
    annotated them differently) are a QuantizationFlowError naming the buffer, the methods
    and both configurations.
    """
    groups = _Groups()
    first: dict[str, tuple[str, torch.nn.Module]] = {}
    for method, found in observers.items():
        for fqn, grid in found.grid.items():
            for observer in grid:
                if fqn not in first:
                    first[fqn] = (method, observer)
                    groups.add(observer)
                    continue
                where, reference = first[fqn]
                if _config(observer) != _config(reference):
                    raise QuantizationFlowError(
                        f"buffer {fqn!r} is quantized as {_describe(reference)} in method "
                        f"{where!r} but as {_describe(observer)} in method {method!r}: one "
                        "buffer shared by several methods holds one grid; quantize them "
                        "with one quantizer configuration",
                        pass_name="quantize_methods",
                    )
                groups.union(reference, observer)
    for found in observers.values():
        for fqn, reads in found.reads.items():
            if fqn not in first:
                continue
            reference = first[fqn][1]
            for observer in reads:
                if _config(observer) == _config(reference):
                    groups.union(reference, observer)
    counts = {fqn: sum(1 for key in groups.parent if groups.find(key) == groups.find(
        id(observer))) for fqn, (_, observer) in first.items()}
    def shared_of(module: Any) -> Any:
        return groups.module[groups.find(id(module))] if id(module) in groups.parent \
            else module

    for gm in prepared.values():
        for node in gm.graph.nodes:
            reads = node.meta.get(OBSERVED_READS_META)
            if reads:  # UnfreezeMutableBuffer matches frozen reads by their observer
                node.meta[OBSERVED_READS_META] = [
                    dataclasses.replace(read, observer=shared_of(read.observer))
                    for read in reads]
            if node.op != "call_module":
                continue
            module = gm.get_submodule(node.target)
            if id(module) not in groups.parent:
                continue
            shared = groups.module[groups.find(id(module))]
            if shared is not module:
                *path, leaf = node.target.split(".")
                owner = gm.get_submodule(".".join(path)) if path else gm
                setattr(owner, leaf, shared)
    return counts
