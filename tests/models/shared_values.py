"""Models whose new state value is also another output: one value written into two
buffers, a written buffer also returned, a returned value also written, and two buffers
sharing one storage; and a non-persistent cache (registered as HF and ExecuTorch register
theirs).

Each reads its buffers before writing them, so a later call's output depends on what the
earlier calls stored: comparing outputs over several calls checks the state too, even on a
runtime that does not expose it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "NonPersistentCache",
    "ReturnsNewValue",
    "ReturnsWritten",
    "ReturnsWrittenAndSum",
    "SharedStorage",
    "TiedBuffers",
    "WrittenTwice",
    "WrittenTwiceAndReturned",
    "vector_calls",
]


def vector_calls(calls: int = 4, size: int = 4, seed: int = 0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, generator=generator),) for _ in range(calls)]


class WrittenTwice(nn.Module):
    """``a.copy_(v); b.copy_(v)``: one new value stored in two buffers (``b`` non-persistent)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(4))
        self.register_buffer("b", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2 + self.a * 3 + self.b * 5
        v = x + 1
        self.a.copy_(v)
        self.b.copy_(v)
        return out


class WrittenTwiceAndReturned(nn.Module):
    """One new value stored in two buffers and returned."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(4))
        self.register_buffer("b", torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = x + self.a * 0.25 + self.b * 0.5
        v = torch.tanh(out)  # bounded: the state does not grow from call to call
        self.a.copy_(v)
        self.b.copy_(v)
        return v, out


class ReturnsWritten(nn.Module):
    """``b.add_(x); return b``: the written buffer is the output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.b.add_(x)
        return self.b


class ReturnsWrittenAndSum(nn.Module):
    """``b.add_(x); return b, x + b``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.b.add_(x)
        return self.b, x + self.b


class ReturnsNewValue(nn.Module):
    """``v = f(x, b); b.copy_(v); return v``: the returned value is the buffer's new value."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.b * 0.5 + x
        self.b.copy_(v)
        return v


class SharedStorage(nn.Module):
    """Two buffers on one storage: ``head`` is a view of ``whole``'s first half."""

    def __init__(self) -> None:
        super().__init__()
        whole = torch.arange(8.0)
        self.register_buffer("whole", whole)
        self.register_buffer("head", whole[:4])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.head.add_(x)
        return self.whole * 2


class TiedBuffers(nn.Module):
    """One tensor registered under two names: written through one, read through the other."""

    def __init__(self) -> None:
        super().__init__()
        tensor = torch.zeros(4)
        self.register_buffer("a", tensor)
        self.register_buffer("b", tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a.add_(x)
        return self.b * 2


class NonPersistentCache(nn.Module):
    """A cache registered with ``persistent=False`` beside a persistent buffer, written by a
    linear layer's output (a value a quantizer annotates) and read back."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(4, 4, generator=generator))
            self.proj.bias.copy_(torch.randn(4, generator=generator))
        self.register_buffer("cache", torch.zeros(2, 4), persistent=False)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.cache.sum(0) + self.count
        self.cache[1].copy_(self.cache[0])
        self.cache[0].copy_(self.proj(x))
        self.count.add_(1)
        return out


class ReturnsStateCopy(nn.Module):
    """``acc.add_(linear(x)); return acc.clone()``: a copy of the new state is the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(self.linear(x))
        return self.acc.clone()


class ReturnsCopies(nn.Module):
    """``y = linear(x); acc.mul_(0.5).add_(y); return y, y.clone(), x.clone(), acc.clone()``:
    copies of a computed value, of an input and of the new state, beside the value."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.linear(x)
        self.acc.mul_(0.5).add_(y)
        return y, y.clone(), x.clone(), self.acc.clone()
