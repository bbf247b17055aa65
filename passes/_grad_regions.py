"""Inlining the ``torch.no_grad()`` regions that write state, before functionalization.

Export wraps a region run under another grad mode in the higher-order op
``wrap_with_set_grad_enabled(enabled, body, *operands)``. Grad mode changes no value a
region computes, only what autograd records, and ``run_decompositions`` inlines these
regions too; a region whose body writes state (an EMA update, an SSM state cache written
under ``no_grad``) is inlined so its writes are functionalized like any other. Regions
that write nothing are left as they are.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from ._buffers import hop_writes

__all__ = ["InlinedRegions", "inline_grad_regions"]

_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


@dataclass
class InlinedRegions:
    """What inlining changed, for the Rewrite's undo log and commit."""

    new_nodes: list[Node] = field(default_factory=list)
    arg_changes: list[tuple[Node, tuple, dict]] = field(default_factory=list)
    dead: list[Node] = field(default_factory=list)


def _inlinable(node: Node, gm: GraphModule) -> GraphModule | None:
    """The body of a grad-mode region that writes state and can be inlined, else None."""
    if node.op != "call_function" or node.target is not _SET_GRAD:
        return None
    body = node.args[1]
    sub = getattr(gm, str(body.target), None) if isinstance(body, Node) else None
    if not isinstance(sub, GraphModule) or hop_writes(node, gm) is None:
        return None
    # Nested higher-order ops name submodules of the body: they would not resolve here.
    if any(n.op == "get_attr" for n in sub.graph.nodes):
        return None
    if len(body.users) != 1 or not all(
        u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users
    ):
        return None
    return sub


def inline_grad_regions(gm: GraphModule) -> InlinedRegions:
    """Replace each state-writing grad-mode region by its body's nodes."""
    log = InlinedRegions()
    graph = gm.graph
    for node in list(graph.nodes):
        sub = _inlinable(node, gm)
        if sub is None:
            continue
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        copied: dict[Node, Node] = dict(zip(placeholders, node.args[2:], strict=True))
        before = set(graph.nodes)
        with graph.inserting_before(node):
            results = graph.graph_copy(sub.graph, copied)
        log.new_nodes += [n for n in graph.nodes if n not in before]
        results = results if isinstance(results, (tuple, list)) else (results,)
        for item in list(node.users):
            for user in list(item.users):
                log.arg_changes.append((user, user.args, user.kwargs))
                user.args, user.kwargs = torch.fx.map_arg(
                    (user.args, user.kwargs),
                    lambda a, item=item, results=results: results[item.args[1]] if a is item else a)
        log.dead += [node.args[1], node, *node.users]
    return log
