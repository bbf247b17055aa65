"""``out=`` ops whose out tensor has another dtype than the op would return.

An ``out=`` reduction, scan or factory computes in its out tensor's dtype:
``torch.sum(x_half, 0, out=f32)`` sums in float32, ``torch.cumsum(x, 0, out=int64)`` casts
the floats before summing. Rewritten as the functional op followed by a cast of its result
(the rule for element-wise ops), each of these programs differed from eager (a sum into an
int64 buffer by 2, a float16 sum into a float32 buffer by 0.012): the functional call gets
``dtype=out.dtype`` instead. Each case: both program forms, 4 calls, outputs, buffers and
inputs equal to eager bit for bit. A reduction with no dtype argument (``var``,
``logsumexp``) into another dtype has no functional form computing like it: refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pass_manager import graph_of

from .functionalize_checks import functionalize_both_forms, refused_in_both_forms

aten = torch.ops.aten


class SumIntoInt(nn.Module):
    """A float sum into an int64 counter: eager truncates each element first."""

    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(3, dtype=torch.int64))

    def forward(self, x):
        torch.sum(x, 0, out=self.n)
        return self.n * 1


class HalfStatisticsIntoFloat(nn.Module):
    """float16 activations reduced into float32 state, and into rows of it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(8))
        self.register_buffer("stats", torch.zeros(3, 8))

    def forward(self, x):
        torch.sum(x, 0, out=self.total)
        torch.mean(x, 0, out=self.stats[0])
        torch.prod(x[:6], 0, out=self.stats[1])
        return self.total * 1, self.stats * 1


class ScanIntoInput(nn.Module):
    """A cumsum into a mutated int64 user input, then a sum into one element of it."""

    def forward(self, x, y):
        torch.cumsum(x, 0, out=y)
        torch.sum(x, 0, out=y[1:2].view(()))
        return y * 1


class LinspaceIntoHalf(nn.Module):
    """A factory with out=: eager fills the float16 buffer computing in float16."""

    def __init__(self):
        super().__init__()
        self.register_buffer("grid", torch.zeros(7, dtype=torch.float16))
        self.register_buffer("acc", torch.zeros(7, dtype=torch.float16))

    def forward(self, x):
        torch.linspace(0, 1, 7, out=self.grid)
        self.acc.add_(self.grid * x)
        return self.acc * 1


def _uniform(*shape, scale=1.0):
    return [(torch.rand(*shape, generator=torch.Generator().manual_seed(i)) * scale,)
            for i in range(4)]


def _half(*shape):
    return [(torch.randn(*shape, generator=torch.Generator().manual_seed(i)).half(),)
            for i in range(4)]


CASES = {
    "sum_into_int": (SumIntoInt, _uniform(4, 3, scale=3.0)),
    "half_statistics_into_float": (HalfStatisticsIntoFloat, _half(300, 8)),
    "scan_into_input": (ScanIntoInput, [(x, torch.zeros(5, dtype=torch.int64))
                                        for (x,) in _uniform(5, scale=2.0)]),
    "linspace_into_half": (LinspaceIntoHalf, [(x.float(),) for (x,) in _half(7)]),
}


@pytest.mark.parametrize("case", CASES)
def test_out_variant_computes_in_the_out_dtype(case):
    factory, calls = CASES[case]
    for program in functionalize_both_forms(factory, calls):
        outs = [n for n in graph_of(program).nodes if n.op == "call_function"
                and str(n.target).split(".")[-1].endswith("out")]
        assert not outs, f"{outs} left"
        with_dtype = [n for n in graph_of(program).nodes
                      if n.kwargs.get("dtype") is not None and n.target in (
                          aten.sum.dim_IntList, aten.mean.dim, aten.prod.dim_int,
                          aten.cumsum.default, aten.linspace.default)]
        assert with_dtype, "no functional call was given the out tensor's dtype"


class VarianceIntoFloat(nn.Module):
    """``var`` of float16 activations into a float32 buffer: eager computes in float32."""

    def __init__(self):
        super().__init__()
        self.register_buffer("var", torch.zeros(8))

    def forward(self, x):
        torch.var(x, 0, out=self.var)
        return self.var * 1


class LogSumExpIntoHalf(nn.Module):
    """``logsumexp`` of float32 into a float16 row: eager sums the exponentials in float16."""

    def __init__(self):
        super().__init__()
        self.register_buffer("lse", torch.zeros(2, 8, dtype=torch.float16))

    def forward(self, x):
        torch.logsumexp(x, 0, out=self.lse[1])
        return self.lse * 1


@pytest.mark.parametrize("factory, calls", [(VarianceIntoFloat, _half(300, 8)),
                                            (LogSumExpIntoHalf, _uniform(300, 8))])
def test_reduction_without_a_dtype_argument_into_another_dtype_is_refused(factory, calls):
    """A cast of the functional result differs from eager (by 4e-4 and 4e-3 on these)."""
    error = refused_in_both_forms(factory, calls, "no-variant")
    assert "copy_" in str(error) and "dtype" in str(error)


def test_reduction_into_its_own_dtype_is_rewritten():
    class SameDtype(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("v", torch.zeros(8))

        def forward(self, x):
            torch.var(x, 0, out=self.v)
            torch.logsumexp(x, 0, out=self.v[None][0])
            return self.v * 1

    functionalize_both_forms(SameDtype, _uniform(300, 8))
