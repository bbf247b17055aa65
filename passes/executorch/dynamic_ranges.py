"""Dynamic sizes planned over the range they were exported with, not the one ExecuTorch keeps.

torch traces a dynamic size assuming it is neither 0 nor 1 (its shape environment holds
``Dim("n", min=1, max=6)`` as ``[2, 6]``, while the ``ExportedProgram``'s
``range_constraints`` keep the user's ``[1, 6]``, which ``torch.export`` checked the graph
for). ExecuTorch 1.5.1 reads the shape environment's ranges instead: ``to_edge`` rebuilds the
program's ``range_constraints`` from them (``_get_updated_range_constraints`` in
``exir/_program_utils.py``: the Edge program says ``[2, 6]``), and ``to_executorch()``'s
``ConstraintBasedSymShapeEvalPass`` plans every dynamic-size tensor at the upper bound of
its size over them (``eval_upper_bound`` in ``exir/sym_util.py``). A tensor that shrinks as
the size grows (``cache[n:]`` in ``torch.cat([self.cache[n:], x])``) is then planned for
``n = 2`` and is too small at ``n = 1``: the call fails inside the method (``Attempted to
resize a bounded tensor with a maximum capacity of 12 elements to 14 elements``, error
``0x12``) on an input within the exported range.

:func:`exported_ranges` finds the sizes whose range the lowered program narrowed, and
:class:`ExportedRangeSymShapeEval` (the ``sym_shape_eval_pass`` the runtime helpers give
``to_executorch()``) plans over the exported ranges. A program lowered elsewhere (an Edge
or ExecuTorch program manager, a ``.pte``) no longer holds the exported range (torch's
input check lets a size 0 or 1 through all the same): the runtime helpers say so when its
call fails on such a size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import sympy
import torch
from executorch.exir.pass_base import PassResult
from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils._sympy.value_ranges import ValueRanges

__all__ = ["TRACED_MINIMUM", "ExportedRangeSymShapeEval", "exported_ranges"]

# The smallest size torch traces a backed dynamic size for: 0 and 1 are specialized.
TRACED_MINIMUM = 2


def _user_sizes(program: ExportedProgram) -> list[list[object]]:
    """The sizes of ``program``'s user inputs (a dimension: an int or a SymInt), in order."""
    placeholders = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
    sizes = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        value = placeholders[spec.arg.name].meta.get("val")
        sizes.append(list(value.shape) if isinstance(value, torch.Tensor) else [])
    return sizes


def _symbol(size: object) -> sympy.Symbol | None:
    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
        return size.node.expr
    return None


def exported_ranges(source: ExportedProgram, lowered: ExportedProgram
                    ) -> dict[sympy.Symbol, ValueRanges]:
    """``{symbol of lowered: range}`` for each dynamic size of ``lowered``'s user inputs whose
    range ``lowered`` holds narrower than ``source``, the program it was lowered from, was
    exported with: that exported range (matched input by input, dimension by dimension)."""
    found: dict[sympy.Symbol, ValueRanges] = {}
    before, after = _user_sizes(source), _user_sizes(lowered)
    if len(before) != len(after):
        return found
    for old_sizes, new_sizes in zip(before, after, strict=True):
        if len(old_sizes) != len(new_sizes):
            continue
        for old, new in zip(old_sizes, new_sizes, strict=True):
            old_symbol, new_symbol = _symbol(old), _symbol(new)
            if old_symbol is None or new_symbol is None:
                continue
            wanted = source.range_constraints.get(old_symbol)
            held = lowered.range_constraints.get(new_symbol)
            if wanted is None or held is None:
                continue
            if wanted.lower < held.lower or wanted.upper > held.upper:
                found[new_symbol] = ValueRanges(min(wanted.lower, held.lower),
                                                max(wanted.upper, held.upper))
    return found


def _shape_envs(graph_module: torch.fx.GraphModule) -> Iterator[object]:
    """The shape environments of ``graph_module``'s (and its submodules') symbolic sizes."""
    seen = set()
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            value = node.meta.get("val")
            sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
            for size in sizes:
                if isinstance(size, torch.SymInt) and id(size.node.shape_env) not in seen:
                    seen.add(id(size.node.shape_env))
                    yield size.node.shape_env


class ExportedRangeSymShapeEval(ConstraintBasedSymShapeEvalPass):
    """ExecuTorch's ``ConstraintBasedSymShapeEvalPass`` (each dynamic-size tensor planned at
    its upper bound), evaluated over ``ranges`` (:func:`exported_ranges`) where the shape
    environment holds a narrower one; the shape environment is left as it was."""

    def __init__(self, ranges: Mapping[sympy.Symbol, ValueRanges]):
        super().__init__()
        self.ranges = dict(ranges)

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        saved = []
        try:
            for env in _shape_envs(graph_module):
                for symbol, wanted in self.ranges.items():
                    if symbol in env.var_to_range:
                        saved.append((env, symbol, env.var_to_range[symbol]))
                        env.var_to_range[symbol] = wanted
            return super().call(graph_module)
        finally:
            for env, symbol, held in reversed(saved):
                env.var_to_range[symbol] = held
