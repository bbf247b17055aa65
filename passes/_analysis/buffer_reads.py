"""The record of a mutable buffer's reads that ``PassQuantizer`` keeps at prepare time.

A :class:`BufferRead` names the buffer, the pure views on the way (replayable on a
value) and the observer that watched it; ``UnfreezeMutableBuffer`` uses the records to
tell which frozen constant stands for which read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .aliasing import aliased_argument
from .buffers import MUTABLE_BUFFER_META

__all__ = ["OBSERVED_READS_META", "BufferRead", "ViewStep", "record_observed_reads", "view_chain"]

OBSERVED_READS_META = "mutable_buffer_observed_reads"
"""``node.meta`` key (on a mutable buffer's node) listing the :class:`BufferRead` observed."""


@dataclass(frozen=True)
class ViewStep:
    """One view op applied to a buffer: ``target(previous, *args, **kwargs)``."""

    target: Any
    args: tuple
    kwargs: tuple


@dataclass
class BufferRead:
    """A read of a mutable buffer: the buffer, the views on the way and, when recorded at
    prepare time, the observer that watched it and the names of the nodes consuming it."""

    fqn: str
    chain: tuple[ViewStep, ...]
    observer: torch.nn.Module | None = None
    consumers: frozenset[str] = frozenset()

    def describe(self) -> str:
        views = "".join(f".{step.target.overloadpacket.__name__}(...)" for step in self.chain)
        return f"{self.fqn}{views}"

    def replay(self, value: torch.Tensor) -> torch.Tensor:
        for step in self.chain:
            value = step.target(value, *step.args, **dict(step.kwargs))
        return value


def view_chain(node: Node) -> tuple[Node, tuple[ViewStep, ...]] | None:
    """``(buffer node, views)`` when ``node`` is a marked buffer seen through pure views.

    None otherwise. In-place results do not count: their value is not the buffer's value
    as it was before the op.
    """
    steps: list[ViewStep] = []
    while isinstance(node, Node):
        if MUTABLE_BUFFER_META in node.meta and node.op in ("get_attr", "placeholder"):
            return node, tuple(reversed(steps))
        found = aliased_argument(node)
        if found is None or found[0] != 0 or found[2]:
            return None
        if any(isinstance(a, Node) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        args, kwargs = _hashable(node.args[1:]), _hashable(node.kwargs.items())
        steps.append(ViewStep(node.target, args, kwargs))
        node = found[1]
    return None


def _hashable(value: Any) -> Any:
    """Lists to tuples, recursively, so that a view's arguments can be hashed."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "dict_items":
        return tuple(_hashable(v) for v in value)
    return value


def record_observed_reads(model: GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
    """Note on each marked buffer's nodes which observers see it (directly or via views),
    and which nodes consume the observed value."""
    consumers: dict[tuple, set[str]] = {}
    for key, observer in edge_or_node_to_obs_or_fq.items():
        if observer is None:
            continue
        source = key[0] if isinstance(key, tuple) else key
        found = view_chain(source)
        if found is None:
            continue
        root, chain = found
        users = {key[1].name} if isinstance(key, tuple) else {u.name for u in key.users}
        read = (root.meta[MUTABLE_BUFFER_META], chain, observer)
        consumers.setdefault(read, set()).update(users)
    reads: dict[str, list[BufferRead]] = {}
    for (fqn, chain, observer), names in consumers.items():
        reads.setdefault(fqn, []).append(BufferRead(fqn, chain, observer, frozenset(names)))
    for node in model.graph.nodes:
        fqn = node.meta.get(MUTABLE_BUFFER_META)
        if fqn in reads:
            node.meta[OBSERVED_READS_META] = list(reads[fqn])
