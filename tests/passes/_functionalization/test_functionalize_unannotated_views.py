"""Ops whose results are views of their inputs though their schema declares no alias:
``unsafe_split`` / ``unsafe_split_with_sizes`` / ``unsafe_chunk`` (split's pieces without
autograd's view tracking) and ``broadcast_tensors`` / ``meshgrid`` / ``atleast_Nd`` of a
list (result i views input i). Read as fresh tensors, a write through a result missed its
buffer and a result read after a write to its buffer kept the old value: wrong outputs and
state in both forms (torch 2.13's ``run_decompositions({})`` is wrong on all of them too)."""

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim

from pass_manager import PassManager
from passes import MarkMutableBuffers, mutable_buffers

from .functionalize_checks import _calls, functionalize_both_forms, refused_in_both_forms_of


class UnsafeSplits(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(24.0).reshape(4, 6))

    def forward(self, x):
        top, bottom = torch.unsafe_split(self.b, 2)
        top[1].add_(x[0])  # writes b
        self.b.mul_(2)
        left, right = torch.unsafe_chunk(self.b, 2, dim=1)
        right.sub_(1)
        first, rest = torch.ops.aten.unsafe_split_with_sizes.default(self.b, [1, 3])
        rest[0].mul_(x[1])
        return top * 1, bottom * 1, left * 1, first * 1  # read after later writes


class ListElementViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(12.0).reshape(3, 4))
        self.register_buffer("row", torch.arange(4.0))
        self.register_buffer("col", torch.ones(3, 1))
        self.register_buffer("scalar", torch.tensor(2.0))

    def forward(self, x):
        same, _ = torch.broadcast_tensors(self.b, x)  # no broadcasting: b itself
        same.add_(1)
        wide_row, wide_col, _ = torch.broadcast_tensors(self.row, self.col, x)
        self.row.mul_(x[0])  # wide_row and wide_col are read after these writes
        self.col.add_(x[:, :1])
        grid_u, grid_v = torch.meshgrid(self.row, self.col[:, 0], indexing="xy")
        self.col.mul_(2)
        as_3d, row_3d = torch.atleast_3d(self.scalar, self.row)
        as_3d.mul_(x.sum())  # writes scalar
        row_3d[0, :, 0].add_(1)  # writes row
        return same * 1, wide_row + wide_col, grid_u * grid_v, self.scalar * 1


@pytest.mark.parametrize("factory", [UnsafeSplits, ListElementViews])
def test_results_of_unannotated_views_are_views(factory):
    calls = _calls((4, 6) if factory is UnsafeSplits else (3, 4))
    functionalize_both_forms(factory, calls)
    functionalize_both_forms(factory, calls, strict=True)


class WritesOnlyThroughBroadcastTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3, 4))

    def forward(self, x):
        view, _ = torch.broadcast_tensors(self.b, x)
        view.add_(x)
        return x * 1


def test_a_write_through_a_result_marks_its_buffer():
    calls = _calls((3, 4))
    ep = torch.export.export(WritesOnlyThroughBroadcastTensors(), copy.deepcopy(calls[0]))
    for program in (ep, ep.module()):
        marked = PassManager([MarkMutableBuffers()]).run(copy.deepcopy(program)).program
        assert list(mutable_buffers(marked)) == ["b"]
    functionalize_both_forms(WritesOnlyThroughBroadcastTensors, calls)


class WritesThroughSymbolicBroadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(8, 4))

    def forward(self, x):
        view, _ = torch.broadcast_tensors(self.k[: x.shape[0]], x)
        view.add_(1)
        return self.k * 1


def test_a_write_through_a_result_of_symbolic_size_is_refused():
    """Whether it broadcasts is not known on symbolic sizes (as for ``expand``)."""
    x = torch.randn(3, 4)
    ep = torch.export.export(WritesThroughSymbolicBroadcast(), (x,),
                             dynamic_shapes=({0: Dim("n", min=2, max=8)},))
    error = refused_in_both_forms_of(ep, "no-write-back")
    assert "broadcast_tensors" in error.reason


class ToDense(nn.Module):
    """``to_dense`` of a strided tensor returns ``self``, though its schema declares no
    alias (any composite op declaring none is read so when it shares storage)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(12.0).reshape(3, 4))
        self.register_buffer("c", torch.zeros(3, 4))

    def forward(self, x):
        dense = self.b.to_dense()
        self.b.mul_(2)  # dense is read after: the new value
        self.c.to_dense().add_(x)  # writes c
        return dense * 1, torch.nn.functional.linear(x, self.c)  # linear: a fresh result


def test_composite_op_returning_its_input_is_that_input():
    functionalize_both_forms(ToDense, _calls((3, 4)))


class ViewsOfAListedOperand(nn.Module):
    """``einsum`` of one operand re-indexes it without copying (a transpose, a diagonal, the
    operand itself) and ``cartesian_prod`` of one tensor returns it, though both declare no
    alias and take their tensors as a list: a write through the result writes the buffer,
    and a result read after a write to the buffer reads its new value."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(16.0).reshape(4, 4))
        self.register_buffer("c", torch.zeros(2, 4, 4))
        self.register_buffer("row", torch.arange(4.0))

    def forward(self, x):
        transposed = torch.einsum("ij->ji", self.b)
        self.b.mul_(x)  # transposed is read after: the new value
        torch.einsum("ii->i", self.b).add_(x[0])  # writes b's diagonal
        torch.einsum("bij->jib", self.c)[1].sub_(x[:2].t())  # a re-laid-out write
        diagonals = torch.einsum("bii->bi", self.c)
        self.c.add_(1)
        same = torch.cartesian_prod(self.row)
        same.mul_(x[1])  # writes row
        return transposed * 1, diagonals * 1, same * 1


def test_a_composite_view_of_a_listed_operand_is_that_operands_view():
    functionalize_both_forms(ViewsOfAListedOperand, _calls((4, 4)))


class WritesThroughAToDenseAfterAWrite(nn.Module):
    """The view an op declaring no alias returns stays a view once its input was rewritten
    (before: the rewrite failed with an untyped ``TypeError``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.zeros(3, 4))

    def forward(self, x):
        self.c.add_(1)
        self.c.to_dense().add_(x)
        dense = self.c.to_dense()
        self.c.mul_(2)
        return dense * 1


def test_a_composite_view_of_a_rewritten_input_stays_a_view():
    functionalize_both_forms(WritesThroughAToDenseAfterAWrite, _calls((3, 4)))


class WritesThroughEinsumOfATransposedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.zeros(4, 4))

    def forward(self, x):
        torch.einsum("ij->ji", self.c.t()).add_(x)
        return self.c * 1


def test_a_write_through_a_composite_view_of_a_non_contiguous_input_is_refused():
    """Its elements are placed back by their storage positions in a contiguous input only."""
    error = refused_in_both_forms_of(torch.export.export(
        WritesThroughEinsumOfATransposedBuffer(), (torch.randn(4, 4),)), "no-write-back")
    assert "einsum" in error.reason
