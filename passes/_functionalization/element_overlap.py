"""Which storage elements strided views touch: does a view address an element twice, may
two views of one storage share an element.

Read from the fake tensors' sizes, strides and offsets in ``node.meta["val"]``: exact for
static layouts (small enough to enumerate), proven from the shape environment's facts for
symbolic ones, and "may" whenever neither decides.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["ENUMERATION_LIMIT", "addresses_twice", "element_offsets", "may_overlap", "may_share",
           "overlaps_itself", "tensors_may_share"]


def _known(condition: Any) -> bool:
    """True only when ``condition`` (a bool or a SymBool) holds for every value the shape
    environment allows; never adds a guard."""
    if isinstance(condition, bool):
        return condition
    return statically_known_true(condition)


def _layout(val: torch.Tensor) -> tuple:
    return (*val.shape, *val.stride(), val.storage_offset())


def _extent(val: torch.Tensor) -> tuple[Any, Any] | None:
    """First and last storage element a strided tensor touches (None: sign of a symbolic
    stride unknown)."""
    low = high = val.storage_offset()
    for size, stride in zip(val.shape, val.stride(), strict=True):
        span = (size - 1) * stride
        if _known(stride >= 0):
            high = high + span
        elif _known(stride <= 0):
            low = low + span
        else:
            return None
    return low, high


# Above this many elements, static views are compared by extent only.
ENUMERATION_LIMIT = 1 << 22


def element_offsets(sizes: Any, strides: Any, offset: int = 0) -> torch.Tensor:
    """The storage offset of every position of a static strided layout, in its shape."""
    index = torch.tensor(offset, dtype=torch.int64)
    for size, stride in zip(sizes, strides, strict=True):
        index = index.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return index


def _elements(val: torch.Tensor) -> torch.Tensor:
    """The storage offsets of every element of a view with static layout."""
    return element_offsets(val.shape, val.stride(), val.storage_offset()).flatten()


def overlaps_itself(node: Node) -> bool:
    """Whether a view may address one storage element at two positions (an ``as_strided``
    view with overlapping strides): a write through it has no functional equivalent.
    True when it cannot be proven otherwise."""
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or addresses_twice(val)


def addresses_twice(val: torch.Tensor) -> bool:
    """Whether a strided tensor may address one storage element at two positions (an
    ``expand`` broadcasting a dim, an ``as_strided`` with overlapping strides). Proven not
    to when its strides, sorted, each step past everything the smaller ones reach (any
    contiguous, permuted or sliced layout, however large, and static strides over symbolic
    sizes the shape environment bounds); else its elements are enumerated. True when it
    cannot be proven otherwise (symbolic strides, or symbolic sizes reaching too far)."""
    if _steps_past_reach(val):
        return False
    if not all(isinstance(x, int) for x in _layout(val)) or val.numel() > ENUMERATION_LIMIT:
        return True
    elements = _elements(val)
    return elements.unique().numel() < elements.numel()


def _steps_past_reach(val: torch.Tensor) -> bool:
    """Whether each stride, smallest first, is proven to step past everything the smaller
    ones reach: then no element is addressed twice. Symbolic sizes are proven from the
    shape environment's facts (``b.as_strided((n,), (2,), 1)``); strides must be static, to
    be sorted."""
    dims = [(stride, size) for size, stride in zip(val.shape, val.stride(), strict=True)
            if not _known(size <= 1)]
    if not all(isinstance(stride, int) for stride, _ in dims):
        return False
    reach = 0
    for stride, size in sorted(dims, key=lambda dim: dim[0]):
        if not _known(stride > reach):
            return False
        reach = reach + (size - 1) * stride
    return True


def may_overlap(a: Node, b: Node) -> bool:
    """Whether two views of one storage may touch a common element but are not identical.

    Exact for static layouts (the elements are enumerated, so sibling columns, selects and
    diagonals are told apart); with symbolic sizes, equality and disjointness are proven
    from the shape environment's facts (``x[:s]`` vs ``x[0:s]``, ``x[:s]`` vs
    ``x[s:2*s]``). True when it cannot be proven otherwise (no fake tensors included).
    """
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return True
    return not _identical(va, vb) and tensors_may_share(va, vb)


def _identical(va: torch.Tensor, vb: torch.Tensor) -> bool:
    """Whether two views of one storage are provably the same view (one layout)."""
    la, lb = _layout(va), _layout(vb)
    return va.dim() == vb.dim() and all(_known(x == y) for x, y in zip(la, lb, strict=True))


def may_share(a: Node, b: Node) -> bool:
    """Whether two views of one storage may touch a common element, identical ones
    included (:func:`may_overlap` leaves those out). True when it cannot be proven
    otherwise."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if a is b or not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return True
    return tensors_may_share(va, vb)


def tensors_may_share(va: torch.Tensor, vb: torch.Tensor) -> bool:
    """:func:`may_share` of two (real or fake) strided tensors of one storage."""
    if _known(va.numel() == 0) or _known(vb.numel() == 0):
        return False
    if _identical(va, vb):
        return True
    la, lb = _layout(va), _layout(vb)
    static = all(isinstance(x, int) for x in (*la, *lb))
    if static and va.numel() + vb.numel() <= ENUMERATION_LIMIT:
        return bool(torch.isin(_elements(va), _elements(vb)).any())
    ea, eb = _extent(va), _extent(vb)
    if ea is None or eb is None:
        return True
    return not (_known(ea[1] < eb[0]) or _known(eb[1] < ea[0]))
