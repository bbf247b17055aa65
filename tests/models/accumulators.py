"""Models that keep a running sum in a buffer.

* :class:`Accumulate`: the pass-manager tests' program (a plain running sum, then a linear
  layer and a relu the test passes rewrite; the ``exported`` / ``traced`` fixtures);
* :class:`Accumulator`: the quantization tests' and the decode-accuracy benchmark's
  stateful model (a decaying sum updated by a compute op, read through ops quantizers
  annotate), with :func:`accumulator_inputs`;
* :class:`TwoBuffers`: updates one of two buffers and reads both;
* :class:`ReadBeforeUpdate`: reads its state, then updates it in place, and returns both
  (the old value must not be read after the update, e.g. by a delegate owning the buffer).
"""

from __future__ import annotations

import torch

__all__ = ["Accumulate", "Accumulator", "DividesByItsState", "ReadBeforeUpdate", "TwoBuffers",
           "accumulator_inputs"]


class Accumulate(torch.nn.Module):
    """Keeps a running sum in a buffer; returns a function of it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.linear = torch.nn.Linear(4, 4)
        # Fixed weights: tests that depend on the sign of the linear output get one answer.
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(4, 4, generator=generator))
            self.linear.bias.copy_(torch.randn(4, generator=generator))

    def forward(self, x):
        self.acc.add_(x)
        return torch.relu(self.linear(self.acc)) * 2 + 1


class Accumulator(torch.nn.Module):
    """Keeps a decaying running sum in a buffer updated by a compute op (``add_``).

    ``forward`` reads the state before updating it, through an ``add`` and a ``mul`` that
    quantizers annotate; ``acc <- acc / 2 + y`` stays bounded (at most twice the largest
    input's projection).
    """

    def __init__(self, dim: int = 16, seed: int = 0):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.proj = torch.nn.Linear(dim, dim)
            self.out = torch.nn.Linear(dim, dim)
            initial = torch.randn(1, dim)
        finally:
            torch.random.set_rng_state(generator_state)
        # A non-zero initial state: the first call already reads (quantized) state.
        self.register_buffer("acc", initial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        out = self.out(y + self.acc)
        self.acc.add_(y - 0.5 * self.acc)
        return out


def accumulator_inputs(steps: int, dim: int = 16, seed: int = 0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, dim, generator=generator),) for _ in range(steps)]


class ReadBeforeUpdate(torch.nn.Module):
    """Reads ``state`` before adding the input to it in place; returns a function of both."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(4))

    def forward(self, x):
        old = self.state * 2
        self.state.add_(x)
        return old + self.state


class TwoBuffers(torch.nn.Module):
    """Adds the input to ``a`` in place; ``b`` is only read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.zeros(4))
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        self.a.add_(x)
        return self.a + self.b


class DividesByItsState(torch.nn.Module):
    """A state that shrinks below its 8-bit grid: quantized, it is 0, and divides."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1e-4))

    def forward(self, x):
        self.scale.mul_(0.5)
        return self.proj(x) / self.scale
