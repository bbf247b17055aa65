"""A model carrying its cache as an input/output pair (static-shape backends' form of state:
the program returns the cache's next value instead of writing the input), deployed as a
prefill of 4 tokens and one-token decodes passed the same cache tensor; and the threading by
hand a caller of the eager module does."""

from __future__ import annotations

import torch

from tests.models.hf import seeded
from tests.models.input_state import DIM, SEQ, input_cache_calls

__all__ = ["PairedCache", "SummedPairedCache", "paired_cache_calls", "paired_cache_methods",
           "thread_by_hand"]


class PairedCache(torch.nn.Module):
    """``new = cache.index_copy(0, pos, value(x))``; returns ``(query(x) @ new.T, new)``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.value, self.query = seeded(
            lambda: (torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)), seed)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        new = cache.index_copy(0, pos, self.value(x))
        return self.query(x) @ new.t(), new


class SummedPairedCache(PairedCache):
    """:class:`PairedCache` whose output reads the whole cache through a linear layer
    (``out(new.sum(0))``): a quantizer observes values that depend on the carried state."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.out = seeded(lambda: torch.nn.Linear(DIM, DIM), seed + 1)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        new = cache.index_copy(0, pos, self.value(x))
        return self.out(new.sum(0, keepdim=True)) + self.query(x), new


def paired_cache_calls(cache: torch.Tensor, decodes: int, seed: int
                       ) -> list[tuple[str, tuple, dict]]:
    """A prefill at positions 0-3 and ``decodes`` one-token steps, each passed ``cache``."""
    return input_cache_calls(cache, decodes, seed)


def paired_cache_methods(seed: int = 0, model: type[PairedCache] = PairedCache):
    """``(module, {"prefill": ep, "decode": ep})``, exported with one zero cache."""
    module = model(seed)
    examples = {}
    for method, args, kwargs in paired_cache_calls(torch.zeros(SEQ, DIM), 1, 0):
        examples.setdefault(method, (args, kwargs))
    with torch.no_grad():
        programs = {method: torch.export.export(module, args, kwargs)
                    for method, (args, kwargs) in examples.items()}
    return module, programs


def thread_by_hand(methods, calls, cache_argument: int = 2, output: int = 1
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Call ``methods[method](*args)`` in turn, each call given the cache the previous one
    returned (``args[cache_argument]`` replaced, the ``output``-th output taken): the
    outputs and the caches, per call. ``cache_argument`` past the arguments: no threading
    (every call given the cache it names: what a stale cache computes)."""
    outputs, caches, cache = [], [], None
    with torch.no_grad():
        for method, args, kwargs in calls:
            args = list(args)
            if cache is not None and cache_argument < len(args):
                args[cache_argument] = cache
            result = methods[method](*args, **kwargs)
            cache = result[output]
            outputs.append(result[0])
            caches.append(cache)
    return outputs, caches

