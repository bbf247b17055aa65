"""Quantization grids: the values a ``dequantize`` can produce, read from the graph.

A :class:`Grid` is one ``(scale, zero_point, quant_min, quant_max, dtype)`` of
``quantized_decomposed.dequantize_per_tensor`` (or, per channel, the scales and zero points
along one ``axis`` of ``dequantize_per_channel``). It knows how to quantize and dequantize a
tensor exactly as the graph's ops do, and whether a float tensor lies on it bit for bit.
:func:`dequantize_grid` reads the grid a dequantize node produces values of;
:func:`quantize_grid` the grid a quantize node rounds onto.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx import Node

from ..errors import QuantizedStateError
from .marked_state import fill_value

__all__ = ["Grid", "dequantize_grid", "quantize_grid", "same_bits"]

_qd = torch.ops.quantized_decomposed
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32)
_UNKNOWN = object()
# Bits of each element size, to compare floats bit for bit (-0.0 is not 0.0).
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same dtype, shape and bits (NaN payloads, signed zeros)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    bits = _BITS[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


@dataclass(frozen=True, eq=False)
class Grid:
    """A quantization grid: ``(q - zero_point) * scale`` for integer ``q`` in
    ``[quant_min, quant_max]`` of ``dtype``, computed in ``out_dtype``.

    Per channel, ``scale`` and ``zero_point`` are 1-D tensors along ``axis`` of the value
    (``axis`` is None per tensor). Two grids are :meth:`same` when they make the same values
    at the same places.
    """

    scale: float | torch.Tensor
    zero_point: int | torch.Tensor
    quant_min: int
    quant_max: int
    dtype: torch.dtype
    axis: int | None = None
    out_dtype: torch.dtype = torch.float32

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    def same(self, other: Any) -> bool:
        if not isinstance(other, Grid):
            return False
        plain = ("quant_min", "quant_max", "dtype", "axis", "out_dtype")
        if any(getattr(self, k) != getattr(other, k) for k in plain):
            return False
        tensors = isinstance(self.scale, torch.Tensor), isinstance(other.scale, torch.Tensor)
        if any(tensors):
            return all(tensors) and (same_bits(self.scale, other.scale)
                                     and same_bits(self.zero_point, other.zero_point))
        return self.scale == other.scale and self.zero_point == other.zero_point

    def same_levels(self, other: Any) -> bool:
        """The same grid up to where its channels lie (``axis``)."""
        return isinstance(other, Grid) and self.on_axis(other.axis).same(other)

    def on_axis(self, axis: int | None) -> Grid:
        """The same grid describing a value whose channels lie along ``axis``."""
        return self if axis == self.axis else replace(self, axis=axis)

    # -- the ops of the graph, applied to tensors ---------------------------------------
    def quantize(self, value: torch.Tensor) -> torch.Tensor:
        if self.per_channel:
            return _qd.quantize_per_channel(value, self.scale, self.zero_point, self.axis,
                                            self.quant_min, self.quant_max, self.dtype)
        return _qd.quantize_per_tensor(value, self.scale, self.zero_point, self.quant_min,
                                       self.quant_max, self.dtype)

    def dequantize(self, value: torch.Tensor) -> torch.Tensor:
        if self.per_channel:
            return _qd.dequantize_per_channel(
                value, self.scale, self.zero_point, self.axis, self.quant_min, self.quant_max,
                self.dtype, out_dtype=self.out_dtype)
        return _qd.dequantize_per_tensor(value, self.scale, self.zero_point, self.quant_min,
                                         self.quant_max, self.dtype, out_dtype=self.out_dtype)

    def holds(self, value: torch.Tensor, fill: Any = _UNKNOWN) -> bool:
        """Whether every element of ``value`` is a point of this grid, bit for bit.

        ``fill``: ``fill_value(value)`` when the caller has it (the one value every
        element holds, or None), so a 16 MiB all-zero cache is read once, not per check.
        """
        if value.dtype != self.out_dtype:
            return False
        if self.per_channel:
            if value.dim() <= self.axis or value.shape[self.axis] != self.scale.numel():
                return False
            fill = None
        elif fill is _UNKNOWN:
            fill = fill_value(value)
        if fill is not None:  # the usual all-zero cache: one element says it
            value = fill
        return same_bits(self.dequantize(self.quantize(value)), value)

    def integers_of(self, value: torch.Tensor, fill: Any = _UNKNOWN) -> torch.Tensor:
        """The integers of ``value`` (which :meth:`holds`) on this grid, laid out like it;
        a fill expanded to a shape stays one (``fill`` as for :meth:`holds`)."""
        if self.per_channel:
            fill = None
        elif fill is _UNKNOWN:
            fill = fill_value(value)
        if fill is None:
            return self.quantize(value)
        integer = self.quantize(fill)
        if all(stride == 0 for stride in value.stride()):
            return integer.expand(value.shape)
        return torch.empty_like(value, dtype=self.dtype).fill_(integer.item())

    def round_trip_exact(self) -> bool:
        """Whether ``quantize(dequantize(q)) == q`` for every integer ``q`` of the grid: then a
        float read that is re-quantized onto this grid may read the integers instead."""
        if self.per_channel:
            levels = torch.arange(self.quant_min, self.quant_max + 1).to(self.dtype)
            q = levels.view(-1, 1).expand(-1, self.scale.numel()).contiguous()
            columns = replace(self, axis=1)
            return torch.equal(columns.quantize(columns.dequantize(q)), q)
        return _round_trip_exact(float(self.scale), int(self.zero_point), self.quant_min,
                                 self.quant_max, self.dtype, self.out_dtype)

    # -- building graph nodes ------------------------------------------------------------
    def dequantize_args(self, value: Any, scale: Any = None, zero_point: Any = None) -> tuple:
        """``(target, args, kwargs)`` of a dequantize node of ``value`` onto this grid;
        per channel, ``scale`` / ``zero_point`` are the nodes holding them."""
        kwargs = {} if self.out_dtype == torch.float32 else {"out_dtype": self.out_dtype}
        if self.per_channel:
            return (_qd.dequantize_per_channel.default,
                    (value, scale, zero_point, self.axis, self.quant_min, self.quant_max,
                     self.dtype), kwargs)
        return (_qd.dequantize_per_tensor.default,
                (value, self.scale, self.zero_point, self.quant_min, self.quant_max,
                 self.dtype), kwargs)

    def describe(self) -> str:
        if self.per_channel:
            where = f"per channel along axis {self.axis} ({self.scale.numel()} scales)"
        else:
            where = f"scale={self.scale:.6g}, zero_point={self.zero_point}"
        return f"{str(self.dtype).removeprefix('torch.')} [{self.quant_min}, " \
               f"{self.quant_max}], {where}"

    def __repr__(self) -> str:
        return f"Grid({self.describe()})"


@functools.cache
def _round_trip_exact(scale: float, zero_point: int, quant_min: int, quant_max: int,
                      dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    grid = Grid(scale, zero_point, quant_min, quant_max, dtype, None, out_dtype)
    q = torch.arange(quant_min, quant_max + 1).to(dtype)
    return torch.equal(grid.quantize(grid.dequantize(q)), q)


def _constant(node: Any, resolve: Any) -> torch.Tensor | None:
    if isinstance(node, torch.Tensor):
        return node
    if isinstance(node, Node) and resolve is not None:
        return resolve(node)
    return None


def _checked(node: Node, grid: Grid) -> Grid:
    """``grid`` after the checks whose failure means a malformed dequantize/quantize node."""
    def bad(reason: str) -> QuantizedStateError:
        return QuantizedStateError(node.name, reason)

    if grid.dtype not in _INTEGER_DTYPES:
        raise bad(f"its dtype {grid.dtype} is not an integer dtype of a quantization grid")
    if not grid.quant_min <= grid.quant_max:
        raise bad(f"quant_min {grid.quant_min} > quant_max {grid.quant_max}")
    info = torch.iinfo(grid.dtype)
    if grid.quant_min < info.min or grid.quant_max > info.max:
        raise bad(f"[{grid.quant_min}, {grid.quant_max}] does not fit {grid.dtype}")
    if grid.per_channel:
        finite = bool(torch.isfinite(grid.scale).all()) and bool((grid.scale > 0).all())
    else:
        finite = math.isfinite(grid.scale) and grid.scale > 0
    if not finite:
        raise bad(f"a scale is not a finite positive number: {grid.describe()}")
    return grid


def _read(node: Node, per_channel: bool, resolve: Any, out_dtype: Any) -> Grid | None:
    args = list(node.args)
    names = (("input", "scales", "zero_points", "axis", "quant_min", "quant_max", "dtype")
             if per_channel else
             ("input", "scale", "zero_point", "quant_min", "quant_max", "dtype"))
    for name in names[len(args):]:
        if name not in node.kwargs:
            raise QuantizedStateError(node.name, f"argument {name!r} is missing")
        args.append(node.kwargs[name])
    if per_channel:
        _, scale, zero_point, axis, qmin, qmax, dtype = args
        scale, zero_point = _constant(scale, resolve), _constant(zero_point, resolve)
        if scale is None or zero_point is None:
            return None  # computed in the graph: not one fixed grid
        rank = _rank(node)
        if rank is None:
            return None
        axis = axis % rank
        grid = Grid(scale.detach().clone(), zero_point.detach().clone(), qmin, qmax, dtype,
                    axis, out_dtype or torch.float32)
    else:
        _, scale, zero_point, qmin, qmax, dtype = args
        if not isinstance(scale, (int, float)) or not isinstance(zero_point, int):
            return None
        grid = Grid(float(scale), zero_point, qmin, qmax, dtype, None,
                    out_dtype or torch.float32)
    if not all(isinstance(v, int) for v in (qmin, qmax)) or not isinstance(
            dtype, torch.dtype):
        raise QuantizedStateError(node.name, "quant_min, quant_max or dtype is not a constant")
    return _checked(node, grid)


def _rank(node: Node) -> int | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dim()
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def dequantize_grid(node: Node, resolve: Any = None) -> Grid | None:
    """The grid of the values ``node`` produces when it is a fixed-grid dequantize, else None.

    ``resolve(node)`` gives the tensor a per-channel scale or zero-point node holds (a
    constant), or None. Raises :class:`QuantizedStateError` for a dequantize whose
    arguments cannot describe a grid (a float dtype, ``quant_min > quant_max``, a scale
    that is not finite and positive).
    """
    if node.op != "call_function":
        return None
    if node.target is _qd.dequantize_per_tensor.default:
        return _read(node, False, resolve, node.kwargs.get("out_dtype"))
    if node.target is _qd.dequantize_per_channel.default:
        return _read(node, True, resolve, node.kwargs.get("out_dtype"))
    return None


def quantize_grid(node: Node, resolve: Any = None) -> Grid | None:
    """The grid a ``quantize_per_tensor`` / ``quantize_per_channel`` node rounds onto."""
    if node.op != "call_function":
        return None
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, Node) else None
    out_dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
    if node.target is _qd.quantize_per_tensor.default:
        return _read(node, False, resolve, out_dtype)
    if node.target is _qd.quantize_per_channel.default:
        return _read(node, True, resolve, out_dtype)
    return None
