"""The record of a mutable buffer's reads that ``PassQuantizer`` keeps at prepare time.

A :class:`BufferRead` names the buffer, the views and pure ops on the way (replayable on
a value) and the observer that watched it (a :class:`JoinedRead`: several reads joined);
``UnfreezeMutableBuffer`` uses the records to tell which frozen constant stands for which
read.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node, map_arg

from .aliasing import aliased_argument
from .buffers import MUTABLE_BUFFER_META

__all__ = [
    "OBSERVED_READS_META",
    "UNREPLAYABLE_READS_META",
    "BufferRead",
    "JoinedRead",
    "UnreplayableRead",
    "ViewStep",
    "record_observed_reads",
    "view_chain",
]

OBSERVED_READS_META = "mutable_buffer_observed_reads"
"""``node.meta`` key (on a mutable buffer's node) listing the :class:`BufferRead` observed."""

UNREPLAYABLE_READS_META = "mutable_buffer_unreplayable_reads"
"""``node.meta`` key (on a mutable buffer's node) listing the :class:`UnreplayableRead`
observed: values torchao may fold that no :class:`BufferRead` can replay."""


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
        views = "".join(f".{getattr(step.target, 'overloadpacket', step.target).__name__}(...)"
                        for step in self.chain)
        return f"{self.fqn}{views}"

    def replay(self, value: torch.Tensor) -> torch.Tensor:
        for step in self.chain:
            value = step.target(value, *step.args, **dict(step.kwargs))
        return value

    @property
    def buffers(self) -> tuple[str, ...]:
        return (self.fqn,)

    def evaluate(self, value_of: Callable[[str], Any]) -> Any:
        """The read's value, given each buffer's (None when the buffer has none)."""
        value = value_of(self.fqn)
        return None if value is None else self.replay(value)

    def emit(self, graph: Graph, read_buffer: Callable[[str], Node]) -> Node:
        """The nodes computing the read, inserted where ``graph`` inserts, from the
        buffer's node ``read_buffer(fqn)``; returns the last one."""
        value = read_buffer(self.fqn)
        for step in self.chain:
            value = graph.call_function(step.target, (value, *step.args), dict(step.kwargs))
        return value


@dataclass(frozen=True)
class Operand:
    """In a :class:`JoinedRead` step's arguments: the value of its ``index``-th item."""

    index: int


@dataclass
class JoinedRead:
    """A read computed from mutable buffers alone through ops joining several values
    (``torch.stack([s[0], s[0]])``, ``torch.cat([a, b.flip(0)])``), replayable as a whole:
    ``items`` in order, each a buffer's FQN (its live value) or a step
    ``target(*args, **kwargs)`` whose :class:`Operand` arguments are earlier items' values;
    the last item is the read's value. torchao folds such a value into one constant as it
    folds a chain of views."""

    items: tuple[str | ViewStep, ...]
    observer: torch.nn.Module | None = None
    consumers: frozenset[str] = frozenset()

    @property
    def buffers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i for i in self.items if isinstance(i, str)))

    @property
    def fqn(self) -> str:
        return self.buffers[0]

    @property
    def chain(self) -> tuple[ViewStep, ...]:
        return tuple(i for i in self.items if isinstance(i, ViewStep))

    def describe(self) -> str:
        step = self.items[-1]
        name = getattr(step.target, "overloadpacket", step.target).__name__
        return f"{name}(...) of {', '.join(self.buffers)}"

    def evaluate(self, value_of: Callable[[str], Any]) -> Any:
        values: list[Any] = []
        for item in self.items:
            if isinstance(item, str):
                values.append(value_of(item))
                if values[-1] is None:
                    return None
            else:
                args, kwargs = _operands((item.args, dict(item.kwargs)), values.__getitem__)
                values.append(item.target(*args, **kwargs))
        return values[-1]

    def emit(self, graph: Graph, read_buffer: Callable[[str], Node]) -> Node:
        nodes: list[Node] = []
        for item in self.items:
            if isinstance(item, str):
                nodes.append(read_buffer(item))
            else:
                args, kwargs = _operands((item.args, dict(item.kwargs)), nodes.__getitem__)
                nodes.append(graph.call_function(item.target, args, kwargs))
        return nodes[-1]


def _operands(value: Any, lookup: Callable[[int], Any]) -> Any:
    """``value`` with each :class:`Operand` replaced by ``lookup(index)``; tuples stay
    tuples (an op's list argument takes either)."""
    if isinstance(value, Operand):
        return lookup(value.index)
    if isinstance(value, (tuple, list)):
        return type(value)(_operands(v, lookup) for v in value)
    if isinstance(value, dict):
        return {k: _operands(v, lookup) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class UnreplayableRead:
    """An observed value computed from mutable buffers and constants alone, which neither
    :func:`view_chain` nor :func:`joined_read` replays (a constant index beside the
    buffer): ``source`` names its node, ``consumers`` the nodes the observer fed."""

    buffers: tuple[str, ...]
    source: str
    consumers: frozenset[str]


def view_chain(node: Node) -> tuple[Node, tuple[ViewStep, ...]] | None:
    """``(buffer node, steps)`` when ``node`` is a marked buffer seen through a chain of
    ops that each read the previous value (their argument 0) and nothing else a graph
    computes: views, a ``getitem`` of ``split`` / ``chunk`` / ``unbind``, and pure ops
    (``flip``, ``roll``, ``repeat``, ``pad``, ``sum``, ...). None otherwise.

    torchao's constant folding folds any such chain ending in a quantize into one
    constant, so each must be replayable on the buffer's live value. In-place results do
    not count: their value is not the buffer's value as it was before the op; nor do
    random ops.
    """
    steps: list[ViewStep] = []
    while isinstance(node, Node):
        if MUTABLE_BUFFER_META in node.meta and node.op in ("get_attr", "placeholder"):
            return node, tuple(reversed(steps))
        if not _reads_only_its_first_argument(node):
            return None
        args, kwargs = _hashable(node.args[1:]), _hashable(node.kwargs.items())
        steps.append(ViewStep(node.target, args, kwargs))
        node = node.args[0]
    return None


def joined_read(node: Node) -> tuple[str | ViewStep, ...] | None:
    """The items of a :class:`JoinedRead` computing ``node`` from marked buffers alone (one
    at least), through ops that neither write nor draw random numbers; None when it reads
    anything else (an input, a constant: ``index_select`` by a constant index) or another
    op."""
    order: dict[Node, int] = {}
    items: list[str | ViewStep] = []
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        current, ready = stack.pop()
        if current in order:
            continue
        if MUTABLE_BUFFER_META in current.meta and current.op in ("get_attr", "placeholder"):
            order[current] = len(items)
            items.append(current.meta[MUTABLE_BUFFER_META])
        elif not _pure_step(current):
            return None
        elif ready:
            args, kwargs = map_arg((current.args, dict(current.kwargs)),
                                   lambda n: Operand(order[n]))
            order[current] = len(items)
            items.append(ViewStep(current.target, _hashable(args), _hashable(kwargs.items())))
        else:
            stack.append((current, True))
            stack.extend((n, False) for n in reversed(current.all_input_nodes)
                         if n not in order)
    if not any(isinstance(item, str) for item in items):
        return None  # a value of no state at all (a scalar_tensor): no read
    return tuple(items)


def _pure_step(node: Node) -> bool:
    """A call that computes its value from its arguments alone: a ``getitem`` or an aten
    op that writes nothing and draws no random numbers."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and not (
        target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags)


def _reads_only_its_first_argument(node: Node) -> bool:
    """Whether ``node`` computes from its argument 0 alone (no other node), without
    writing anything or drawing random numbers: a step :func:`view_chain` can replay."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    if any(isinstance(a, Node) for a in (*node.args[1:], *node.kwargs.values())):
        return False
    if node.target is operator.getitem:
        return True
    found = aliased_argument(node)
    if found is not None:
        return found[1] is node.args[0] and not found[2]
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return not (target._schema.is_mutable
                or torch.Tag.nondeterministic_seeded in target.tags)


def _hashable(value: Any) -> Any:
    """Lists to tuples, recursively, so that a view's arguments can be hashed."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "dict_items":
        return tuple(_hashable(v) for v in value)
    return value


def record_observed_reads(model: GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
    """Note on each marked buffer's nodes which observers see it (directly or via views),
    and which nodes consume the observed value."""
    consumers: dict[tuple, set[str]] = {}
    unreplayable: dict[str, tuple[tuple[str, ...], set[str]]] = {}
    for key, observer in edge_or_node_to_obs_or_fq.items():
        if observer is None:
            continue
        source = key[0] if isinstance(key, tuple) else key
        users = {key[1].name} if isinstance(key, tuple) else {u.name for u in key.users}
        found = view_chain(source)
        if found is not None:
            root, chain = found
            consumers.setdefault((root.meta[MUTABLE_BUFFER_META], chain, observer),
                                 set()).update(users)
            continue
        items = joined_read(source)
        if items is not None:
            consumers.setdefault((None, items, observer), set()).update(users)
            continue
        buffers = _state_alone(source)
        if buffers:
            unreplayable.setdefault(source.name, (buffers, set()))[1].update(users)
    reads: dict[str, list[BufferRead | JoinedRead]] = {}
    for (fqn, chain, observer), names in consumers.items():
        read = (BufferRead(fqn, chain, observer, frozenset(names)) if fqn is not None
                else JoinedRead(chain, observer, frozenset(names)))
        reads.setdefault(read.fqn, []).append(read)
    values = [UnreplayableRead(buffers, name, frozenset(names))
              for name, (buffers, names) in unreplayable.items()]
    for node in model.graph.nodes:
        fqn = node.meta.get(MUTABLE_BUFFER_META)
        if fqn in reads:
            node.meta[OBSERVED_READS_META] = list(reads[fqn])
        mine = [value for value in values if fqn in value.buffers]
        if mine:
            node.meta[UNREPLAYABLE_READS_META] = mine


def _state_alone(node: Node) -> tuple[str, ...]:
    """The marked buffers ``node``'s value is computed from when it is computed from them
    and constants alone (no input of the call, no random op), else ``()``: a value torchao
    folds (in-place ops on constants included, such as a ``detach_`` of a fresh copy)."""
    buffers: set[str] = set()
    seen: set[Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if MUTABLE_BUFFER_META in current.meta and current.op in ("get_attr", "placeholder"):
            buffers.add(current.meta[MUTABLE_BUFFER_META])
        elif current.op == "get_attr":
            continue
        elif current.op != "call_function" or (
                isinstance(current.target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded in current.target.tags):
            return ()
        else:
            stack.extend(current.all_input_nodes)
    return tuple(sorted(buffers))
