"""Composite view ops (CompositeImplicitAutograd ops whose schema says ``Tensor(a)``) that
torch.export keeps in its graph: their schema says what their decomposition *may* do.
``ravel`` of a non-contiguous tensor and ``resolve_conj`` of a conjugated one return copies;
read as views, a later write to the state changed the copies too (a wrong result)."""

import copy

import pytest
import torch
from torch import nn

from pass_manager import PassManager, assert_same_behaviour
from passes import MarkMutableBuffers, mutable_buffers

from .functionalize_checks import _calls, functionalize_both_forms


class ReadsRavelCopyBeforeWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0).reshape(2, 3))

    def forward(self, x):
        flat = self.b.t().ravel()  # a copy: b.t() is not contiguous
        self.b.add_(x)
        return flat * 1, self.b.ravel() * 1  # the second one is a view


class ReadsResolvedConjugateBeforeWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.ones(3, dtype=torch.complex64))

    def forward(self, x):
        resolved = self.c.conj().resolve_conj()  # a copy: the conjugate bit is set
        self.c.mul_(torch.complex(x, x))
        return torch.view_as_real(resolved) * 1


def test_copy_made_by_ravel_keeps_the_value_before_the_write():
    calls = _calls((2, 3))
    functionalize_both_forms(ReadsRavelCopyBeforeWrite, calls)
    functionalize_both_forms(ReadsRavelCopyBeforeWrite, calls, strict=True)


def test_copy_made_by_resolve_conj_keeps_the_value_before_the_write():
    functionalize_both_forms(ReadsResolvedConjugateBeforeWrite, _calls((3,)))


class WritesRavelCopy(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0).reshape(2, 3))

    def forward(self, x):
        flat = self.b.t().ravel()
        flat.add_(x)  # writes the copy, not the buffer
        return flat * 1


def test_write_to_a_ravel_copy_is_no_buffer_mutation():
    calls = _calls((6,))
    ep = torch.export.export(WritesRavelCopy(), copy.deepcopy(calls[0]))
    for program in (ep, ep.module()):
        marked = PassManager([MarkMutableBuffers()]).run(copy.deepcopy(program)).program
        assert mutable_buffers(marked) == {}
    functionalize_both_forms(WritesRavelCopy, calls)


def _writes_through(write, shape=(3, 4), dtype=torch.float32):
    """A module whose buffer ``write(b, x)`` writes through a composite view of it."""

    class WritesThroughCompositeView(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.arange(12.0).reshape(shape).to(dtype))

        def forward(self, x):
            if dtype.is_complex:
                x = torch.complex(x, x.flip(0))
            view = write(self.b, x)
            # the buffer, and the view read back after the write
            if dtype.is_complex:
                return torch.view_as_real(self.b) * 1, torch.view_as_real(view.resolve_conj()) * 1
            return self.b * 1, view * 1

    return WritesThroughCompositeView


@pytest.mark.parametrize("write", [
    lambda b, x: b.T[1].add_(x[0, :3]),  # numpy_T
    lambda b, x: b.mT[1:3].mul_(2),
    lambda b, x: b.mH[0].add_(1),
    lambda b, x: b.adjoint().add_(x.t()),
    lambda b, x: b.H[2].sub_(x[0, :3]),  # matrix_H
    lambda b, x: b.moveaxis(0, 1)[0].add_(1),
    lambda b, x: b.ravel()[::3].add_(1),
    lambda b, x: b[0].expand_as(x[:1]).add_(x[1]),
    lambda b, x: b[0:1].broadcast_to(1, 4).mul_(3),
    lambda b, x: torch.linalg.diagonal(b, offset=1).add_(5),
    lambda b, x: (+b)[1].add_(x[1]),  # positive
    lambda b, x: b.resolve_conj()[1].add_(1),
], ids=["T", "mT", "mH", "adjoint", "H", "moveaxis", "ravel", "expand_as", "broadcast_to",
        "linalg_diagonal", "positive", "resolve_conj"])
def test_writes_through_composite_views_export_keeps(write):
    """Refused before ("no-write-back"); run_decompositions({}) functionalizes them."""
    factory = _writes_through(write)
    calls = _calls((3, 4))
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    assert_same_behaviour(factory(), ep.run_decompositions({}), calls, calls=4)
    functionalize_both_forms(factory, calls)


@pytest.mark.parametrize("write", [
    lambda b, x: b.conj().mul_(x),
    lambda b, x: b.conj()[1:].conj().mul_(x[1:]),
    lambda b, x: b.adjoint().add_(x.t()),
    lambda b, x: b.mH[2].mul_(x[0, :3]),
    lambda b, x: b.H.sub_(1j),
], ids=["conj", "conj-of-conj", "adjoint", "mH", "H"])
def test_writes_through_conjugating_views_of_complex_state(write):
    """The conjugate bit: the base gets the conjugate of what the view was written."""
    functionalize_both_forms(_writes_through(write, dtype=torch.complex64), _calls((3, 4)))


@pytest.mark.parametrize("write", [
    # each returns the conjugated view, read back after the write
    lambda b, x: (b.conj().imag.add_(x.real), b.conj())[1],
    lambda b, x: (b.mH.imag[0].mul_(x.real[:, 0]), b.mH)[1],
    lambda b, x: (b.conj().real[1:].sub_(x.imag[1:]), b.conj())[1],
], ids=["conj-imag", "mH-imag-row", "conj-real"])
def test_writes_to_a_part_of_a_conjugated_view(write):
    """``real`` / ``imag`` of a conjugated view are written back through the view's
    ``view_as_real``, which refuses the conjugate bit: refused before (``fake-failure``)
    where run_decompositions({}) is exact."""
    factory = _writes_through(write, dtype=torch.complex64)
    calls = _calls((3, 4))
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    assert_same_behaviour(factory(), ep.run_decompositions({}), calls, calls=4)
    functionalize_both_forms(factory, calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_writes_through_a_negating_view(dtype):
    """``_neg_view`` reads each element negated: its write-back is the negation (refused
    before as a view with no write-back; run_decompositions({}) is exact)."""
    factory = _writes_through(lambda b, x: torch._neg_view(b)[1:].add_(x[1:]), dtype=dtype)
    calls = _calls((3, 4))
    ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    assert_same_behaviour(factory(), ep.run_decompositions({}), calls, calls=4)
    functionalize_both_forms(factory, calls)


def test_writes_through_real_of_real_state():
    """``real`` of a real tensor is that tensor (generic code taking ``.real`` of state of
    any dtype): refused before (``fake-failure``: its write-back's ``view_as_real``
    refuses a real tensor)."""
    factory = _writes_through(lambda b, x: b.real[1:].mul_(x[1:]))
    functionalize_both_forms(factory, _calls((3, 4)))
