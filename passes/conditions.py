"""The built-in conditions of the mutable-buffer passes, in one place for users.

Each is a :class:`pass_manager.Condition`; passes list them in ``requires`` / ``provides``
/ ``preserves`` and the pass manager checks them. Each is defined beside the code that
checks it; this module only re-exports them.
"""

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.data_movement import DataMovementNotAnnotated
from ._analysis.frozen_reads import NoFrozenMutableBuffers
from .delegation.ownership import BufferMutationsInDelegates

__all__ = [
    "BufferMutationsInDelegates",
    "DataMovementNotAnnotated",
    "Functional",
    "MutableBuffersMarked",
    "NoFrozenMutableBuffers",
]
