"""The built-in conditions of the mutable-buffer passes, in one place for users.

Each is a :class:`pass_manager.Condition`; passes list them in ``requires`` / ``provides``
/ ``preserves`` and the pass manager checks them. Each a pass provides is defined beside
the code that checks it and re-exported here; :data:`ZeroInitialState`, which no pass
provides and a user requires, is defined here.
"""

from __future__ import annotations

from typing import Any

from pass_manager import Condition

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.buffers import BUFFER, buffer_tensor, find_mutations
from ._analysis.data_movement import DataMovementNotAnnotated
from ._analysis.frozen_reads import NoFrozenMutableBuffers
from ._analysis.marked_state import mutable_buffers
from .delegation.ownership import BufferMutationsInDelegates

__all__ = [
    "BufferMutationsInDelegates",
    "DataMovementNotAnnotated",
    "Functional",
    "MutableBuffersMarked",
    "NoFrozenMutableBuffers",
    "ZeroInitialState",
]


def _nonzero_initial_state(program: Any) -> list[str]:
    """Each mutable buffer whose initial value is not all zeros: the value
    ``MarkMutableBuffers`` kept (dequantized for a buffer stored as integers), else, for an
    unmarked program, the buffer's value now."""
    marked = {fqn: entry for fqn, entry in mutable_buffers(program).items()
              if entry.kind == BUFFER}
    if not marked:
        marked = {state.name: None for state in find_mutations(program).writers
                  if state.kind == BUFFER}
    violations = []
    for fqn in sorted(marked):
        entry = marked[fqn]
        initial = entry.initial if entry is not None and entry.initial is not None else (
            buffer_tensor(program, fqn))
        if entry is not None and entry.grid is not None:
            initial = entry.grid.dequantize(initial)
        nonzero = int(initial.count_nonzero())
        if nonzero:
            violations.append(
                f"{fqn}: initial value has {nonzero} non-zero element(s) of "
                f"{initial.numel()} (max |x| {float(initial.abs().max()):.4g})")
    return violations


ZeroInitialState = Condition(
    "ZeroInitialState",
    _nonzero_initial_state,
    doc="Every mutable buffer starts all zeros. Core ML zero-fills its state when a model "
    "is prewarmed, so a delegate owning a buffer with another initial value computes "
    "from zeros on the device; require this to refuse such a program before lowering.",
)
