"""Writes through a view that addresses some storage elements at several positions.

An ``as_strided`` view with overlapping strides has no exact write-back of its whole value:
``as_strided_scatter`` stores an aliased element once per position, the op's new value
from one position and a stale one from another. Exact writes through it:

* one value stored at every position (``fill_``, ``zero_``, a ``copy_`` of one element
  or of a filled tensor): whichever position stores an element last, it stores that
  value, so the plain write-back is right;
* an index-style op whose written positions give each storage element one well-defined
  value *whatever its index values*: they address each element at most once, proven from
  the view's static sizes and strides (``index_add_`` / ``index_copy_`` / ``index_fill_``
  / ``index_reduce_`` of one slice, ``index_put_`` with one-element index tensors, a
  scatter reaching one position per disjoint fibre along its dim, or a region addressing
  each element once), or the op stores one value at all of them (``index_fill_``, a
  scalar or filled source). Each reads only the positions it writes. The write-back
  stores only those positions: the op's own selection (``index_select``, ``index``,
  ``gather``) picks them from a map of storage positions (an ``as_strided`` of an
  ``arange``) and from the op's functional result, and ``index_put`` puts them into the
  flattened root. Element types whose eager kernel copies a temporary of the whole view
  back (``index_add_`` and scatters on float16 / bfloat16) are left out: eager stores
  stale values there.

Anything else written through such a view is refused (``overlap``).
The write-back itself is :meth:`passes._functionalization.rewrite.Rewrite._write_back`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

from .._analysis.op_schema import STORAGE_VIEWS, argument_value, target_of
from .element_overlap import ENUMERATION_LIMIT, element_offsets, overlaps_itself

__all__ = ["needs_written_positions", "stores_aliased_positions", "written_positions"]

aten = torch.ops.aten
# In-place writes storing one value, independent of the old ones, at every position.
_UNIFORM_WRITES = frozenset({aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default})
# (self, dim, index, ...): the slice ``index_select(self, dim, index)``.
_SLICE_WRITES = frozenset({aten.index_add_.default, aten.index_copy_.default,
                           aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor,
                           aten.index_reduce_.default})
# (self, indices, values, ...): the sub-tensor ``self[indices]``.
_INDEX_PUTS = frozenset({aten.index_put_.default, aten._index_put_impl_.default})
# (self, dim, index, ...): one position per index element, ``gather(self, dim, index)``.
_SCATTERS = frozenset({aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce,
                       aten.scatter_.value_reduce, aten.scatter_add_.default,
                       aten.scatter_reduce_.two})
_INDEX_DTYPES = frozenset({torch.int64, torch.int32})
# Element types whose eager CPU kernels write each written position in place. On float16
# and bfloat16, index_add_ and the scatters compute through a temporary copy of the whole
# view and copy it back, so an aliased element gets a stale value from a position they
# did not write (measured: torch 2.13); only the ops below keep those types.
_DIRECT_DTYPES = frozenset({torch.float32, torch.float64, torch.int8, torch.int16,
                            torch.int32, torch.int64, torch.uint8})
_DIRECT_REDUCED = frozenset({aten.index_copy_.default, aten.index_fill_.int_Scalar,
                             aten.index_fill_.int_Tensor, aten.index_reduce_.default,
                             *_INDEX_PUTS})
# Ops whose result holds one value at every element (empty_like does not: garbage).
_FILLED = frozenset({aten.full.default, aten.full_like.default, aten.zeros.default,
                     aten.zeros_like.default, aten.ones.default, aten.ones_like.default,
                     aten.new_full.default, aten.new_zeros.default, aten.new_ones.default,
                     aten.scalar_tensor.default})

Selection = tuple[Any, tuple]
"""``(target, args)``: ``target(tensor, *args)`` picks the positions an op writes from a
tensor of the written view's shape."""


def _is_uniform_write(node: Node) -> bool:
    """A fill, or a ``copy_`` of one element (or of an expand of one element) broadcast to
    every position: one value stored everywhere, whichever position stores it last."""
    if target_of(node) in _UNIFORM_WRITES:
        return True
    return target_of(node) is aten.copy_.default and len(node.args) >= 2 and _one_value(
        node.args[1])


def _one_value(value: Any) -> bool:
    """A number, a tensor holding one element (possibly broadcast by an expand), or a
    filled tensor (``full_like``, ...). Asked of a writer whose arguments are current
    values (``Rewrite._remap``): a filled tensor written before is its new value by then."""
    if isinstance(value, (int, float, bool)):
        return True
    if isinstance(value, Node) and target_of(value) in _FILLED:
        return True
    val = value.meta.get("val") if isinstance(value, Node) else None
    return isinstance(val, torch.Tensor) and all(
        (isinstance(size, int) and size == 1) or (isinstance(stride, int) and stride == 0)
        for size, stride in zip(val.shape, val.stride(), strict=True))


def _uniform_where_written(node: Node, schema: Any) -> bool:
    """Whether ``node`` stores one value, independent of the old ones, at every position
    it writes: then positions addressing one element twice store the same value."""
    target = target_of(node)
    if target in (aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor,
                  aten.scatter_.value):
        return True
    if target in _INDEX_PUTS:  # (self, indices, values, accumulate)
        return not argument_value(node, schema, 3) and _one_value(
            argument_value(node, schema, 2))
    if target in (aten.index_copy_.default, aten.scatter_.src):  # (self, dim, index, source)
        return _one_value(argument_value(node, schema, 3))
    return False


def needs_written_positions(chain: tuple[Node, ...], writer: Node, written: Node) -> bool:
    """Whether ``written`` (reached through ``chain``) may address an element at two
    positions and ``writer`` does not store one value everywhere: its write-back must
    store only the positions the op writes (or the write is refused)."""
    return any(target_of(v) in STORAGE_VIEWS and overlaps_itself(v) for v in chain) and (
        stores_aliased_positions(writer, written))


def stores_aliased_positions(writer: Node, written: Node) -> bool:
    """Whether ``written`` may address an element at two positions and ``writer`` may
    store different values there (it does not store one value everywhere)."""
    return overlaps_itself(written) and not _is_uniform_write(writer)


def written_positions(writer: Node, written: Node, root: Node) -> Selection | None:
    """How to pick the positions ``writer`` writes in ``written`` (a view of the storage
    of ``root``), when each storage element they address gets one well-defined value for
    every index value: the positions address each element at most once, or the op stores
    one value at all of them. Else None."""
    val, root_val = written.meta.get("val"), root.meta.get("val")
    target = target_of(writer)
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not all(
            isinstance(x, int) for x in (*val.shape, *val.stride())) or not isinstance(
            root_val, torch.Tensor) or root_val.dtype != val.dtype:
        return None  # positions are numbered in elements of the root's dtype
    if val.dtype not in _DIRECT_DTYPES and not (
            target in _DIRECT_REDUCED and val.dtype in (torch.float16, torch.bfloat16)):
        return None
    sizes, strides = list(val.shape), list(val.stride())
    schema = getattr(target, "_schema", None)
    if target in _SLICE_WRITES:
        dim, index = argument_value(writer, schema, 1), argument_value(writer, schema, 2)
        count = _numel(index)
        if not isinstance(dim, int) or count is None:
            return None
        dim %= len(sizes)
        kept = [k for k in range(len(sizes)) if k != dim]
        if count == 0 or _uniform_where_written(writer, schema) or (count == 1 and (
                _addresses_once([sizes[k] for k in kept], [strides[k] for k in kept]))):
            return aten.index_select.default, (dim, index)
        return None
    if target in _INDEX_PUTS:
        indices = argument_value(writer, schema, 1)
        picked = [k for k, index in enumerate(indices) if index is not None]
        counts = [_numel(indices[k]) for k in picked]
        if not picked or None in counts:
            return None
        kept = [k for k in range(len(sizes)) if k not in picked]
        if 0 in counts or _uniform_where_written(writer, schema) or (set(counts) == {1} and (
                _addresses_once([sizes[k] for k in kept], [strides[k] for k in kept]))):
            return aten.index.Tensor, (list(indices),)
        return None
    if target in _SCATTERS:
        dim, index = argument_value(writer, schema, 1), argument_value(writer, schema, 2)
        shape = _index_shape(index)
        if not isinstance(dim, int) or shape is None or len(shape) != len(sizes):
            return None
        dim %= len(sizes)
        if _uniform_where_written(writer, schema) or _scatter_positions_once(
                sizes, strides, dim, shape):
            return aten.gather.default, (dim, index)
    return None


def _index_shape(index: Any) -> list[int] | None:
    """The static shape of an integer index tensor, else None."""
    val = index.meta.get("val") if isinstance(index, Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype not in _INDEX_DTYPES or not all(
            isinstance(s, int) for s in val.shape):
        return None
    return list(val.shape)


def _numel(index: Any) -> int | None:
    shape = _index_shape(index)
    return None if shape is None else math.prod(shape)


def _addresses(sizes: list[int], strides: list[int]) -> torch.Tensor | None:
    """The storage offsets (from the first element) of every position of a strided
    layout, in its shape; None above the enumeration limit."""
    if math.prod(sizes) > ENUMERATION_LIMIT:
        return None
    return element_offsets(sizes, strides)


def _addresses_once(sizes: list[int], strides: list[int]) -> bool:
    """Whether a strided layout addresses each storage element at most once (a select
    along the dropped dims only moves its offset, so this holds at any index value)."""
    offsets = _addresses(sizes, strides)
    return offsets is not None and offsets.unique().numel() == offsets.numel()


def _scatter_positions_once(sizes: list[int], strides: list[int], dim: int,
                            shape: list[int]) -> bool:
    """A scatter writes position ``(.., index[i], ..)`` (``index[i]`` at ``dim``) for each
    index position ``i``, inside the index's extent in the other dims. With one index
    element per fibre along ``dim``, distinct fibres must share no element; with more, the
    whole region must address each element once."""
    if math.prod(shape) == 0:
        return True  # writes nothing
    if any(shape[k] > sizes[k] for k in range(len(sizes)) if k != dim):
        return False
    region = [sizes[k] if k == dim else shape[k] for k in range(len(sizes))]
    offsets = _addresses(region, strides)
    if offsets is None or offsets.numel() == 0:  # an index into an empty dim: eager fails
        return False
    if shape[dim] != 1:
        return offsets.unique().numel() == offsets.numel()
    fibres = offsets.movedim(dim, -1).reshape(-1, sizes[dim]).sort(dim=1).values
    distinct_per_fibre = 1 + (fibres[:, 1:] != fibres[:, :-1]).sum(dim=1)
    return int(distinct_per_fibre.sum()) == offsets.unique().numel()
