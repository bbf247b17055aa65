"""Small modules for the exported_program_from / quantize_program tests.

* :class:`StateKinds`: every kind of state export lifts, read in an order that is not
  export's input order (a buffer first, then a parameter, then a constant).
* :class:`DecayAccumulator`: a running state updated by a compute op (``add_``), whose
  quantized read ``convert_pt2e(fold_quantize=True)`` folds into a frozen constant.
* :class:`PrefillDecoder`: a KV cache written at a dynamic number of positions (a prefill of
  several tokens, then one token per call).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "DecayAccumulator",
    "PrefillDecoder",
    "StateKinds",
    "accumulator_calls",
    "prefill_calls",
    "state_kinds_calls",
]


def _seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class StateKinds(nn.Module):
    """A persistent buffer (written), a non-persistent buffer (written), a parameter, a
    plain tensor attribute (a constant to export) and a written user input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.register_buffer("decay", torch.ones(4), persistent=False)
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        before = self.acc * 2  # the buffer is read before the parameter and the constant
        out = self.lin(x + before) * self.scale
        self.acc.add_(x)
        self.decay.mul_(0.5)
        y.add_(1.0)
        return out + self.decay, y * 1


def state_kinds_calls(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_seeded(4, seed=10 + i), _seeded(4, seed=20 + i)) for i in range(n)]


class DecayAccumulator(nn.Module):
    """``acc <- acc / 2 + proj(x)``, read before the update through ops a quantizer
    annotates; torchao does not see ``acc`` as mutable and folds its quantized read."""

    def __init__(self, dim: int = 16, seed: int = 0):
        super().__init__()
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.proj = nn.Linear(dim, dim)
            self.out = nn.Linear(dim, dim)
            initial = torch.randn(1, dim)
        finally:
            torch.random.set_rng_state(state)
        self.register_buffer("acc", initial)  # non-zero: the first call reads real state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        out = self.out(y + self.acc)
        self.acc.add_(y - 0.5 * self.acc)
        return out


def accumulator_calls(n: int, dim: int = 16, seed: int = 0) -> list[tuple[torch.Tensor]]:
    return [(_seeded(1, dim, seed=seed + i),) for i in range(n)]


class PrefillDecoder(nn.Module):
    """Attention over a KV cache written with ``index_copy_`` at ``positions`` (any count)."""

    def __init__(self, dim: int = 8, max_seq: int = 16, seed: int = 0):
        super().__init__()
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.qkv = nn.Linear(dim, 3 * dim)
        finally:
            torch.random.set_rng_state(state)
        self.register_buffer("k_cache", torch.zeros(1, max_seq, dim))
        self.register_buffer("v_cache", torch.zeros(1, max_seq, dim))
        self.max_seq = max_seq

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.k_cache.index_copy_(1, positions, k)
        self.v_cache.index_copy_(1, positions, v)
        visible = torch.arange(self.max_seq)[None, :] <= positions[:, None]
        scores = (q @ self.k_cache.transpose(1, 2)).masked_fill(~visible, float("-inf"))
        return torch.softmax(scores, dim=-1) @ self.v_cache


def prefill_calls(prefill: int = 4, decode: int = 3, dim: int = 8) -> list[tuple]:
    """A prefill of ``prefill`` positions, then ``decode`` one-position calls."""
    calls = [(_seeded(1, prefill, dim, seed=1), torch.arange(prefill))]
    calls += [(_seeded(1, 1, dim, seed=2 + i), torch.tensor([prefill + i]))
              for i in range(decode)]
    return calls
