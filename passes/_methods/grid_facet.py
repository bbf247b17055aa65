"""The quantization grid of a buffer, as a facet methods sharing it must agree on.

One of the facets :mod:`passes._methods.shared_buffers` compares, so
``PassManager.run({name: program})`` compares it without the manager knowing about
quantization. A buffer's grid is the one ``QuantizeMutableBuffers`` stores it on, or, for a
float-stored quantized program, the one grid every write of it stores values of; a buffer
without one (not quantized, or written on several grids) has no grid facet.
"""

from __future__ import annotations

from typing import Any

from pass_manager import graph_of

from .._analysis.buffers import GRID_META
from .._analysis.grids import Grid
from .._analysis.quantize_ops import is_dequantize
from .._analysis.quantized_state import plan_quantized_state

__all__ = ["GRID_FACET", "BufferGrid", "buffer_grids"]

GRID_FACET = "quantization grid"


class BufferGrid:
    """A buffer's grid as a comparable value: equal when the grids make the same values at
    the same places (:meth:`Grid.same`), shown with its exact scale and zero point."""

    def __init__(self, grid: Grid, stored: bool):
        self.grid = grid
        self.stored = stored

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, BufferGrid) and self.grid.same(other.grid)

    def __hash__(self) -> int:
        return hash((self.grid.dtype, self.grid.quant_min, self.grid.quant_max))

    def __str__(self) -> str:
        g = self.grid
        if g.per_channel:
            where = (f"axis {g.axis}, scales {g.scale.tolist()!r}, "
                     f"zero points {g.zero_point.tolist()!r}")
        else:
            where = f"scale {float(g.scale)!r}, zero point {int(g.zero_point)}"
        storage = "stored as" if self.stored else "values of"
        return (f"{storage} {str(g.dtype).removeprefix('torch.')} "
                f"[{g.quant_min}, {g.quant_max}], {where}")

    __repr__ = __str__


def buffer_grids(program: Any) -> dict[str, BufferGrid]:
    """The grid of each mutable buffer of ``program`` that has one."""
    if not any(map(is_dequantize, graph_of(program).nodes)):
        return {}  # not quantized: nothing to plan
    plans, _ = plan_quantized_state(program)
    found = {}
    for plan in plans:
        recorded = next((n.meta[GRID_META] for n in plan.nodes if GRID_META in n.meta), None)
        if recorded is not None:
            found[plan.fqn] = BufferGrid(recorded, stored=True)
        elif plan.grid is not None:
            found[plan.fqn] = BufferGrid(plan.grid, stored=False)
    return found

