"""Grad-mode and autocast regions that write state, before functionalization.

Export wraps a region run under another grad mode in the higher-order op
``wrap_with_set_grad_enabled(enabled, body, *operands)``, and an autocast region in
``wrap_with_autocast(device, dtype, enabled, cache, body, *operands)``. Grad mode changes no
value a region computes, only what autograd records, and ``run_decompositions`` inlines these
regions too; a grad region whose body writes state (an EMA update, an SSM state cache written
under ``no_grad``) is inlined so its writes are functionalized like any other. A ``no_grad``
body reads the operands it does not write through an ``aten.detach``, so that what it
computes records no autograd history once inlined, as under ``no_grad``: a program trained
after the rewrite (QAT's ``prepare_qat_pt2e``) would otherwise write a value with a grad
history into the state, and the next call's backward would run through the previous call's
graph (``RuntimeError: Trying to backward through the graph a second time``), besides
sending gradients through the update. Autocast
changes values (it casts the inputs of matmuls and the like), so an autocast region that
writes state keeps its body, functionalized inside: the body returns the new value of each
operand it wrote, and the region is followed by a ``copy_`` of it into the operand, which
the functionalization then treats as any top-level write (``run_decompositions`` inlines the
region with its casts made explicit; the values are the same). Regions that write nothing
are left as they are.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .._analysis.aliasing import alias_map
from .._analysis.buffers import hop_operands_written, hop_writes, trailing_write_backs
from ..errors import UnsupportedMutationError

__all__ = ["InlinedRegions", "inline_grad_regions"]

_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
_BODY_INDEX = {_SET_GRAD: 1, _AUTOCAST: 4}


@dataclass
class InlinedRegions:
    """What inlining changed: the nodes it replaced (erased on the Rewrite's commit) and
    the regions it gave a functional body."""

    dead: list[Node] = field(default_factory=list)
    functionalized: list[Node] = field(default_factory=list)
    # Regions whose body's rewrite was refused: the refusal, to say why the region is.
    refused: dict[Node, UnsupportedMutationError] = field(default_factory=dict)


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


def _written_results(sub: GraphModule) -> dict[int, Node] | None:
    """The body's results that are its (written) placeholders themselves, e.g. the result of
    an in-place op on one: result index -> placeholder. None when a result is a view of a
    placeholder (its functional form would not alias the operand, and is not regenerated)."""
    aliases, _ = alias_map(sub.graph.nodes)
    results = sub.graph.output_node().args[0]
    found = {}
    for k, result in enumerate(results if isinstance(results, (tuple, list)) else ()):
        alias = aliases.get(result) if isinstance(result, Node) else None
        if alias is None or alias.root.op != "placeholder":
            continue
        if alias.chain:
            return None
        found[k] = alias.root
    return found


def _functional_body(node: Node, gm: GraphModule, rewrite_of: Callable[[GraphModule], Any],
                     log: InlinedRegions) -> tuple[GraphModule, list[int], dict[int, int]] | None:
    """A copy of a state-writing region's body, functionalized, returning after its own
    results the new value of each operand it writes; those operands' positions; and which
    results were written operands themselves (result index -> operand position). None when
    the body's writes cannot be functionalized (the region stays, and is refused: the
    body's refusal is kept in ``log.refused``)."""
    body = node.args[_BODY_INDEX[node.target]]
    sub = getattr(gm, str(body.target), None) if isinstance(body, Node) else None
    if not isinstance(sub, GraphModule) or hop_writes(node, gm) is None or len(body.users) != 1:
        return None
    if not all(u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users):
        return None
    same = _written_results(sub)
    if same is None:
        return None
    old_placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    new = copy.deepcopy(sub)
    try:
        rewrite = rewrite_of(new)
        rewrite.run()
    except UnsupportedMutationError as error:
        log.refused[node] = error
        return None
    rewrite.commit()
    backs = trailing_write_backs(new)
    placeholders = [n for n in new.graph.nodes if n.op == "placeholder"]
    output = new.graph.output_node()
    results = output.args[0]
    if not backs or any(b.args[0] not in placeholders for b in backs) or not isinstance(
            results, (tuple, list)):
        return None
    output.args = ((*results, *(b.args[1] for b in backs)),)
    positions = [placeholders.index(b.args[0]) for b in backs]
    same = {k: old_placeholders.index(p) for k, p in same.items()}
    if not set(same.values()) <= set(positions):
        return None  # a result is an operand the body does not write: not rewired here
    for back in backs:
        new.graph.erase_node(back)
    new.recompile()
    return new, positions, same


def _functionalize_region(node: Node, gm: GraphModule, log: InlinedRegions,
                          rewrite_of: Callable[[GraphModule], Any]) -> None:
    """Give a state-writing region a functional body; write its new values back after it."""
    made = _functional_body(node, gm, rewrite_of, log)
    val = node.meta.get("val")
    if made is None or not isinstance(val, (tuple, list)):
        return
    new, positions, same = made
    index = _BODY_INDEX[node.target]
    operands = node.args[index + 1:]
    written = [operands[i] for i in positions]
    if not all(isinstance(w, Node) for w in written) or len(set(written)) < len(written):
        return
    log.functionalized.append(node)
    setattr(gm, str(node.args[index].target), new)
    finals = new.graph.output_node().args[0][len(val):]
    node.meta["val"] = type(val)((*val, *(f.meta.get("val") for f in finals)))
    graph = gm.graph
    kept = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    backs = {}
    with graph.inserting_before(node.next):
        for k, (target, final) in enumerate(zip(written, finals, strict=True)):
            item = graph.call_function(operator.getitem, (node, len(val) + k))
            back = backs[positions[k]] = graph.call_function(
                torch.ops.aten.copy_.default, (target, item))
            for made_node, value in ((item, final.meta.get("val")), (back, target.meta.get("val"))):
                made_node.meta.update(kept)
                if value is not None:
                    made_node.meta["val"] = value
    # A result that was a written operand itself (an in-place op's result) is now its new
    # value, a fresh tensor: its readers read the operand, as written back, so that later
    # writes through it still reach the operand.
    for item in list(node.users):
        if item.args[1] in same:
            back = backs[same[item.args[1]]]
            for user in list(item.users):
                user.args, user.kwargs = torch.fx.map_arg(
                    (user.args, user.kwargs), lambda a, old=item, new=back: new if a is old else a)


def _read_without_grad(node: Node, gm: GraphModule, copied: dict[Node, Node]
                       ) -> dict[Node, Node]:
    """``copied`` (body placeholder -> operand) with each tensor operand the ``no_grad``
    region does not write read through an ``aten.detach`` inserted here: the inlined body
    then records no autograd history, as under ``no_grad``. Written operands keep their
    node, since the functionalization rewrites writes to it; their new value is computed
    from detached reads and from their own old value."""
    written = set(hop_operands_written(node, gm) or ())
    detached: dict[Node, Node] = {}
    result = {}
    for placeholder, operand in copied.items():
        value = operand.meta.get("val") if isinstance(operand, Node) else None
        if operand in written or not isinstance(value, torch.Tensor):
            result[placeholder] = operand
            continue
        if operand not in detached:
            made = detached[operand] = gm.graph.call_function(
                torch.ops.aten.detach.default, (operand,))
            made.meta.update({k: v for k, v in node.meta.items()
                              if k not in ("val", "tensor_meta")})
            made.meta["val"] = value.detach()
        result[placeholder] = detached[operand]
    return result


def inline_grad_regions(gm: GraphModule, rewrite_of: Callable[[GraphModule], Any],
                        candidates: list[Node] | None = None) -> InlinedRegions:
    """Replace each state-writing grad-mode region by its body's nodes; give each other
    state-writing region (autocast, or holding nested higher-order ops) a functional body.

    ``rewrite_of(body)`` is the functionalization to apply to a body: an object with
    ``run()`` (raising UnsupportedMutationError) and ``commit()`` (the caller's Rewrite).
    ``candidates``: the graph's higher-order op calls among others, in graph order (the
    scan's ``Mutations.candidates``), to look at instead of every node."""
    log = InlinedRegions()
    graph = gm.graph
    for node in list(graph.nodes if candidates is None else candidates):
        sub = _inlinable(node, gm)
        if sub is None:
            if node.op == "call_function" and node.target in _BODY_INDEX:
                _functionalize_region(node, gm, log, rewrite_of)
            continue
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        copied: dict[Node, Node] = dict(zip(placeholders, node.args[2:], strict=True))
        with graph.inserting_before(node):
            if node.args[0] is False:
                copied = _read_without_grad(node, gm, copied)
            results = graph.graph_copy(sub.graph, copied)
        results = results if isinstance(results, (tuple, list)) else (results,)
        for item in list(node.users):
            for user in list(item.users):
                user.args, user.kwargs = torch.fx.map_arg(
                    (user.args, user.kwargs),
                    lambda a, item=item, results=results: results[item.args[1]] if a is item else a)
        log.dead += [node.args[1], node, *node.users]
    return log
