"""Composite view ops (CompositeImplicitAutograd ops whose schema says ``Tensor(a)``) that
torch.export keeps in its graph: their schema says what their decomposition *may* do.
``ravel`` of a non-contiguous tensor and ``resolve_conj`` of a conjugated one return copies;
read as views, a later write to the state changed the copies too (a wrong result)."""

import copy

import torch
from torch import nn

from pass_manager import PassManager
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
