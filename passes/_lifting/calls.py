"""How a lifted program is called: its input and output tree specs, its module call graph
and the ranges of its symbolic sizes.

``ep.module()`` keeps the program's call specs in the graph's pytree codegen; the module
call graph and range constraints are the program's own, which ``like`` supplies. Without
``like`` they are rebuilt as export builds them: one call-graph entry per submodule
(``_make_module_call_graph``) and each symbolic size's range as the shape environment
bounds it (``make_constraints``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.fx import GraphModule, Node
from torch.fx.graph import _PyTreeCodeGen

from ..errors import LiftError

__all__ = ["CallSpecs", "call_specs", "check_like", "module_call_graph", "range_constraints"]


@dataclass(frozen=True)
class CallSpecs:
    """The user-facing signature: pytree specs of (args, kwargs) and of the outputs."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    arg_names: list[str]


def call_specs(gm: GraphModule, placeholders: list[Node], outputs: Any) -> CallSpecs:
    """The specs the graph's pytree codegen records (``ep.module()`` keeps them), or, for a
    graph called with flat positional arguments, those of ``forward(*placeholders)``."""
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen):
        info = codegen.pytree_info
        in_spec = info.in_spec
        out_spec = info.out_spec or pytree.tree_structure(outputs)
        names = list(info.orig_args)
    else:
        in_spec = pytree.tree_structure((tuple(placeholders), {}))
        out_spec = pytree.tree_structure(outputs)
        names = [str(p.target) for p in placeholders]
    if in_spec.num_leaves != len(placeholders):
        raise LiftError(f"the graph has {len(placeholders)} inputs but its input spec "
                        f"{in_spec.num_leaves}")
    if out_spec.num_leaves != len(pytree.tree_leaves(outputs)):
        raise LiftError(f"the graph has {len(pytree.tree_leaves(outputs))} outputs but its "
                        f"output spec {out_spec.num_leaves}")
    return CallSpecs(in_spec, out_spec, names)


def check_like(specs: CallSpecs, like: ExportedProgram) -> None:
    """``like`` must be called as the graph is: its example inputs and call graph say so."""
    if like.call_spec.in_spec != specs.in_spec:
        raise LiftError(
            "the graph is not called like `like`: input spec "
            f"{specs.in_spec} vs {like.call_spec.in_spec}")


def module_call_graph(
    gm: GraphModule, specs: CallSpecs, like: ExportedProgram | None, graph: torch.fx.Graph,
    skipped: set[str],
) -> list[ModuleCallEntry]:
    """``like``'s call graph (its root signature given the graph's output spec), or export's
    for ``gm``: the root with its signature, then every submodule without one."""
    root = ModuleCallSignature(inputs=[], outputs=[], in_spec=specs.in_spec,
                               out_spec=specs.out_spec, forward_arg_names=specs.arg_names)
    if like is None:
        return [ModuleCallEntry("", root)] + [
            ModuleCallEntry(fqn, None) for fqn, _ in gm.named_modules(remove_duplicate=False)
            if fqn and fqn.split(".")[0] not in skipped]
    # A copy of each entry, the root's signature replaced by the graph's (so not copied);
    # one memo, so what two entries share stays shared.
    memo: dict[int, Any] = {}
    entries = []
    for i, entry in enumerate(like.module_call_graph):
        signature = entry.signature
        if i == 0 and entry.fqn == "" and signature is not None:
            root.forward_arg_names = copy.deepcopy(signature.forward_arg_names, memo)
            entries.append(ModuleCallEntry("", root))
        else:
            entries.append(ModuleCallEntry(entry.fqn, copy.deepcopy(signature, memo)))
    names: set[str] | None = None
    for entry in entries:
        if entry.signature is None:
            continue
        for arg in (*entry.signature.inputs, *entry.signature.outputs):
            name = getattr(arg, "name", None)
            if name and names is None:
                names = {node.name for node in graph.nodes}
            if name and name not in names:
                raise LiftError(
                    f"`like` preserves the call signature of {entry.fqn!r}, which names "
                    f"{name!r}, no longer in the graph", name)
    return entries


def _symbolic_sizes(value: Any) -> list[torch.SymInt]:
    if isinstance(value, torch.SymInt):
        return [value]
    if isinstance(value, torch.Tensor):
        return [d for d in value.shape if isinstance(d, torch.SymInt)]
    return []


def range_constraints(
    gm: GraphModule, user_inputs: list[Node], like: ExportedProgram | None, shape_env: Any,
) -> dict:
    """The ranges of the inputs' symbolic sizes: ``like``'s when it covers them (it holds
    the user's ``Dim`` bounds), else as the shape environment bounds them."""
    sizes = [s for node in user_inputs for s in _symbolic_sizes(node.meta.get("val"))]
    symbols = {sym for s in sizes for sym in s.node.expr.free_symbols}
    if like is not None and symbols <= set(like.range_constraints):
        return dict(like.range_constraints)
    constraints = dict(gm.meta.get("inline_constraints") or {})
    if not sizes:
        return constraints
    for size in sizes:
        expr = size.node.expr
        if not expr.is_number:
            constraints[expr] = shape_env.bound_sympy(expr)
    for symbol in symbols:
        constraints.setdefault(symbol, shape_env.var_to_range[symbol])
    return constraints
