"""Lowering partitions of an ExportedProgram to backend delegates that can own their state.

``to_delegate(ep, partitioner)`` turns each tagged partition into a delegate call whose
sub-program is an ExportedProgram run by a reference CPU backend;
:class:`passes.ConsumeBufferMutationsInDelegate` then moves mutable buffers into the
delegate that updates them, through :func:`hand_over_buffers`. ``delegates(ep)`` lists
the delegates, ``program_state`` reads every buffer of a running program by FQN, wherever
it lives.
"""

from .buffer_handover import Handover, hand_over_buffers
from .delegate_runtime import (
    REFERENCE_BACKEND,
    LoweredBackendModule,
    call_delegate,
    is_delegate_call,
    is_delegate_output,
)
from .errors import BufferAliasingError, BufferConsumptionError, DelegationError, PartitionError
from .ownership import program_state
from .partitioners import (
    DELEGATION_TAG,
    AllNodePartitioner,
    OpSupportPartitioner,
    Partitioner,
    tagged_partitions,
)
from .partitions_to_delegates import Delegate, delegates, to_delegate

__all__ = [
    "DELEGATION_TAG",
    "REFERENCE_BACKEND",
    "AllNodePartitioner",
    "BufferAliasingError",
    "BufferConsumptionError",
    "Delegate",
    "DelegationError",
    "Handover",
    "LoweredBackendModule",
    "OpSupportPartitioner",
    "PartitionError",
    "Partitioner",
    "call_delegate",
    "delegates",
    "hand_over_buffers",
    "is_delegate_call",
    "is_delegate_output",
    "program_state",
    "tagged_partitions",
    "to_delegate",
]
