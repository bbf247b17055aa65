"""Operators ExecuTorch's edge dialect refuses: written exactly with Core ATen ops where a
rewrite keeps every value, a typed error naming the node everywhere else.

``to_edge`` verifies that every ``aten`` operator left after torch's decompositions is in
Core ATen and fails otherwise with an untyped ``SpecViolationError`` naming only the
operator. Two such operators come from functionalization rather than from the model: a
write through a ``diagonal()`` view (``state.diagonal().add_(x)``,
``torch.diagonal(state, 1).copy_(v)``) becomes ``diagonal_scatter``, a write through an
``as_strided`` view ``as_strided_scatter``. Both place ``src`` at positions of the
tensor's elements known when exporting, so :func:`exact_view_scatters` functionalizes a
program writing through such a view with a decomposition (:data:`EXACT_SCATTERS`) that
computes those flat positions with ``arange`` and writes them with one ``index_put``:
the same elements, the same values, bit for bit. A dynamic size, a non-contiguous
``as_strided_scatter`` input (whose storage order is not its logical one) or positions an
``as_strided`` view addresses twice keep the operator; :func:`to_edge_or_refuse` then
turns the ``SpecViolationError`` (for them, or for an operator such as ``searchsorted``
that has no decomposition) into :class:`~passes.executorch.ExecuTorchInputError` naming
the method, the node, its line and what to do.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from executorch.exir import EdgeProgramManager, to_edge_transform_and_lower
from torch._export.verifier import SpecViolationError
from torch.export import ExportedProgram
from torch.fx import Node

from .._analysis.node_origin import exported_name, source_line
from . import ExecuTorchInputError

__all__ = ["EXACT_SCATTERS", "exact_view_scatters", "to_edge_or_refuse"]

aten = torch.ops.aten


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return strides


def _static(sizes: Sequence[Any]) -> bool:
    return all(isinstance(size, int) for size in sizes)


def _positions(start: int, sizes: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """The flat positions ``start + sum(i_k * stride_k)`` over the index grid of ``sizes``,
    in row-major order (the order of the view's elements), computed with traceable ops."""
    positions = torch.full((), start, dtype=torch.int64)
    for size, stride in zip(sizes, strides, strict=True):
        positions = positions.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return positions.reshape(-1)


def _write_positions(input: torch.Tensor, positions: torch.Tensor,
                     src: torch.Tensor) -> torch.Tensor:
    flat = aten.index_put.default(input.reshape(-1), [positions], src.reshape(-1))
    return flat.reshape(input.shape)


def diagonal_scatter_by_index(input: torch.Tensor, src: torch.Tensor, offset: int = 0,
                              dim1: int = 0, dim2: int = 1) -> Any:
    """``aten.diagonal_scatter`` with Core ATen ops: the diagonal's elements, in the order
    ``diagonal()`` lists them, are flat positions of the row-major ``input``. Of a dynamic
    size: ``NotImplemented``, which the tracer takes as "keep the operator"."""
    shape = list(input.shape)
    if not _static(shape):
        return NotImplemented  # the tracer keeps the operator
    n = len(shape)
    d1, d2 = dim1 % n, dim2 % n
    strides = _contiguous_strides(shape)
    length = max(0, min(shape[d1] + min(offset, 0), shape[d2] - max(offset, 0)))
    start = max(offset, 0) * strides[d2] + max(-offset, 0) * strides[d1] if length else 0
    kept = [k for k in range(n) if k not in (d1, d2)]
    sizes = [shape[k] for k in kept] + [length]
    positions = _positions(start, sizes, [strides[k] for k in kept] + [strides[d1] + strides[d2]])
    return _write_positions(input, positions, src)


def as_strided_scatter_by_index(input: torch.Tensor, src: torch.Tensor, size: Sequence[int],
                                stride: Sequence[int], storage_offset: int | None = None
                                ) -> Any:
    """``aten.as_strided_scatter`` with Core ATen ops, for a contiguous ``input`` (its
    storage order is its row-major order) and a view addressing each position once; else
    ``NotImplemented`` (the operator kept)."""
    offset = input.storage_offset() if storage_offset is None else storage_offset
    if not (_static([*input.shape, *size, *stride, offset]) and input.is_contiguous()
            and _distinct(offset, size, stride)):
        return NotImplemented  # the tracer keeps the operator
    return _write_positions(input, _positions(offset - input.storage_offset(), size, stride),
                            src)


def _distinct(offset: int, size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether the view of ``size`` / ``stride`` addresses each position once (a write to
    a position addressed twice has no one value to keep)."""
    count = math.prod(size)
    if count > 1 << 16:  # too many to enumerate here: left to the operator
        return False
    seen = {offset + sum(i * s for i, s in zip(index, stride, strict=True))
            for index in itertools.product(*(range(n) for n in size))}
    return len(seen) == count


EXACT_SCATTERS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.diagonal_scatter.default: diagonal_scatter_by_index,
    aten.as_strided_scatter.default: as_strided_scatter_by_index,
}
"""Decompositions of the view scatters functionalization makes that are not in Core ATen."""

# The views whose write functionalization makes one of EXACT_SCATTERS.
_SCATTERED_VIEWS = frozenset({aten.diagonal.default, aten.linalg_diagonal.default,
                              aten.as_strided.default, *EXACT_SCATTERS})


def _writes(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def exact_view_scatters(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` functionalized with :data:`EXACT_SCATTERS` if it writes through a view whose
    write back is not Core ATen (or calls such a scatter); else ``ep`` itself. One re-trace
    (``run_decompositions``), for such programs only."""
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    scatters = {aten.diagonal_scatter.default, aten.as_strided_scatter.default}
    if not (any(n.target in scatters for n in nodes)
            or (any(n.target in _SCATTERED_VIEWS for n in nodes) and any(map(_writes, nodes)))):
        return ep
    return ep.run_decompositions(dict(EXACT_SCATTERS))


_NOT_CORE = re.compile(r"Operator torch\._ops\.(\S+?) is not in Core ATen opset")

# What functionalization makes of a write through a view, by the scatter it emits.
_WRITTEN_VIEWS = {
    "aten.diagonal_scatter.default": (
        "a write through a diagonal() view, of a dynamic size",
        "write the diagonal by index (i = torch.arange(n); state[..., i, i + offset] = "
        "value), an index_put ExecuTorch takes, or export it with static sizes"),
    "aten.as_strided_scatter.default": (
        "a write through an as_strided() view of a non-contiguous tensor, of a dynamic size "
        "or addressing a position twice",
        "write those elements by index (index_put_ / index_copy_ of the flat positions), "
        "or view a contiguous tensor"),
}


def _first_caller(ep: ExportedProgram, operator: str) -> Node | None:
    for node in ep.graph.nodes:
        if node.op == "call_function" and str(node.target) == operator:
            return node
    return None


def _refusal(helper: str, programs: Mapping[str, ExportedProgram], operator: str
             ) -> ExecuTorchInputError:
    """The error naming the method and node calling ``operator`` (found in the program
    lowered, else in its functionalized form: a view scatter functionalization made)."""
    found = None
    for method, ep in programs.items():
        node = _first_caller(ep, operator)
        if node is None:  # made by to_edge's functionalization: find it where it is made
            try:
                node = _first_caller(copy.deepcopy(ep).run_decompositions({}), operator)
            except Exception:  # noqa: BLE001  (only to name the node: the refusal stands)
                node = None
        if node is not None:
            found = (method, node)
            break
    where, name = "", None
    if found is not None:
        method, node = found
        name = exported_name(node)
        line = source_line(node)
        where = (("" if method == "forward" else f"method {method!r}: ")
                 + f"node {name!r}" + (f" ({line})" if line else "") + " ")
    if operator in _WRITTEN_VIEWS:
        made_of, advice = _WRITTEN_VIEWS[operator]
        what = f"{where}becomes {operator} when functionalized ({made_of})"
    else:
        what = f"{where}calls {operator}"
        advice = ("express that step with Core ATen ops, or lower with a partitioner whose "
                  "backend takes it (its ops_to_not_decompose) on a runtime with its kernel")
    return ExecuTorchInputError(
        helper, "program", f"{what}, an operator ExecuTorch's edge dialect refuses (not "
        f"in Core ATen: to_edge's SpecViolationError); {advice}", node=name)


def to_edge_or_refuse(helper: str, programs: ExportedProgram | Mapping[str, ExportedProgram],
                      partitioner: Sequence[Any]) -> EdgeProgramManager:
    """``to_edge_transform_and_lower(programs, partitioner=partitioner)``, its refusal of
    the program an :class:`~passes.executorch.ExecuTorchInputError` of ``helper``.

    Raises:
        ExecuTorchInputError: an operator the edge dialect refuses, naming the method, the
            node (its name in the exported program and its line) and what to do; or
            another verification failure of the edge program, quoting it.
    """
    try:
        return to_edge_transform_and_lower(programs, partitioner=list(partitioner))
    except SpecViolationError as e:
        named = {"forward": programs} if isinstance(programs, ExportedProgram) else programs
        found = _NOT_CORE.search(str(e))
        if found is not None:
            raise _refusal(helper, named, found.group(1)) from e
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise ExecuTorchInputError(
            helper, "program", f"ExecuTorch's edge dialect refuses the program ({first})"
        ) from e
