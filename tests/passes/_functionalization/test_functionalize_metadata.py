"""Metadata mutations (issue 10, pattern 5): ``resize_``, ``set_``, ``as_strided_``,
``unsqueeze_`` / ``t_`` / ``transpose_`` ... of intermediates, of views and of program
state. Each program is exported, functionalized in both forms and called 4 times in a row
(outputs, buffers and inputs after the call compared with eager); where the pass refuses,
the test shows that torch's own functionalization (``run_decompositions({})``) fails too."""

import copy

import pytest
import torch
from torch import nn

from pass_manager import PassManager, assert_same_behaviour, first_difference, run_program
from passes import InplaceToFunctional, MarkMutableBuffers, mutable_buffers

from .functionalize_checks import (
    _calls,
    functionalize_both_forms,
    refused_in_both_forms,
    targets,
)

aten = torch.ops.aten
_METADATA_OPS = {aten.resize_.default, aten.resize_as_.default, aten.set_.source_Tensor,
                 aten.as_strided_.default, aten.unsqueeze_.default, aten.t_.default,
                 aten.transpose_.default, aten.squeeze_.dim}


def _no_metadata_ops(*programs):
    for program in programs:
        assert not _METADATA_OPS & set(targets(program))


def _torch_functionalization_fails(factory, calls):
    """run_decompositions({}) raises, or its program differs from eager or fails."""
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    try:
        functional = ep.run_decompositions({})
        difference = first_difference(run_program(factory(), calls, 4),
                                      run_program(functional, calls, 4))
    except Exception as e:  # noqa: BLE001 - any failure of torch's is what is shown
        return f"{type(e).__name__}: {e}"
    assert difference is not None, "torch's functionalization handles this program"
    return difference


def _torch_functionalization_works(factory, calls):
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    assert_same_behaviour(factory(), ep.run_decompositions({}), calls, calls=4)


# -- resize_ / resize_as_ -----------------------------------------------------------------
class ResizeIntermediates(nn.Module):
    def forward(self, x):
        t = x * 2
        before = t[1:3]  # a view taken before the resize reads the same storage after it
        t.resize_(2, 2)
        t.add_(1)
        grown = torch.empty(0)
        grown.resize_(3)  # grows past its storage: a fresh value, filled before it is read
        grown.copy_(x[:3])
        u = x - 1
        u.resize_as_(x[:2])
        u.mul_(3)
        return t * 1, before * 1, grown + 1, u


def test_resize_of_intermediates():
    ep, gm = functionalize_both_forms(ResizeIntermediates, _calls((4,)))
    _no_metadata_ops(ep, gm)
    program = torch.export.export(ResizeIntermediates(), _calls((4,))[0])
    report = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).report
    statistics = report.records[-1].statistics
    assert statistics["metadata mutations as views or renames: aten.resize_.default"] == 2
    assert statistics["metadata mutations as views or renames: aten.resize_as_.default"] == 1
    _torch_functionalization_works(ResizeIntermediates, _calls((4,)))


class ResizeGrowsKeepingValues(nn.Module):
    def forward(self, x):
        kept = x * 3
        kept.add_(1)
        kept.resize_(6)  # grows: its 4 values are kept, the 2 new ones written
        kept[4:].zero_()
        return kept * 1


def test_resize_growing_a_written_intermediate_keeps_its_values():
    ep, gm = functionalize_both_forms(ResizeGrowsKeepingValues, _calls((4,)))
    _no_metadata_ops(ep, gm)
    # Beyond torch: its functionalization of this program fails when the program runs.
    _torch_functionalization_fails(ResizeGrowsKeepingValues, _calls((4,)))


class ResizeBufferToItsSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        self.b.resize_(4)
        self.b.add_(x)
        return self.b * 1


class ResizeBufferToAnotherSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        self.b.resize_(2, 2)
        return self.b + x


def test_resize_of_a_buffer_to_its_own_size_is_a_no_op():
    ep, gm = functionalize_both_forms(ResizeBufferToItsSize, _calls((4,)))
    _no_metadata_ops(ep, gm)
    _torch_functionalization_works(ResizeBufferToItsSize, _calls((4,)))


def test_resize_of_a_buffer_to_another_shape_is_refused_as_torch_fails():
    error = refused_in_both_forms(ResizeBufferToAnotherSize, _calls((2, 2)), "relayout")
    assert "from (4,) to (2, 2)" in error.reason
    _torch_functionalization_fails(ResizeBufferToAnotherSize, _calls((2, 2)))


# -- set_ --------------------------------------------------------------------------------
class SetIntermediates(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3, 4))

    def forward(self, x, y):
        t = x * 2
        early = t[0]
        t.set_(y)  # t is y from here on: writing t writes the user input y
        t.add_(1)
        row = x + 1
        row.set_(self.b[1])  # ... and writing row writes the buffer's row
        row.mul_(2).add_(x)
        window = torch.empty(0)
        # b's storage from element 8 on, restrided (run_decompositions fails on this one)
        window.set_(self.b, 8, (2, 2), (1, 2))
        window.add_(1)
        return t * 1, early * 1, row * 1, window * 1


def test_set_of_intermediates_renames_them_to_the_source():
    calls = _calls((4,), (4,))
    ep, gm = functionalize_both_forms(SetIntermediates, calls)
    _no_metadata_ops(ep, gm)
    assert aten.set_.source_Tensor_storage_offset not in targets(ep)
    # The buffer written through the renamed tensor is found (and so reset) as mutable.
    marked = MarkMutableBuffers().call(torch.export.export(SetIntermediates(), calls[0]))
    assert {"b", "y"} <= set(mutable_buffers(marked.program))


class SetThenRestride(nn.Module):
    """A tensor set_ to the buffer shares its storage, not its identity: unsqueezing it
    leaves the buffer's shape alone."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        t = x * 2
        t.set_(self.b)
        t.unsqueeze_(0)
        t.add_(x)
        return t * 1, self.b * 1


def test_set_then_a_metadata_mutation_changes_only_the_renamed_tensor():
    ep, gm = functionalize_both_forms(SetThenRestride, _calls((3,)))
    _no_metadata_ops(ep, gm)


class SetBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        self.b.set_(x * 2)
        return self.b + 1


def test_set_of_a_buffer_is_refused_as_torch_fails():
    error = refused_in_both_forms(SetBuffer, _calls((4,)), "relayout")
    assert "set_" in error.reason
    assert "set_ on a graph input" in _torch_functionalization_fails(SetBuffer, _calls((4,)))


# -- as_strided_ and the view-like metadata mutations ---------------------------------------
class RestrideIntermediates(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))

    def forward(self, x):
        t = x * 2
        t.as_strided_((2, 2), (1, 2))
        t.add_(1)
        v = self.b[1]  # a view of the buffer restrided in place: the write reaches b
        v.unsqueeze_(0)
        v.add_(x[:3])
        w = x + 1
        row = w[0:2]  # read after w is transposed in place and written
        w = w.reshape(2, 2)
        w.t_()
        w[0].mul_(3)
        return t * 1, row * 1, w * 1, self.b * 1


def test_as_strided_and_view_like_metadata_mutations_of_intermediates_and_views():
    ep, gm = functionalize_both_forms(RestrideIntermediates, _calls((4,)))
    _no_metadata_ops(ep, gm)


class ViewedThenTransposedInPlace(nn.Module):  # refused before metadata mutations were views
    def forward(self, x):
        t = x * 2
        row = t[0]
        t.t_()
        t.add_(1)
        return row * 1, t


def test_a_tensor_read_through_views_taken_before_its_transpose_():
    ep, gm = functionalize_both_forms(ViewedThenTransposedInPlace, _calls((2, 3)))
    _no_metadata_ops(ep, gm)


# -- program state whose strides, not shape, change in place -------------------------------
class TransposeSquareInput(nn.Module):
    def forward(self, x):
        x.transpose_(0, 1)
        x[0].add_(1)
        return x * 2


class TransposeSquareBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(9.0).reshape(3, 3))

    def forward(self, x):
        self.b.t_()
        self.b[:, 0].mul_(x)
        return self.b.sum(0)


def test_transposing_square_state_writes_back_its_logical_value_as_torch_does():
    for factory in (TransposeSquareInput, TransposeSquareBuffer):
        calls = _calls((3, 3) if factory is TransposeSquareInput else (3,))
        ep, gm = functionalize_both_forms(factory, calls)
        _no_metadata_ops(ep, gm)
    _torch_functionalization_works(TransposeSquareInput, _calls((3, 3)))


# -- program state whose shape changes: refused where torch fails ---------------------------
class UnsqueezeBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        self.b.unsqueeze_(0)
        self.b.add_(x)
        return self.b * 1


class TransposeInput(nn.Module):
    def forward(self, x):
        x.transpose_(0, 1)
        x.add_(1)
        return x * 1


class AsStridedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        self.b.as_strided_((2, 2), (1, 2))
        self.b.add_(x)
        return self.b * 1


@pytest.mark.parametrize("factory, shape", [(UnsqueezeBuffer, (3,)), (TransposeInput, (2, 3)),
                                            (AsStridedBuffer, (2, 2))])
def test_shape_change_of_state_is_refused_as_torch_fails(factory, shape):
    error = refused_in_both_forms(factory, _calls(shape), "relayout")
    assert "a mutation output only carries new values of its shape" in error.reason
    # torch's program lists the mutation with the new shape and fails when called.
    failure = _torch_functionalization_fails(factory, _calls(shape))
    assert "size" in failure or "shape" in failure


class StorageReadOfATransposedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(4.0).reshape(2, 2))

    def forward(self, x):
        s = self.b.as_strided((2,), (1,), 1) * 1  # from the 2nd call eager's storage is b.t()'s
        self.b.t_()
        self.b.add_(x)
        return s, self.b * 1


class ResizeGrowsAViewedTensor(nn.Module):
    def forward(self, x):
        t = x * 1
        v = t[:2]
        t.resize_(8)  # the grown storage stays shared with v
        t[4:].zero_()
        t[:2].add_(1)
        return v * 1, t[:4] * 1


def test_storage_reads_of_restrided_state_and_grown_viewed_storage_are_refused():
    calls = _calls((2, 2))
    error = refused_in_both_forms(StorageReadOfATransposedBuffer, calls, "storage")
    assert "whose strides a metadata mutation changes" in error.reason
    # torch's program returns a wrong value from the second call on.
    assert "call 1: output 0" in _torch_functionalization_fails(
        StorageReadOfATransposedBuffer, calls)
    error = refused_in_both_forms(ResizeGrowsAViewedTensor, _calls((4,)), "relayout")
    assert "grows the storage" in error.reason
    assert "resize a view tensor to a larger size" in _torch_functionalization_fails(
        ResizeGrowsAViewedTensor, _calls((4,)))
