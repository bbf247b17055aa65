"""Writes through unfold, real/imag and non-broadcasting expand views are written back into
their base (torch's run_decompositions({}) handles them too); overlapping or symbolic unfold
windows are refused, where torch fails as well."""

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim

from pass_manager import assert_same_behaviour
from passes import InplaceToFunctional, UnsupportedMutationError

from .functionalize_checks import (
    _calls,
    functionalize_both_forms,
    refused_in_both_forms,
    refused_in_both_forms_of,
)


class UnfoldWrites(nn.Module):
    """Windows that tile the buffer, and windows of a slice of another."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tiled", torch.arange(8.0))
        self.register_buffer("sliced", torch.zeros(3, 8))

    def forward(self, x):
        self.tiled.unfold(0, 2, 2).add_(x)
        self.sliced[1:].unfold(1, 4, 4).sub_(x[0, 0])
        return self.tiled * 1, self.sliced.sum(0)


class GappedUnfoldWrite(nn.Module):
    """Windows with gaps between them: the gaps keep their values."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gapped", torch.arange(12.0).reshape(2, 6))

    def forward(self, x):
        self.gapped.unfold(1, 2, 3).mul_(x + 1)
        return self.gapped + 0


class ComplexPartWrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(4, dtype=torch.complex64))

    def forward(self, x):
        self.state.real.add_(x)
        self.state.imag.sub_(x * 2)
        return torch.view_as_real(self.state) * 1


class ExpandWrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))

    def forward(self, x):
        self.b.expand(1, 2, 3).add_(x)
        return self.b * 1


@pytest.mark.parametrize(("factory", "shapes"), [
    (UnfoldWrites, [(4, 2)]),
    (ComplexPartWrites, [(4,)]),
    (ExpandWrites, [(1, 2, 3)]),
], ids=["unfold", "real-imag", "expand"])
def test_writes_through_views_torch_writes_back(factory, shapes):
    calls = _calls(*shapes)
    functionalize_both_forms(factory, calls)
    decomposed = torch.export.export(factory(), copy.deepcopy(calls[0])).run_decompositions({})
    assert_same_behaviour(factory(), decomposed, calls, calls=4)  # torch agrees with eager


def test_writes_through_unfold_windows_with_gaps_keep_the_gaps():
    # torch 2.13's run_decompositions({}) zeroes the gaps here; eager keeps them.
    functionalize_both_forms(GappedUnfoldWrite, _calls((2, 1, 2)))


class SymbolicUnfoldWrite(nn.Module):
    def forward(self, x):
        y = x * 1
        y.unfold(0, 2, 2).add_(1)
        return y


def test_writes_through_symbolic_unfold_windows_are_refused():
    ep = torch.export.export(SymbolicUnfoldWrite(), (torch.randn(6),),
                             dynamic_shapes=({0: Dim("n", min=4)},))
    with pytest.raises(Exception):  # noqa: B017 - torch's own failure has no one type
        copy.deepcopy(ep).run_decompositions({}).module()(torch.randn(7))
    before = ep.graph_module.code
    with pytest.raises(UnsupportedMutationError) as info:
        InplaceToFunctional().call(ep)
    assert info.value.kind == "no-write-back"
    assert "unfold" in info.value.reason and "add_" in str(info.value)
    assert ep.graph_module.code == before


class SymbolicStridedWrites(nn.Module):
    """Writes through ``as_strided`` views of symbolic size whose static strides address
    each element once for every size: proven from the shape environment, written back."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(32.0))

    def forward(self, x):
        n = x.shape[0]
        self.b.as_strided((n,), (2,), 1).add_(x)
        self.b.as_strided((2, n), (1, 2), 16).mul_(x)  # interleaved rows
        return self.b * 1


def test_writes_through_symbolic_strided_views_addressing_each_element_once_are_exact():
    calls = [(torch.randn(k),) for k in (3, 6, 2, 5)]
    functionalize_both_forms(SymbolicStridedWrites, calls,
                             dynamic_shapes=({0: Dim("n", min=2, max=6)},))


class SymbolicOverlappingStridedWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(16.0))

    def forward(self, x):
        self.b.as_strided((x.shape[0], 2), (1, 1)).add_(x.unsqueeze(1))
        return self.b * 1


def test_writes_through_a_symbolic_strided_view_addressing_elements_twice_are_refused():
    ep = torch.export.export(SymbolicOverlappingStridedWrite(), (torch.randn(4),),
                             dynamic_shapes=({0: Dim("n", min=2, max=6)},))
    error = refused_in_both_forms_of(ep, "overlap")
    assert "more than once" in error.reason


class OverlappingExpandWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(1, 3))

    def forward(self, x):
        self.b.expand(2, 3)[0].add_(x)
        return self.b * 1


def test_writes_through_a_broadcasting_expand_are_refused():
    error = refused_in_both_forms(OverlappingExpandWrite, _calls((3,)), "no-write-back")
    assert "expand" in error.reason
