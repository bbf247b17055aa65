"""Operators ExecuTorch's edge dialect refuses. State written through a ``diagonal()`` or
``as_strided()`` view became ``diagonal_scatter`` / ``as_strided_scatter`` (not Core ATen)
and ``to_edge`` failed with an untyped ``SpecViolationError``: the helpers now write those
positions by ``index_put``, bit for bit with eager over several calls; an operator they
cannot rewrite (``searchsorted``, a diagonal of a dynamic size) is a typed
``ExecuTorchInputError`` naming the node and its line."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.export import Dim

from passes.executorch import ExecuTorchInputError, decode_on_runtime, run_methods_on_runtime
from passes.executorch.edge_ops import as_strided_scatter_by_index, diagonal_scatter_by_index

aten = torch.ops.aten


class DiagonalState(torch.nn.Module):
    """A state matrix whose diagonal (and a strided run of it) each call writes in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.arange(12.0).view(3, 4))
        self.register_buffer("strided", torch.zeros(4, 4))

    def forward(self, x):
        self.state.diagonal().add_(x)
        torch.diagonal(self.state, 1).mul_(x)
        torch.diagonal(self.state, -1, 1, 0).copy_(x * 3)
        self.strided.as_strided((3,), (5,)).sub_(x)
        return self.state * 2, self.strided + 0


def test_state_written_through_a_diagonal_decodes_bit_for_bit():
    x = torch.tensor([1.5, -2.0, 0.25])
    steps = [(x * (i + 1),) for i in range(3)]
    ep = torch.export.export(DiagonalState(), (torch.zeros(3),))
    eager = DiagonalState()
    expected = [[t.clone() for t in eager(*step)] for step in steps]
    decoded = decode_on_runtime(ep, None, steps)
    for got, want in zip(decoded.outputs, expected, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(3, 3))

    def forward(self, x):
        torch.diagonal(self.state).mul_(x)
        return self.state + 0


class Prefill(Shared):
    def forward(self, x):
        self.state.diagonal().copy_(x)
        return self.state + 0


def test_methods_sharing_a_diagonal_state_run_bit_for_bit():
    x = torch.tensor([1.0, 2.0, 3.0])
    programs = {"prefill": torch.export.export(Prefill(), (x,)),
                "decode": torch.export.export(Shared(), (x,))}
    calls = [("prefill", (x,)), ("decode", (x * 2,)), ("decode", (x - 5,))]
    prefill, decode = Prefill(), Shared()
    expected = [prefill(x).clone()]
    decode.state.copy_(prefill.state)
    expected += [decode(x * 2).clone(), decode(x - 5).clone()]
    run = run_methods_on_runtime(programs, calls)
    assert all(torch.equal(got[0], want) for got, want in zip(run.outputs, expected,
                                                               strict=True))


def test_index_scatters_equal_the_operators_element_for_element():
    for shape in [(3, 5), (2, 3, 4), (0, 3)]:
        n = len(shape)
        for d1, d2 in itertools.permutations(range(-n, n), 2):
            if d1 % n == d2 % n:
                continue
            for offset in range(-4, 5):
                base = torch.randn(shape)
                src = torch.randn(base.diagonal(offset, d1, d2).shape)
                want = aten.diagonal_scatter.default(base, src, offset, d1, d2)
                assert torch.equal(diagonal_scatter_by_index(base, src, offset, d1, d2), want)
    base = torch.randn(4, 4)
    for size, stride, offset in [((4,), (5,), 0), ((2, 3), (1, 2), 3)]:
        src = torch.randn(size)
        assert torch.equal(as_strided_scatter_by_index(base, src, size, stride, offset),
                           aten.as_strided_scatter.default(base, src, size, stride, offset))
    # Positions addressed twice have no one value: the operator is kept.
    assert as_strided_scatter_by_index(base, torch.ones(2, 2), (2, 2), (1, 1), 0) \
        is NotImplemented


class Searches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(4))

    def forward(self, edges, x):
        self.count.add_(1)
        return torch.searchsorted(edges, x) + self.count


class CarriedDiagonal(torch.nn.Module):
    def forward(self, cache, x):
        cache.diagonal().add_(x)
        return cache.sum(0)


def test_an_operator_the_edge_dialect_refuses_is_a_typed_error_naming_the_node():
    edges, x = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.5, 2.5, 1.0, 9.0])
    ep = torch.export.export(Searches(), (edges, x))
    with pytest.raises(ExecuTorchInputError, match=r"node 'searchsorted' \(test_edge_ops"
                       r"\.py, line \d+: return torch\.searchsorted.*aten\.searchsorted"
                       r"\.Tensor.*Core ATen") as refused:
        decode_on_runtime(ep, None, [(edges, x)])
    assert refused.value.node == "searchsorted"

    # A diagonal of a dynamic size has no static positions: refused, naming the write.
    n = Dim("n", min=2, max=8)
    cache, x = torch.zeros(4, 4), torch.ones(4)
    ep = torch.export.export(CarriedDiagonal(), (cache, x),
                             dynamic_shapes=({0: n, 1: n}, {0: n}))
    with pytest.raises(ExecuTorchInputError, match=r"node 'add_' .*cache\.diagonal\(\)\."
                       r"add_\(x\).*diagonal_scatter.*write the diagonal by index"):
        decode_on_runtime(ep, None, [(cache, x)])
