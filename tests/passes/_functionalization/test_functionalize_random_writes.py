"""Random writes into state: exact under one seed, or refused where the layout eager draws
into makes its kernel draw other numbers than the functional form (random_writes)."""

import copy

import pytest
import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers

from .functionalize_checks import refused_in_both_forms


class RandomWrite(torch.nn.Module):
    def __init__(self, draw, view):
        super().__init__()
        self.register_buffer("b", torch.zeros(16, 16))
        self.draw, self.view = draw, view

    def forward(self, x):
        self.draw(self.view(self.b))
        return self.b + x


def _column(b):
    return b[:, 0]


def _transpose(b):
    return b.t()


def _normal(t):
    return t.normal_()


def _bernoulli(t):
    return t.bernoulli_(0.3)


def _rand_out(t):
    return torch.rand(t.shape, out=t)


def _uniform(t):
    return t.uniform_(-1, 1)


def _short_column(b):
    return b[:8, 0]  # normal_ fills fewer than 16 elements one at a time, contiguous or not


@pytest.mark.parametrize("draw, view", [
    (_normal, _column),  # eager draws one at a time, normal_functional by the vectorized fill
    (_bernoulli, _transpose),  # bernoulli.p draws into a contiguous tensor: another order
    (_rand_out, _transpose),
], ids=["normal_-column", "bernoulli_-transpose", "rand-out-transpose"])
def test_random_write_drawing_other_numbers_is_refused(draw, view):
    error = refused_in_both_forms(lambda: RandomWrite(draw, view),
                                  [(torch.randn(16, 16),)], "no-variant")
    assert "random numbers" in str(error)


@pytest.mark.parametrize("draw, view", [
    (_normal, _transpose), (_normal, _short_column), (_uniform, _column),
    (_bernoulli, _column), (_rand_out, _column),
], ids=["normal_-transpose", "normal_-short-column", "uniform_-column", "bernoulli_-column",
        "rand-out-column"])
def test_random_write_is_exact_under_one_seed(draw, view):
    x = torch.randn(16, 16)
    ep = torch.export.export(RandomWrite(draw, view), (x,))
    for program in (ep, ep.module()):
        result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            copy.deepcopy(program)).program
        functional = result.module() if program is ep else result
        eager = RandomWrite(draw, view)
        for seed in range(3):
            torch.manual_seed(seed)
            expected = eager(x)
            torch.manual_seed(seed)
            assert torch.equal(functional(x), expected)
            assert torch.equal(dict(functional.named_buffers())["b"], eager.b)


class SymbolicRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(32, 32))

    def forward(self, x):
        self.b[:x.shape[0]].normal_()
        return self.b[:x.shape[0]] + x


def test_random_write_of_symbolic_size_is_exact():
    """Contiguous rows of symbolic count: proven contiguous for every count, not refused."""
    n = torch.export.Dim("n", min=2, max=30)
    ep = torch.export.export(SymbolicRows(), (torch.randn(20, 32),), dynamic_shapes=({0: n},))
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    functional, eager = functional.module(), SymbolicRows()
    for seed, rows in enumerate((20, 5, 17)):
        x = torch.randn(rows, 32)
        torch.manual_seed(seed)
        expected = eager(x)
        torch.manual_seed(seed)
        assert torch.equal(functional(x), expected)
        assert torch.equal(dict(functional.named_buffers())["b"], eager.b)
