"""Static caches written by position, for calls that go past their end: a cache written at
the positions its input gives, one at the position its own counter holds, and a ring buffer
that wraps its counter into the cache (valid for any number of calls)."""

from __future__ import annotations

import torch

__all__ = ["CarriedCounter", "CountedWrites", "PositionedWrites", "ResettableCounter",
           "ReturnedCounter", "RingBuffer", "past_the_cache", "ring_buffer", "token_calls"]

ROWS, DIM = 4, 2


class PositionedWrites(torch.nn.Module):
    """Writes ``x`` at row ``pos`` (an input), ``index_copy_`` or ``index_put_``."""

    def __init__(self, index_put: bool = False):
        super().__init__()
        self.index_put = index_put
        self.proj = torch.nn.Linear(DIM, DIM)
        self.register_buffer("cache", torch.zeros(1, ROWS, DIM))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.index_put:
            self.cache[:, pos] = self.proj(x)
        else:
            self.cache.index_copy_(1, pos, self.proj(x))
        return self.cache.sum(1)


class CountedWrites(torch.nn.Module):
    """Writes ``x`` at the row its own int64 counter holds, then advances it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)
        self.register_buffer("cache", torch.zeros(1, ROWS, DIM))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(1, self.pos, self.proj(x))
        self.pos.add_(1)
        return self.cache.sum(1)


class CarriedCounter(PositionedWrites):
    """The caller carries the position: an input the model advances in place, passed to
    every call as one tensor (eager fails at call ``ROWS``)."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(1, pos, self.proj(x))
        pos.add_(1)
        return self.cache.sum(1)


class ReturnedCounter(PositionedWrites):
    """The position's next value is returned (output ``1``), for the caller to feed back:
    state carried as an input/output pair."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.index_copy_(1, pos, self.proj(x))
        return self.cache.sum(1), pos + 1


class RingBuffer(CountedWrites):
    """The counter wrapped into the cache: every call writes within it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(1, self.pos % ROWS, self.proj(x))
        self.pos.add_(1)
        return self.cache.sum(1)


def token_calls(calls: int, positioned: bool = False, seed: int = 0) -> list[tuple]:
    """One ``x [1, 1, DIM]`` per call (and its row, counting from 0, when ``positioned``)."""
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, 1, DIM, generator=generator) for _ in range(calls)]
    return [(x, torch.tensor([row])) if positioned else (x,) for row, x in enumerate(xs)]


def past_the_cache() -> tuple:
    """A factory (contract v1) whose steps write one row past the cache."""
    calls = token_calls(ROWS + 1, positioned=True)
    return PositionedWrites(), calls[0], calls


def ring_buffer() -> tuple:
    """A factory whose steps wrap around the cache twice."""
    calls = token_calls(2 * ROWS)
    return RingBuffer(), calls[0], calls


class ResettableCounter(CountedWrites):
    """``forward`` writes at its counter; ``reset`` (another method) puts the counter back to
    0 and writes no position: deployed as two methods, any number of calls is valid."""

    def forward(self, x: torch.Tensor, reset: bool = False) -> torch.Tensor:
        if reset:
            self.pos.zero_()
            return x.sum(1)
        return super().forward(x)
