"""The main job's factory for the Hugging Face exporter's tiny Llama (contract v3, programs
given): ``python -m passes run tests.models.hf_exporter_job:llama --runtime python``.

The factory hands the job HF's own prefill and decode programs (``export_for_generation``
stopped before lowering, :mod:`tests.models.hf_exporter`), the ``InputsToBuffers`` options
that make their ``StaticCache`` one resident cache (``carried``), the calls of a greedy
generation (the prefill, then decodes fed HF eager ``generate``'s tokens) in their resident
form (token inputs only), and as the fp32 reference :class:`ThreadedCache`: HF's programs
themselves, called with the cache threaded as HF threads it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.utils._pytree as pytree

from tests.models import hf_exporter

__all__ = ["ThreadedCache", "generation_steps", "llama"]

NEW_TOKENS = 8
_LEAVES = ("keys", "values", "cumulative_length")


class ThreadedCache(torch.nn.Module):
    """HF's prefill and decode programs called as HF calls them, the cache kept between calls.

    ``forward(input_ids, position_ids)`` is the prefill (from a fresh cache),
    ``forward(input_ids, position_ids, attention_mask)`` a decode of the cache the previous
    call returned. After each call the cache's leaves are copied into the buffers
    ``cache.layers.<layer>.<leaf>``, the names ``resident_cache_options`` gives them, so the
    main job compares them with the resident methods' buffers.
    """

    def __init__(self, hf: hf_exporter.HfExport):
        super().__init__()
        self.prefill = hf.prefill.module()
        self.decode = hf.decode.module()
        self._fresh = copy.deepcopy(hf.prefill_kwargs["cache"])
        self._cache: Any = None
        leaves = pytree.tree_leaves(hf.decode_kwargs["cache"])
        self.cache = torch.nn.Module()
        self.cache.layers = torch.nn.ModuleList()
        for layer in range(len(leaves) // len(_LEAVES)):
            holder = torch.nn.Module()
            for i, leaf in enumerate(_LEAVES):
                example = leaves[len(_LEAVES) * layer + i]
                holder.register_buffer(leaf, torch.zeros_like(example), persistent=False)
            self.cache.layers.append(holder)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Any = None) -> torch.Tensor:
        if attention_mask is None:
            result = self.prefill(input_ids=input_ids, position_ids=position_ids,
                                  cache=copy.deepcopy(self._fresh))
        else:
            result = self.decode(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, cache=self._cache)
        logits, self._cache = result[0], result[1]
        leaves = pytree.tree_leaves(self._cache)
        for layer, holder in enumerate(self.cache.layers):
            for i, leaf in enumerate(_LEAVES):
                getattr(holder, leaf).copy_(leaves[len(_LEAVES) * layer + i])
        return logits


def generation_steps(hf: hf_exporter.HfExport, tokens: torch.Tensor) -> list:
    """The prefill and one decode per token but the last, without the (resident) cache."""
    prefill = {k: v for k, v in hf.prefill_kwargs.items() if k != "cache"}
    steps = [("prefill", (), prefill)]
    position = prefill["input_ids"].shape[-1]
    for step, token in enumerate(tokens[:-1].tolist()):
        decode = hf_exporter.decode_kwargs(hf.decode_kwargs, token, position + step, None)
        del decode["cache"]
        steps.append(("decode", (), decode))
    return steps


def llama() -> dict[str, Any]:
    """Contract v3 with ``programs`` and ``carried``: HF's exporter's tiny Llama."""
    hf = hf_exporter.export_llama()
    return {
        "module": ThreadedCache(hf),
        "programs": {"prefill": hf.prefill, "decode": hf.decode},
        "carried": hf_exporter.resident_cache_options(hf),
        "steps": generation_steps(hf, hf_exporter.eager_generate(hf, NEW_TOKENS)),
    }
