"""Partitioners: decide which nodes of an ExportedProgram go to a delegate.

A partitioner is any callable ``partitioner(ep)`` that writes a tag into
``node.meta["delegation_tag"]`` (ExecuTorch's convention) on each ``call_function``
node a backend should run; nodes sharing a tag become one delegate call. The two
built-in partitioners use torch's ``CapabilityBasedPartitioner``, which grows
partitions only as far as they stay free of dependency cycles.

Example:
    >>> OpSupportPartitioner({torch.ops.aten.index_copy.default})(ep)
    {'delegate_0': [index_copy, index_copy_1]}
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase, create_op_support

from .delegate_runtime import is_delegate_call, is_delegate_output

__all__ = [
    "DELEGATION_TAG",
    "AllNodePartitioner",
    "OpSupportPartitioner",
    "Partitioner",
    "getitems_follow_their_source",
    "tagged_partitions",
]

DELEGATION_TAG = "delegation_tag"

Partitioner = Callable[[ExportedProgram], Any]
NodePredicate = Callable[[torch.fx.Node], bool]


def tagged_partitions(ep: ExportedProgram) -> dict[str, list[torch.fx.Node]]:
    """The tagged ``call_function`` nodes of ``ep`` grouped by tag, in graph order."""
    partitions: dict[str, list[torch.fx.Node]] = {}
    for node in ep.graph.nodes:
        tag = node.meta.get(DELEGATION_TAG)
        if tag is not None and node.op == "call_function":
            partitions.setdefault(str(tag), []).append(node)
    return partitions


def getitems_follow_their_source(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Give each ``getitem`` of a multi-output node that node's tag (none if it has none),
    whatever the partitioner gave it; returns the ``getitem`` nodes whose tag changed.

    A tuple cannot cross a partition's boundary: with a ``split`` in one partition and
    some of its ``getitem`` nodes in another, lowering the first takes them along and the
    second then refers to nodes no longer in the graph (``to_delegate``; ExecuTorch:
    ``Tried to erase Node getitem``), and with the ``split`` outside the partition, the
    delegate receives the list itself.
    """
    moved = []
    for node in graph.nodes:
        if not (node.op == "call_function" and node.users
                and all(user.target is operator.getitem for user in node.users)):
            continue
        tag = node.meta.get(DELEGATION_TAG)
        for item in node.users:
            if item.meta.get(DELEGATION_TAG) == tag:
                continue
            if tag is None:
                item.meta.pop(DELEGATION_TAG)
            else:
                item.meta[DELEGATION_TAG] = tag
            moved.append(item)
    return moved


def _as_predicate(supported: Any) -> NodePredicate:
    if isinstance(supported, OperatorSupportBase):
        return lambda node: supported.is_node_supported({}, node)
    if callable(supported) and not isinstance(
        supported, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    ):
        return supported
    if isinstance(supported, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        supported = [supported]
    targets = set()
    packets = set()
    for op in supported:
        (packets if isinstance(op, torch._ops.OpOverloadPacket) else targets).add(op)

    def is_supported(node: torch.fx.Node) -> bool:
        target = node.target
        if target in targets:
            return True
        return isinstance(target, torch._ops.OpOverload) and target.overloadpacket in packets

    return is_supported


class OpSupportPartitioner:
    """Tags maximal cycle-free groups of supported ``call_function`` nodes.

    Args:
        supported_ops: what the backend runs: a collection of ops (``OpOverload`` or a
            whole ``OpOverloadPacket`` such as ``torch.ops.aten.index_copy``), a
            predicate ``node -> bool``, or a torch ``OperatorSupportBase``.
        tag_prefix: tags are ``f"{tag_prefix}_{i}"``, numbered in graph order.
        allows_single_node_partition: keep partitions of a single compute node.
    """

    def __init__(
        self,
        supported_ops: Iterable[Any] | NodePredicate | OperatorSupportBase,
        *,
        tag_prefix: str = "delegate",
        allows_single_node_partition: bool = True,
    ):
        self._is_supported = _as_predicate(supported_ops)
        self.tag_prefix = tag_prefix
        self.allows_single_node_partition = allows_single_node_partition

    def _support(self) -> OperatorSupportBase:
        def is_node_supported(_: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
            # Placeholders and the output are never delegated: state and results stay
            # described by the top-level signature. Earlier delegates stay as they are.
            if node.op != "call_function" or is_delegate_call(node) or is_delegate_output(node):
                return False
            return bool(self._is_supported(node))

        return create_op_support(is_node_supported)

    def __call__(self, ep: ExportedProgram) -> dict[str, list[torch.fx.Node]]:
        """Tag ``ep``'s nodes in place and return the partitions by tag."""
        gm = ep.graph_module
        for node in gm.graph.nodes:
            node.meta.pop(DELEGATION_TAG, None)
        partitioner = CapabilityBasedPartitioner(
            gm, self._support(), allows_single_node_partition=self.allows_single_node_partition
        )
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        partitions = sorted(
            (sorted(p.nodes, key=order.__getitem__) for p in partitioner.propose_partitions()),
            key=lambda nodes: order[nodes[0]],
        )
        for index, nodes in enumerate(partitions):
            for node in nodes:
                node.meta[DELEGATION_TAG] = f"{self.tag_prefix}_{index}"
        return tagged_partitions(ep)


class AllNodePartitioner(OpSupportPartitioner):
    """Delegates every ``call_function`` node: one partition for the whole computation."""

    def __init__(self, *, tag_prefix: str = "delegate"):
        super().__init__(lambda node: True, tag_prefix=tag_prefix)

    def __call__(self, ep: ExportedProgram) -> dict[str, list[torch.fx.Node]]:
        nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
        if any(is_delegate_call(n) or is_delegate_output(n) for n in nodes):
            # Earlier delegates stay outside: torch's partitioner keeps the rest cycle-free.
            return super().__call__(ep)
        # Every computing node in one group has only placeholders, get_attrs and the output
        # outside it, so it cannot form a cycle. Torch's partitioner would reach the same
        # group by merging node by node, with a downstream search per merge that is
        # quadratic in the graph's size.
        for node in ep.graph.nodes:
            node.meta.pop(DELEGATION_TAG, None)
        for node in nodes:
            node.meta[DELEGATION_TAG] = f"{self.tag_prefix}_0"
        return tagged_partitions(ep)
