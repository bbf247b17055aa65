"""A model carrying its cache as an input it writes in place (the Hugging Face exporter's
form of state), deployed as a prefill of 4 tokens and a one-token decode that are passed
the same cache tensor."""

from __future__ import annotations

import torch

from tests.models.hf import seeded

__all__ = ["InputCache", "WritesItsInput", "input_cache_calls", "input_cache_methods"]

SEQ, DIM, PREFILL = 8, 6, 4


class InputCache(torch.nn.Module):
    """``cache.index_copy_(0, pos, value(x))``, then ``query(x) @ cache.T``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.value, self.query = seeded(
            lambda: (torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)), seed)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, self.value(x))
        return self.query(x) @ cache.t()


def input_cache_calls(cache: torch.Tensor, decodes: int, seed: int,
                      ) -> list[tuple[str, tuple, dict]]:
    """A prefill at positions 0-3 and ``decodes`` one-token steps, each passed ``cache``."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> torch.Tensor:
        return torch.rand(n, DIM, generator=generator) * 2 - 1

    calls = [("prefill", (tokens(PREFILL), torch.arange(PREFILL), cache), {})]
    for step in range(decodes):
        calls.append(("decode", (tokens(1), torch.tensor([PREFILL + step]), cache), {}))
    return calls


def input_cache_methods(seed: int = 0):
    """``(module, {"prefill": ep, "decode": ep})``, exported with one zero cache."""
    module = InputCache(seed)
    examples = {}
    for method, args, kwargs in input_cache_calls(torch.zeros(SEQ, DIM), 1, 0):
        examples.setdefault(method, (args, kwargs))
    with torch.no_grad():
        programs = {method: torch.export.export(module, args, kwargs)
                    for method, (args, kwargs) in examples.items()}
    return module, programs


class WritesItsInput(torch.nn.Module):
    """The smallest input-carried state: ``cache += x``, returning ``2 * cache``."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return cache * 2
