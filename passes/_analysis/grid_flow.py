"""Which quantization grid a value lies on, followed through data movement.

A value lies on a grid when it is a ``dequantize`` onto it, or data movement of such values:
views and copies (``view``, ``reshape``, ``transpose``, ``permute``, ``expand``, ``slice``,
``select``, ``squeeze``/``unsqueeze``, ``clone``, ...), ``cat``, and the functional writes
(``index_copy``, ``index_put``, ``slice_scatter``, ``select_scatter``, ``copy``) of values on
it into a value on it, and ``where(mask, a, b)`` choosing each element from two values on it
(a cache written as ``torch.where(mask, new, cache)``). A mutable buffer's own contents lie on
the grid assumed for it, and a tensor of zeros (``zeros``, ``full(..., 0)``, a buffer's
functional ``zero_()`` / ``fill_(0)``) on any per-tensor grid: its zero point.
Data movement applied to the integers of the grid gives the integers of the moved values,
which is what :class:`GridFlow` answers for each node, with the reason when it cannot.

Per channel, the channel axis is followed through each op (a transpose moves it, a view
keeps it where the shapes say it survives); an op that splits, drops or indexes along it
loses the grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .aliasing import Alias
from .grids import Grid, dequantize_grid
from .op_schema import argument_value, facts_of

__all__ = [
    "FUNCTIONAL_WRITES",
    "IN_PLACE_WRITES",
    "MOVES",
    "SELECTS",
    "WILD",
    "GridFlow",
    "Refusal",
    "holds_no_values",
    "is_element_view",
    "moved_axis",
    "value_operands",
]

aten = torch.ops.aten

MOVES = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
    aten.permute.default, aten.expand.default, aten.expand_as.default, aten.slice.Tensor,
    aten.select.int,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.t.default,
    aten.narrow.default, aten.flatten.using_ints, aten.unflatten.int,
    aten.index_select.default,
})
"""Ops whose result is data movement of their argument 0, the same on integers."""
FUNCTIONAL_WRITES = {
    aten.index_copy.default: (0, 3), aten.index_put.default: (0, 2),
    aten._unsafe_index_put.default: (0, 2), aten.slice_scatter.default: (0, 1),
    aten.select_scatter.default: (0, 1), aten.copy.default: (0, 1),
}
"""Functional writes: op -> (index of the destination, index of the value written)."""
SELECTS = {aten.where.self: (1, 2)}
"""Ops choosing each element from one of their operands (the rest decide which): op ->
the indices of those operands. Choosing among integers chooses the same elements."""
IN_PLACE_WRITES = {
    aten.index_copy_.default: 3, aten.index_put_.default: 2, aten.copy_.default: 1,
}
"""In-place writes of a value into argument 0: op -> index of the value written."""

_RESHAPES = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.unsqueeze.default,
})
"""Ops that keep the elements' order and only regroup dims: where the shapes say the
channel axis survives, it does."""

WILD = object()
"""The grid of a buffer's own contents while its grid is still being proposed."""


@dataclass(frozen=True)
class Refusal:
    """Why a value is not known to lie on one grid: the node at fault and the reason."""

    node: str
    reason: str

    def __str__(self) -> str:
        return f"{self.node}: {self.reason}"


_LOST = object()
Result = Any  # Grid | WILD | Refusal


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _static(shape: Any) -> tuple[int, ...] | None:
    shape = tuple(shape)
    return shape if all(isinstance(d, int) for d in shape) else None


def value_operands(node: Node) -> tuple[int, ...]:
    """The schema indices of the operands whose values a data-movement node moves."""
    if node.target in MOVES:
        return (0,)
    if node.target is aten.cat.default:
        return (0,)
    if node.target in FUNCTIONAL_WRITES:
        return FUNCTIONAL_WRITES[node.target]
    if node.target in SELECTS:
        return SELECTS[node.target]
    if node.target in IN_PLACE_WRITES:
        return (0, IN_PLACE_WRITES[node.target])
    return ()


def moved_axis(node: Node, axis: int | None) -> Any:
    """Where the channel ``axis`` of argument 0 lies in ``node``'s result (a data-movement op),
    or ``_LOST`` when the op splits, drops or indexes along it. None stays None."""
    if axis is None:
        return None
    source, out = _val(node.args[0]), _val(node)
    if source is None or out is None:
        return _LOST
    ins, outs = _static(source.shape), _static(out.shape)
    if ins is None or outs is None:
        return _LOST
    target, rank = node.target, len(ins)

    def arg(i: int) -> Any:
        value = argument_value(node, target._schema, i)
        return 0 if value is None else value

    if target in (aten.clone.default, aten.contiguous.default, aten.alias.default):
        return axis
    if target is aten.transpose.int:
        swap = {arg(1) % rank: arg(2) % rank, arg(2) % rank: arg(1) % rank}
        return swap.get(axis, axis)
    if target is aten.t.default:
        return axis if rank < 2 else 1 - axis
    if target is aten.permute.default:
        return [d % rank for d in arg(1)].index(axis)
    if target is aten.select.int:
        dim = arg(1) % rank
        return _LOST if dim == axis else axis - (dim < axis)
    if target in (aten.slice.Tensor, aten.narrow.default, aten.index_select.default):
        dim = arg(1) % rank
        return axis if dim != axis or (
            target is not aten.index_select.default and ins[axis] == outs[axis]) else _LOST
    if target in (aten.expand.default, aten.expand_as.default):
        moved = axis + len(outs) - rank
        return moved if outs[moved] == ins[axis] else _LOST
    if target not in _RESHAPES:
        return _LOST  # a view the table does not know: its elements may move anywhere
    prefix = math.prod(ins[:axis])
    for moved in range(len(outs)):
        if math.prod(outs[:moved]) == prefix and outs[moved] == ins[axis]:
            return moved
    return _LOST


class GridFlow:
    """The grid each node's value lies on, given the grids assumed for some buffers.

    Args:
        aliases: every node's storage root and view chain (the mutation scan's).
        assumed: per storage root of a buffer, the grid its contents lie on (or
            :data:`WILD` while proposing one); a root not listed is float state.
        names: per storage root of program state, what to call it in a reason.
        written: storage roots some node writes in place.
        resolve: the tensor a constant node (a per-channel scale) holds, or None.
    """

    def __init__(self, aliases: dict[Node, Alias], assumed: dict[Node, Any],
                 names: dict[Node, str], written: set[Node],
                 resolve: Callable[[Node], torch.Tensor | None]):
        self.aliases, self.assumed, self.names = aliases, assumed, names
        self.written, self.resolve = written, resolve
        self._memo: dict[Node, Result] = {}
        self.carries_state: set[Node] = set()
        """Nodes whose value is computed from an assumed buffer's contents."""
        self.sources: list[tuple[Node, Grid]] = []
        """The dequantize nodes met, with their grids."""
        self.zero_fills: set[Node] = set()
        """Tensors of zeros a write starts from (a prefill's fresh cache): on any grid."""

    def grid(self, node: Any) -> Result:
        if not isinstance(node, Node):
            return Refusal(str(node), "a constant, not a quantized value")
        if node not in self._memo:
            self._memo[node] = self._grid(node)
        return self._memo[node]

    def _grid(self, node: Node) -> Result:
        alias = self.aliases.get(node)
        if alias is not None and alias.root in self.names:
            return self._state(node, alias)
        if alias is not None and alias.root in self.written:
            return Refusal(node.name, f"its storage ({alias.root.name}) is written in place")
        found = dequantize_grid(node, self.resolve)
        if found is not None:
            self.sources.append((node, found))
            return found
        if node.op != "call_function":
            return Refusal(node.name, f"{node.op} {node.target}, not a quantized value")
        if is_zero_fill(node):
            # Zero lies on every grid pt2e makes (it is the grid's zero point): a fresh
            # cache of zeros that a prefill writes its keys into is stored as integers too.
            self.zero_fills.add(node)
            return WILD
        target = node.target
        if target in MOVES:
            return self._moved(node, self.grid(node.args[0]))
        if target is aten.cat.default:
            return self._cat(node)
        if target in SELECTS:
            return self._select(node)
        if target in FUNCTIONAL_WRITES:
            dest, src = (argument_value(node, target._schema, i)
                         for i in FUNCTIONAL_WRITES[target])
            return self.written_into(node, self.grid(dest), src)
        return Refusal(node.name, f"computed by {_op_name(node)}, not data movement of a "
                                  "dequantized value")

    def _state(self, node: Node, alias: Alias) -> Result:
        if alias.root not in self.assumed:
            name = self.names[alias.root]
            if name.startswith("buffer "):
                return Refusal(node.name, f"reads {name}, which stays float")
            return Refusal(node.name, f"reads {name}, not a dequantized value")
        self.carries_state.add(node)
        grid = self.assumed[alias.root]
        for view in alias.chain:
            grid = self._moved(view, grid)
        return grid

    def _moved(self, node: Node, grid: Result) -> Result:
        if grid is WILD or isinstance(grid, Refusal):
            self._carry(node, node.args[0])
            return grid
        self._carry(node, node.args[0])
        axis = moved_axis(node, grid.axis)
        if axis is _LOST:
            return Refusal(node.name, f"{_op_name(node)} does not keep the channel axis "
                                      f"{grid.axis}")
        return grid.on_axis(axis)

    def _cat(self, node: Node) -> Result:
        tensors = argument_value(node, node.target._schema, 0)
        result: Result = WILD
        empty: list[Grid] = []
        for value in tensors:
            grid = self.grid(value)
            self._carry(node, value)
            if isinstance(grid, Grid) and holds_no_values(value):
                # No value of it lands in the result: HF's rotary ``cat([k_rot, k_pass])``
                # passes an empty ``k_pass`` (full rotary) on the projection's grid.
                empty.append(grid)
                continue
            result = _unify(node, result, grid)
        if isinstance(result, Grid) and any(g.dtype != result.dtype for g in empty):
            # Its integers are still concatenated: another dtype would promote the rest.
            return Refusal(node.name, "concatenates an empty value of another integer dtype")
        if len(empty) == len(tensors):  # nothing but empty values: an empty result
            result = empty[0] if all(g.same(empty[0]) for g in empty) else Refusal(
                node.name, "concatenates empty values of several grids")
        if isinstance(result, Grid) and result.per_channel:
            rank = len(_val(node).shape) if _val(node) is not None else None
            dim = argument_value(node, node.target._schema, 1) or 0
            if rank is None or dim % rank == result.axis:
                return Refusal(node.name, "concatenates along the channel axis")
        return result

    def _select(self, node: Node) -> Result:
        result: Result = WILD
        out = _val(node)
        for index in SELECTS[node.target]:
            value = argument_value(node, node.target._schema, index)
            grid = self.grid(value)
            # Per channel, an operand broadcast into the result may have its channels
            # elsewhere: only operands of the result's own shape keep the axis.
            if isinstance(grid, Grid) and grid.per_channel and (
                    out is None or _val(value) is None or _val(value).shape != out.shape):
                grid = Refusal(node.name, f"{_op_name(node)} broadcasts {value.name} along "
                                          f"the channel axis {grid.axis}")
            result = _unify(node, result, grid)
            self._carry(node, value)
        return result

    def _carry(self, node: Node, *inputs: Any) -> None:
        if any(i in self.carries_state for i in inputs):
            self.carries_state.add(node)

    def written_into(self, node: Node, dest: Result, value: Any) -> Result:
        """The grid of ``node``'s result when it writes ``value`` into a destination of grid
        ``dest`` (a functional write; for an in-place one, of what it leaves there)."""
        src = self.grid(value)
        self._carry(node, node.args[0], value)
        if isinstance(dest, Refusal) or isinstance(src, Refusal):
            return dest if isinstance(dest, Refusal) else src
        if isinstance(src, Grid) and src.per_channel:
            src = _into_destination(node, src)
            if src is _LOST:
                return Refusal(node.name, f"{_op_name(node)} does not keep the channel axis")
        return _unify(node, dest, src)


def _into_destination(node: Node, src: Grid) -> Any:
    """``src``'s grid with its channel axis in the destination's dims (a write of
    argument ``value`` into argument 0), or ``_LOST``."""
    target = node.target
    schema = target._schema
    dest_val = _val(node.args[0])
    value_val = _val(argument_value(node, schema, value_operands(node)[-1]))
    if dest_val is None or value_val is None:
        return _LOST
    rank, axis = dest_val.dim(), src.axis
    if target in (aten.index_copy.default, aten.index_copy_.default, aten.slice_scatter.default):
        dim = (argument_value(node, schema, 1 if target is not aten.slice_scatter.default
                              else 2) or 0) % rank
        return _LOST if dim == axis else src
    if target is aten.select_scatter.default:
        dim = argument_value(node, schema, 2) % rank
        moved = axis + (axis >= dim)
        return src.on_axis(moved)
    if target in (aten.index_put.default, aten.index_put_.default,
                  aten._unsafe_index_put.default):
        indices = argument_value(node, schema, 1)
        given = [i for i, index in enumerate(indices) if index is not None]
        if len(given) != 1 or (_val(indices[given[0]]) is None
                               or _val(indices[given[0]]).dim() != 1):
            return _LOST
    # copy / index_put: the value broadcasts into the destination from the right
    moved = axis + rank - value_val.dim()
    if moved < 0 or moved >= rank or value_val.shape[axis] != dest_val.shape[moved]:
        return _LOST
    if target in (aten.index_put.default, aten.index_put_.default,
                  aten._unsafe_index_put.default) and given[0] == moved:
        return _LOST
    return src.on_axis(moved)


_ZERO_FILLS = {aten.zeros.default: None, aten.zeros_like.default: None,
               aten.new_zeros.default: None, aten.zero.default: None,
               aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
               aten.fill.Scalar: 1}
"""Ops making a tensor of one value: op -> the index of that value (None: zeros). ``zero`` and
``fill`` are what a buffer's ``zero_()`` / ``fill_(0)`` become once functional."""


def is_zero_fill(node: Node) -> bool:
    """``node`` makes a float tensor of (positive) zeros (``zeros``, ``full(..., 0)``, the
    functional ``zero_()`` / ``fill_(0)``, ...). ``-0.0`` is not one: the grid's zero point
    dequantizes to ``+0.0``, and the sign of a zero shows in what is computed from it."""
    if node.op != "call_function" or node.target not in _ZERO_FILLS:
        return False
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return False
    index = _ZERO_FILLS[node.target]
    if index is None:
        return True
    fill = argument_value(node, node.target._schema, index)
    return (isinstance(fill, (bool, int, float)) and fill == 0
            and math.copysign(1.0, fill) > 0)


def _unify(node: Node, a: Result, b: Result) -> Result:
    if isinstance(a, Refusal) or b is WILD:
        return a
    if isinstance(b, Refusal) or a is WILD:
        return b
    if a.same(b):
        return a
    return Refusal(node.name, f"mixes two grids: {a.describe()} and {b.describe()}")


def holds_no_values(node: Any) -> bool:
    """``node``'s value has no elements (its static shape has a 0)."""
    value = _val(node)
    return value is not None and any(isinstance(d, int) and d == 0 for d in value.shape)


def _op_name(node: Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def is_element_view(node: Node) -> bool:
    """A view op that addresses elements as its input does (not a reinterpreting
    ``view(dtype)``): it views an integer tensor exactly as it viewed the float one."""
    facts = facts_of(node)
    if facts is None or facts.result_of is None or facts.result_written:
        return False
    if node.target in MOVES:
        return True
    source, out = _val(node.args[0]), _val(node)
    return source is not None and out is not None and source.dtype == out.dtype
