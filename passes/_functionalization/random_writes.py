"""Random writes whose functional form draws other numbers than eager under one seed.

A random op (tagged ``nondeterministic_seeded``) writing in place or ``out=`` draws into the
tensor it writes, laid out as that tensor is; its functional form draws into a tensor it
allocates: ``empty_like`` of the target for most in-place ops (same strides when the target
is dense, the same stride order otherwise), a contiguous one for ``out=`` ops and
``bernoulli_(p)``. The CPU kernels (torch 2.13, measured under ``torch.manual_seed``) give
the same numbers on both only when

* the draws happen in the same memory order: every kernel draws element after element in
  the order of its tensor's storage (``torch.rand(n, out=b.t())`` gives ``b.t()`` other
  numbers than ``torch.rand(n).t()`` does), and
* for the normal draws (``normal_``, ``normal(..., out=)``, ``randn(..., out=)``) both
  tensors are contiguous or neither is: a contiguous tensor is filled by another algorithm
  (``b[:, 0].normal_()`` of a 32x32 ``b`` is drawn one element at a time, its functional
  ``normal_functional`` into a contiguous column by the vectorized fill).

Such a write is refused (``no-variant``): no functional form draws eager's numbers. torch's
``run_decompositions({})`` gives the same other numbers there.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._analysis.op_schema import target_of
from ..errors import UnsupportedMutationError

__all__ = ["check_random_layout"]

aten = torch.ops.aten

_CONTIGUOUS_ALLOCATION = frozenset({aten.bernoulli_.float})
"""In-place random ops whose functional variant allocates a contiguous result
(``bernoulli.p``: ``empty_like(self, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``)."""

_NORMAL_DRAWS = frozenset({"normal_", "normal", "randn"})
"""Ops drawing normals, whose CPU kernel fills a contiguous tensor of 16 or more elements
by a vectorized algorithm and any other tensor one element at a time."""


def _is_random(op: Any) -> bool:
    # The tag, not a Generator argument: torch.randn(size, out=t) takes none.
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _writes_out(op: Any) -> bool:
    return any(a.name == "out" or (a.kwarg_only and a.alias_info is not None
                                   and a.alias_info.is_write) for a in op._schema.arguments)


def _known(condition: Any) -> bool:
    """True only when ``condition`` holds for every size (never adds a guard)."""
    return statically_known_true(condition)


def _spread(val: torch.Tensor) -> list[int]:
    """The dims that may hold more than one element (only those order the storage)."""
    return [d for d, size in enumerate(val.shape) if not _known(size == 1)]


def _storage_order_is_logical(val: torch.Tensor) -> bool:
    """Whether the storage holds ``val``'s elements in their logical order (strides of its
    spread dims decreasing): a column, a strided slice, not a transpose."""
    strides, dims = val.stride(), _spread(val)
    return all(_known(strides[a] >= strides[b]) for a, b in itertools.pairwise(dims))


def _contiguous(val: torch.Tensor) -> bool:
    step: Any = 1
    spread = _spread(val)
    for d in reversed(range(val.dim())):
        if d in spread and not _known(val.stride()[d] == step):
            return False
        step = step * val.shape[d]
    return True


def _dense(val: torch.Tensor) -> bool:
    """Whether ``val`` fills its storage without gaps (``empty_like`` keeps its strides);
    of symbolic layouts, only contiguous ones are known to."""
    if _contiguous(val):
        return True
    sizes, strides = tuple(val.shape), val.stride()
    if not all(type(v) is int for v in (*sizes, *strides)):
        return False
    step = 1
    for d in sorted(_spread(val), key=lambda d: strides[d]):  # innermost first
        if strides[d] != step:
            return False
        step *= sizes[d]
    return True


def _draws_alike(op: Any, val: torch.Tensor) -> bool:
    """Whether eager draws into ``val`` the numbers ``op``'s functional form draws into the
    tensor it allocates (the module docstring)."""
    if not _spread(val):
        return True
    # The vectorized normal fill takes a contiguous tensor of 16 or more elements.
    normal = op._schema.name.split("::")[-1] in _NORMAL_DRAWS and not _known(val.numel() < 16)
    if _writes_out(op) or op in _CONTIGUOUS_ALLOCATION:  # draws into a contiguous tensor
        return _contiguous(val) if normal else _storage_order_is_logical(val)
    # Draws into empty_like(val): val's strides when it is dense, otherwise compact
    # strides in val's storage order, which are contiguous when that order is logical.
    return not normal or _dense(val) or not _storage_order_is_logical(val)


def check_random_layout(node: Node, written: list[Node]) -> None:
    """Refuse a random write whose functional form draws other numbers than eager (the
    module docstring says when)."""
    op = target_of(node)
    if not isinstance(op, torch._ops.OpOverload) or not _is_random(op):
        return
    for w in written:
        val = w.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            continue
        if not _draws_alike(op, val):
            raise UnsupportedMutationError(
                node, f"it draws random numbers into {w.name} (size {tuple(val.shape)}, "
                      f"stride {tuple(val.stride())}), whose layout makes eager's kernel "
                      "draw them in another order or by another algorithm than its "
                      "functional form, which draws into a tensor it allocates: the "
                      "numbers would differ from eager's under one seed; draw into a "
                      "contiguous tensor and copy_ it in", "no-variant")
