"""Typed errors of delegation: bad partitions, unconsumable buffers, unresolvable aliasing.

All derive from :class:`DelegationError`, itself a :class:`pass_manager.PassManagerError`,
so a pipeline reports them like any other pass failure. Each carries the names it
talks about (tag, node, buffer) as attributes, not only in its message.
"""

from __future__ import annotations

from collections.abc import Sequence

from pass_manager import PassManagerError

__all__ = [
    "BufferAliasingError",
    "BufferConsumptionError",
    "DelegationError",
    "PartitionError",
]


class DelegationError(PassManagerError):
    """Base class of the errors raised while lowering to delegates or moving state into them."""


class PartitionError(DelegationError):
    """A tagged partition cannot become one delegate call (it would create a dependency cycle)."""

    def __init__(self, tag: str, reason: str, nodes: Sequence[str] = ()):
        self.tag = tag
        self.reason = reason
        self.nodes = list(nodes)
        where = f" (nodes: {', '.join(self.nodes)})" if self.nodes else ""
        super().__init__(f"partition {tag!r}: {reason}{where}", pass_name="to_delegate")


class BufferConsumptionError(DelegationError):
    """``strict=True``: a mutable buffer could not be moved into the delegate that updates it."""

    def __init__(self, buffer: str, partitions: Sequence[str], reason: str, pass_name: str):
        self.buffer = buffer
        self.partitions = list(partitions)
        self.reason = reason
        involved = ", ".join(repr(p) for p in self.partitions) or "no delegate"
        super().__init__(
            f"{pass_name}: buffer {buffer!r} (partitions {involved}) could not be consumed: "
            + reason,
            pass_name=pass_name,
        )


class BufferAliasingError(DelegationError):
    """Moving a buffer into its delegate would split state that aliases other state."""

    def __init__(self, buffer: str, partition: str, reason: str, pass_name: str):
        self.buffer = buffer
        self.partition = partition
        self.reason = reason
        super().__init__(
            f"{pass_name}: buffer {buffer!r} cannot move into partition {partition!r}: {reason}; "
            "the program was left unchanged",
            pass_name=pass_name,
        )
