"""Which shared buffers every method can store as integers: a joint decision.

One ``.pte`` holds one buffer per name for all methods, so a buffer is stored as integers in
every method writing it or in none. :class:`~passes.QuantizeMutableBuffers` decides each
method from its own writes; a method writing a value off every grid (a reset ``fill_(0.3)``)
keeps the buffer float while another method would store it as integers, and its float writes
cannot go into those integers. :func:`kept_float` finds those buffers before the pass runs, so
that each method keeps them float (``QuantizeMutableBuffers(keep_float=...)``): every method
then computes exactly what the float-stored quantized methods compute.

A method whose every write of the buffer is the constant zero (a reset ``zero_()``) can
store it on any per-tensor grid (the zero point): it does not keep the buffer float here;
the joint condition gives it the other methods' integers after the pass
(:func:`~passes._methods.integer_reads.read_integer_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._analysis.quantized_state import plan_quantized_state
from .integer_reads import writes_only_zeros

__all__ = ["kept_float"]


def kept_float(programs: Mapping[str, Any]) -> dict[str, str]:
    """``{buffer FQN: why}`` for each floating-point buffer some method writes and keeps
    float while another method would store it as integers; keeping one float may keep
    another float (a write reading it), so the decision runs to its fixed point (at most
    one round per buffer)."""
    keep: dict[str, str] = {}
    while True:
        stored: dict[str, list[Any]] = {}
        refused: dict[str, str] = {}
        zeros: dict[str, str] = {}  # buffer -> a method writing it only as zeros
        for name, program in programs.items():
            for plan in plan_quantized_state(program, keep_float=keep)[0]:
                if plan.carried or plan.skipped or plan.fqn in keep:
                    continue
                if plan.grid is not None:
                    stored.setdefault(plan.fqn, []).append(plan.grid)
                elif writes_only_zeros(plan):
                    zeros.setdefault(plan.fqn, name)
                else:
                    refused.setdefault(plan.fqn, f"method {name!r} writes it off the grid "
                                                 f"({plan.reason}), and all methods hold "
                                                 "one buffer")
        for fqn, name in zeros.items():  # a zero point per channel: not one constant
            if any(grid.per_channel for grid in stored.get(fqn, ())):
                refused.setdefault(fqn, f"method {name!r} writes it as zeros, which a "
                                        "per-channel grid does not store as one constant")
        new = {fqn: why for fqn, why in refused.items() if fqn in stored}
        if not new:
            return keep
        keep.update(new)
