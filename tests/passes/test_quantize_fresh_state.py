"""QuantizeMutableBuffers on state a method starts afresh: a prefill writes its keys into a
new tensor of zeros and stores that as its cache (what InputsToBuffers makes of the
Hugging Face exporter's prefill). Zero lies on every grid (its zero point), so the cache is
stored as integers, and the program computes exactly what it did."""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers, QuantizeMutableBuffers, mutable_buffers
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
        fresh = (torch.zeros(1, 6, 8) if self.fill == "zeros"
                 else torch.full((1, 6, 8), 0.0) if self.fill == "full"
                 else torch.zeros_like(self.cache))
        self.cache.copy_(fresh.index_copy(1, pos, self.proj(x)))
        return (self.cache * 2).sum(1)


def _calls() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 3, 8, generator=generator), torch.arange(3) + i) for i in range(4)]


@pytest.mark.parametrize("fill", ["zeros", "full", "zeros_like"])
def test_a_cache_started_from_zeros_is_stored_as_integers_and_computes_the_same(fill):
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
