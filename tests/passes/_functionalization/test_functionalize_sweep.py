"""Shapes found by sweeping the mutation cases of torch's own test suites (test_export,
test_functionalization, test_aotdispatch) where InplaceToFunctional refused a program that
``run_decompositions({})`` functionalizes correctly (issue 10). Each is exported, converted
in both forms, called 4 times and compared with eager; torch's result is checked too."""

import copy

import pytest
import torch
from torch import nn

from pass_manager import assert_same_behaviour

from .functionalize_checks import _calls, functionalize_both_forms, refused_in_both_forms, targets


def _torch_agrees(factory, calls):
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    assert_same_behaviour(factory(), ep.run_decompositions({}), calls, calls=4)


class TensorSplitPieces(nn.Module):
    """Writes through pieces of tensor_split (sections, unsorted indices whose pieces are
    empty or overlap, a negative dim) and of hsplit / vsplit / dsplit, which export keeps."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(14.0).reshape(7, 2))
        self.register_buffer("c", torch.arange(6.0))
        self.register_buffer("d", torch.arange(16.0).reshape(4, 4))
        self.register_buffer("e", torch.arange(16.0).reshape(2, 2, 4))

    def forward(self, x):
        p, q, r = torch.tensor_split(self.b, 3)  # rows 3, 2, 2
        p[1].add_(x)
        q.mul_(2)
        r[-1].copy_(p[0])
        first, empty, rest = torch.tensor_split(self.c, [4, 1])  # c[:4], c[4:1], c[1:]
        first.add_(1)
        rest.mul_(2)
        empty.add_(5)
        left, right = self.d.hsplit(2)
        _top, bottom = self.d.vsplit([1])
        left.add_(1)
        bottom[0].mul_(x.sum())
        near, far = self.e.dsplit(2)
        far.sub_(1)
        _head, tail = torch.tensor_split(self.d[0], [-1])  # negative index, 1-D row
        tail.mul_(-1)
        halves = self.c.hsplit(2)  # hsplit of a 1-D tensor splits dim 0
        halves[1].add_(10)
        return first * 1, rest * 1, right * 1, near + 0


class InputTensorSplit(nn.Module):
    def forward(self, x, y):
        a, b = torch.tensor_split(x, [-2], dim=1)
        b.add_(y)
        a[:, 0].mul_(3)
        top, bottom = x.vsplit(2)
        bottom.mul_(0.5)
        return top * 1


@pytest.mark.parametrize("factory,shapes", [
    (TensorSplitPieces, [(2,)]),
    (InputTensorSplit, [(4, 6), (4, 2)]),
])
def test_writes_through_tensor_split_and_directional_splits(factory, shapes):
    calls = _calls(*shapes)
    _torch_agrees(factory, calls)
    for program in functionalize_both_forms(factory, calls):
        # the pieces' new values are written back with slice_scatter
        assert torch.ops.aten.slice_scatter.default in targets(program)


class ReturnsTransposedState(nn.Module):
    """Returned aliases of state whose strides (not shape) change in place: the chains of
    the returned views start from the state in its own coordinates. Replayed on the state's
    logical final value, they transposed it twice: a wrong result in both forms."""

    def forward(self, c, d, x):
        v = d.view(4)  # taken before the metadata mutation
        c.t_()
        c.mul_(x)
        d.t_()
        d.add_(1)
        return c, c[0], c.diagonal(1), v, d.t()


class ReturnsTransposedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(9.0).reshape(3, 3))

    def forward(self, x):
        self.b.t_()
        self.b.mul_(x)
        return self.b[0], self.b


@pytest.mark.parametrize("factory,shapes", [
    (ReturnsTransposedState, [(3, 3), (2, 2), (3,)]),
    (ReturnsTransposedBuffer, [(3,)]),
])
def test_returned_aliases_of_state_transposed_in_place(factory, shapes):
    calls = _calls(*shapes)
    _torch_agrees(factory, calls)
    for program in functionalize_both_forms(factory, calls):
        assert torch.ops.aten.t_.default not in targets(program)


class ReturnsUnwrittenTransposedInput(nn.Module):
    def forward(self, c):
        c.t_()
        return c.view(2, 2), c


def test_returned_alias_of_an_unwritten_transposed_input():
    """torch fails here (run_decompositions asserts on the mutation count); the pass
    returns eager's values: the transposed input's logical value is written back."""
    calls = _calls((2, 2))
    ep = torch.export.export(ReturnsUnwrittenTransposedInput(), copy.deepcopy(calls[0]))
    with pytest.raises(AssertionError, match="num_mutated_inp_runtime_indices"):
        ep.run_decompositions({})
    functionalize_both_forms(ReturnsUnwrittenTransposedInput, calls)


class WritesThroughOpsReturningSelf(nn.Module):
    """Ops whose schema declares no alias but that return ``self`` when they have nothing
    to do: eager's writes through their results write the state. Read as fresh tensors,
    those writes were dropped: a wrong result (run_decompositions({}) drops them too)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0).reshape(2, 3))
        self.register_buffer("c", torch.arange(3.0))

    def forward(self, x):
        same = self.b.type_as(x)  # same dtype: self
        self.b.add_(1)  # ... so `same` sees this write
        same.mul_(x[:3])
        torch.nn.functional.dropout(self.b, 0.5, training=False).sub_(0.5)
        self.b.sum_to_size(2, 3)[1].add_(x[3:])
        torch.atleast_2d(self.c)[0, 1:].add_(x[:2])  # a view of a 1-D buffer
        other = self.c.type_as(x.double())  # another dtype: a copy, its write stays local
        other.add_(100)
        return same, other


class InputsThroughOpsReturningSelf(nn.Module):
    def forward(self, a, x):
        torch.nn.functional.alpha_dropout(a, 0.2, training=False).mul_(2)
        torch.atleast_3d(a)[..., 0].add_(x)
        return a.type_as(x) * 1


@pytest.mark.parametrize("factory,shapes", [
    (WritesThroughOpsReturningSelf, [(6,)]),
    (InputsThroughOpsReturningSelf, [(2, 3), (3,)]),
])
def test_writes_through_ops_that_return_self_without_declaring_it(factory, shapes):
    calls = _calls(*shapes)
    functionalize_both_forms(factory, calls)
    if factory is WritesThroughOpsReturningSelf:
        reference = torch.export.export(factory(), copy.deepcopy(calls[0]))
        with pytest.raises(AssertionError, match="max abs diff"):
            assert_same_behaviour(factory(), reference.run_decompositions({}), calls, calls=4)


class FillDiagonal(nn.Module):
    """fill_diagonal_ (kept by export, no functional twin in ATen) on square, wide, tall
    (wrapping or not), 3-D and transposed/sliced views of state."""

    def __init__(self):
        super().__init__()
        self.register_buffer("wide", torch.zeros(3, 5))
        self.register_buffer("tall", torch.zeros(7, 2))
        self.register_buffer("cube", torch.zeros(3, 3, 3))

    def forward(self, x, y):
        self.wide.add_(x.sum()).fill_diagonal_(-1.0)
        self.tall.fill_diagonal_(2.0, wrap=True)
        self.cube.fill_diagonal_(9.0)
        y.t().fill_diagonal_(5.0)
        y[1:].fill_diagonal_(7.0)
        return self.wide + 0, y * 1


def test_fill_diagonal():
    """run_decompositions({}) handles the buffers but fails on the views of the input
    (it decomposes fill_diagonal_ into an as_strided view, which it cannot write through)."""
    calls = _calls((3,), (4, 3))
    ep = torch.export.export(FillDiagonal(), copy.deepcopy(calls[0]))
    with pytest.raises(RuntimeError, match="as_strided"):
        ep.run_decompositions({})
    for program in functionalize_both_forms(FillDiagonal, calls):
        assert torch.ops.aten.fill_diagonal_.default not in targets(program)


class SetBackToItself(nn.Module):
    """torch's aot_dispatch case: ``set_`` of an input to another tensor and back to an
    alias of itself taken before, so the input ends as it began (torch functionalizes it),
    here with writes while it is the other tensor (they write that one) and after."""

    def forward(self, a, x):
        other = x * 2
        a_old = torch.ops.aten.alias.default(a)
        a.set_(other)
        a.mul_(3)  # writes `other`
        a.set_(a_old)
        a[0].add_(other.sum())
        return a + other


class SetToAnotherTensor(nn.Module):
    def forward(self, a, x):
        a.set_(x * 2)
        return a + 1


def test_set_back_to_itself():
    calls = _calls((3, 3), (3, 3))
    ep = torch.export.export(SetBackToItself(), copy.deepcopy(calls[0]))
    with pytest.raises(RuntimeError, match="frozen storage"):  # torch fails on the writes
        ep.run_decompositions({})
    for program in functionalize_both_forms(SetBackToItself, calls):
        assert torch.ops.aten.set_.source_Tensor not in targets(program)
    # set_ to another tensor for good stays refused, as torch refuses it
    refused_in_both_forms(SetToAnotherTensor, calls, "relayout")
