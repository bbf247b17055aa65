"""Which shared buffers every method can store as integers: a joint decision.

One ``.pte`` holds one buffer per name for all methods, so a buffer is stored as integers in
every method writing it or in none. :class:`~passes.QuantizeMutableBuffers` decides each
method from its own writes; a method writing a value off every grid (a reset ``fill_(0.3)``)
keeps the buffer float while another method would store it as integers, and its float writes
cannot go into those integers. :func:`kept_float` finds those buffers before the pass runs, so
that each method keeps them float (``QuantizeMutableBuffers(keep_float=...)``): every method
then computes exactly what the float-stored quantized methods compute.

A method whose every write of the buffer is the constant zero (a reset ``zero_()``) can
store it on any per-tensor grid (the zero point), and a method that only reads it can read
a per-tensor grid's integers: they do not keep the buffer float here; the joint condition
gives them the other methods' integers after the pass
(:func:`~passes._methods.integer_reads.read_integer_state`). On a per-channel grid, whose
scales and zero points only the writers hold, either keeps the buffer float.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._analysis.buffers import buffer_nodes
from .._analysis.quantized_state import plan_quantized_state
from .integer_reads import PER_CHANNEL_READ, PER_CHANNEL_ZEROS, writes_only_zeros
from .shared_buffers import written_buffers

__all__ = ["kept_float"]


def kept_float(programs: Mapping[str, Any]) -> dict[str, str]:
    """``{buffer FQN: why}`` for each floating-point buffer some method writes and keeps
    float while another method would store it as integers, or that another method reads
    or writes only as zeros while it would be stored on a per-channel grid; keeping one
    float may keep
    another float (a write reading it), so the decision runs to its fixed point (at most
    one round per buffer)."""
    keep: dict[str, str] = {}
    readers = _readers(programs)
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
        for fqn, grids in stored.items():  # a per-channel grid's constants: the writers'
            if not any(grid.per_channel for grid in grids):
                continue
            if fqn in zeros:
                refused.setdefault(fqn, f"method {zeros[fqn]!r} {PER_CHANNEL_ZEROS}")
            elif fqn in readers:
                refused.setdefault(fqn, f"method {readers[fqn]!r} {PER_CHANNEL_READ}")
        new = {fqn: why for fqn, why in refused.items() if fqn in stored}
        if not new:
            return keep
        keep.update(new)


def _readers(programs: Mapping[str, Any]) -> dict[str, str]:
    """``{buffer FQN: a method}`` for each buffer a method reads without writing it."""
    found: dict[str, str] = {}
    for name, program in programs.items():
        written = written_buffers(program)
        for node, fqn in buffer_nodes(program).items():
            if node.users and fqn not in written:
                found.setdefault(fqn, name)
    return found
