"""A model keeping an int64 position counter it advances itself (``pos += 1``, as Hugging
Face's ``cumulative_length``), beside a float cache written at that position."""

from __future__ import annotations

import torch

__all__ = ["CountedCache", "counted_cache_calls"]


class CountedCache(torch.nn.Module):
    """Writes a projection of ``x`` into row ``pos`` of its cache, advances ``pos`` by one
    and returns a function of the cache and the counter times one (an integer ``mul``)."""

    def __init__(self, rows: int = 8, dim: int = 4, seed: int = 0):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.proj = torch.nn.Linear(dim, dim)
        finally:
            torch.random.set_rng_state(generator_state)
        self.register_buffer("pos", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(rows, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.index_copy_(0, self.pos.reshape(1), self.proj(x))
        self.pos += 1
        return self.cache.sum(0) * 2, self.pos * 1


def counted_cache_calls(steps: int, seed: int, dim: int = 4) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(1, dim, generator=generator) * 2 - 1,) for _ in range(steps)]
