"""QuantizeMutableBuffers on state a method starts afresh: a prefill writes its keys into a
new tensor of zeros and stores that as its cache (what InputsToBuffers makes of the
Hugging Face exporter's prefill), or resets its cache in place (``zero_()``, ``fill_(0)``).
Zero lies on every grid (its zero point), so the cache is stored as integers, and the
program computes exactly what it did; a reset to any other value keeps it float."""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers, QuantizeMutableBuffers, mutable_buffers
from passes._analysis.grid_flow import is_zero_fill
from passes.examples import xnnpack_quantizer
from passes.quantization import quantize_program


class FreshCachePrefill(torch.nn.Module):
    def __init__(self, fill: str):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(8, 8, generator=generator) / 3)
        self.register_buffer("cache", torch.zeros(1, 6, 8), persistent=False)
        self.fill = fill

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.fill in ("zero_", "fill_"):  # a reset in place, then the new keys
            self.cache.zero_() if self.fill == "zero_" else self.cache.fill_(0)
            self.cache.index_copy_(1, pos, self.proj(x))
            return (self.cache * 2).sum(1)
        fresh = (torch.zeros(1, 6, 8) if self.fill == "zeros"
                 else torch.full((1, 6, 8), 0.0) if self.fill == "full"
                 else torch.zeros_like(self.cache))
        self.cache.copy_(fresh.index_copy(1, pos, self.proj(x)))
        return (self.cache * 2).sum(1)


def _calls() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 3, 8, generator=generator), torch.arange(3) + i) for i in range(4)]


@pytest.mark.parametrize("fill", ["zeros", "full", "zeros_like", "zero_", "fill_"])
def test_a_cache_started_from_zeros_is_stored_as_integers_and_computes_the_same(fill):
    """``zero_`` / ``fill_(0)`` too: before, their functional ``zero`` / ``fill`` was
    refused as "computed by zero.default, not data movement" and the cache stayed float."""
    calls = _calls()
    with torch.no_grad():
        ep = torch.export.export(FreshCachePrefill(fill).eval(), calls[0])
        ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
        quantized = quantize_program(ep, xnnpack_quantizer(), calls)
        stored = PassManager([QuantizeMutableBuffers(strict=True)]).run(
            copy.deepcopy(quantized)).program
    grid = mutable_buffers(stored)["cache"].grid
    assert grid is not None and grid.dtype in (torch.int8, torch.uint8)
    as_float, as_integers = copy.deepcopy(quantized).module(), copy.deepcopy(stored).module()
    for args in calls:  # several calls in a row: outputs and state, bit for bit
        with torch.no_grad():
            assert torch.equal(as_float(*args), as_integers(*args))
        assert as_integers.cache.dtype == grid.dtype
        assert torch.equal(grid.dequantize(as_integers.cache), as_float.cache)


@pytest.mark.parametrize("value, zero", [(0, True), (0.0, True), (False, True), (-0.0, False),
                                         (0.3, False)])
@pytest.mark.parametrize("op", ["fill", "full"])
def test_only_a_fill_of_positive_zero_lies_on_every_grid(op, value, zero):
    """``fill_(-0.0)`` is not the zero point's ``+0.0`` (its sign shows in what is computed
    from it), and ``fill_(0.3)`` lies on no grid chosen for the buffer: both stay float."""
    graph = torch.fx.Graph()
    cache = graph.placeholder("cache")
    fill = (graph.call_function(torch.ops.aten.fill.Scalar, (cache, value)) if op == "fill"
            else graph.call_function(torch.ops.aten.full.default, ([2], value)))
    fill.meta["val"] = torch.full((2,), float(value))
    assert is_zero_fill(fill) is zero
