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

from typing import Any

import torch
from torch.fx import Node

from .._analysis.op_schema import target_of
from ..errors import UnsupportedMutationError

__all__ = ["check_random_layout"]

aten = torch.ops.aten

_CONTIGUOUS_ALLOCATION = frozenset({aten.bernoulli_.float})
"""In-place random ops whose functional variant allocates a contiguous result
(``bernoulli.p``: ``empty_like(self, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``)."""

_NORMAL_DRAWS = frozenset({"normal_", "normal", "randn", "normal_functional"})
"""Ops drawing normals, whose CPU kernel fills a contiguous tensor of 16 or more elements
by a vectorized algorithm and any other tensor one element at a time."""


def _is_random(op: Any) -> bool:
    # The tag, not a Generator argument: torch.randn(size, out=t) takes none.
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _writes_out(op: Any) -> bool:
    return any(a.name == "out" or (a.kwarg_only and a.alias_info is not None
                                   and a.alias_info.is_write) for a in op._schema.arguments)


def _memory_order(sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of more than one element, outermost in storage first."""
    dims = [d for d, size in enumerate(sizes) if size > 1]
    return tuple(sorted(dims, key=lambda d: (-strides[d], d)))


def _static(values: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(v) for v in values)
    except (TypeError, ValueError, RuntimeError):  # symbolic (unbacked or not guarded)
        return None


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _layouts_draw_alike(op: Any, val: torch.Tensor) -> bool:
    sizes, strides = _static(val.shape), _static(val.stride())
    if sizes is None or strides is None:
        return False
    if val.numel() <= 1:
        return True
    if _writes_out(op) or op in _CONTIGUOUS_ALLOCATION:
        allocated = _contiguous_strides(sizes)
    else:
        allocated = _static(torch.empty_like(val).stride())
        if allocated is None:
            return False
    if _memory_order(sizes, strides) != _memory_order(sizes, allocated):
        return False
    if op._schema.name.split("::")[-1] in _NORMAL_DRAWS:
        contiguous = _contiguous_strides(sizes)
        keep = [d for d, size in enumerate(sizes) if size > 1]
        return ([strides[d] for d in keep] == [contiguous[d] for d in keep]) == (
            [allocated[d] for d in keep] == [contiguous[d] for d in keep])
    return True


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
        if not _layouts_draw_alike(op, val):
            raise UnsupportedMutationError(
                node, f"it draws random numbers into {w.name} (size {tuple(val.shape)}, "
                      f"stride {tuple(val.stride())}), whose layout makes eager's kernel "
                      "draw them in another order or by another algorithm than its "
                      "functional form, which draws into a tensor it allocates: the "
                      "numbers would differ from eager's under one seed; draw into a "
                      "contiguous tensor and copy_ it in", "no-variant")
