"""Models deployed as several methods sharing their state: a prefill of 4 tokens and a
one-token decode, exported from one module, with the calls deployment makes.

* :func:`decoder_methods`: the main job's decoder (``passes.flow.examples.kv_decoder``),
  prefill ``x[1, 4, dim]`` at positions 0-3, decode ``x[1, 1, dim]``.
* :func:`llama_methods`: a tiny random Hugging Face Llama with a static cache
  (``tests.models.hf``), keyword inputs ``input_ids=`` / ``cache_position=``.
* :func:`cat_key_methods`: :class:`CatKeyCache`, a cache whose key is written from a ``cat``
  (Phi-3's partial rotary key) and read through a copy (HF's ``repeat_kv``).

Each returns ``(module, programs, calls)``: the eager module (keep a deep copy as the
reference before running anything: the programs share its buffer tensors), the methods
``{"prefill": ep, "decode": ep}`` exported from it (so they share one tensor per buffer)
and a call sequence ``[(method, args, kwargs), ...]``. :func:`calls_in_sequence` runs
methods or an eager module along such a sequence.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from passes.flow.examples import kv_decoder

from .hf import _tokens, llama_module

__all__ = [
    "PREFILL",
    "CatKeyCache",
    "calls_in_sequence",
    "cat_key_methods",
    "decoder_calls",
    "decoder_methods",
    "errors_per_call",
    "llama_calls",
    "llama_methods",
]

PREFILL = 4


def decoder_calls(dim: int, decodes: int, seed: int) -> list[tuple[str, tuple, dict]]:
    """A prefill of 4 positions, then ``decodes`` one-position steps after it."""
    generator = torch.Generator().manual_seed(seed)
    calls = [("prefill", (torch.randn(1, PREFILL, dim, generator=generator),
                          torch.arange(PREFILL)), {})]
    for step in range(decodes):
        calls.append(("decode", (torch.randn(1, 1, dim, generator=generator),
                                 torch.tensor([PREFILL + step])), {}))
    return calls


def _export(module: torch.nn.Module, calls: Sequence[Any], strict: bool) -> dict:
    """Each method exported from ``module`` itself (one buffer tensor per FQN for all)."""
    examples = {}
    for method, args, kwargs in calls:
        examples.setdefault(method, (args, kwargs))
    with torch.no_grad():
        return {method: torch.export.export(module, args, kwargs, strict=strict)
                for method, (args, kwargs) in examples.items()}


def decoder_methods(n_layers: int = 1, decodes: int = 4, seed: int = 10, **config):
    """The main job's decoder as prefill + decode (``config``: DecoderConfig options)."""
    module, _ = kv_decoder(n_layers, **config)
    calls = decoder_calls(module.cfg.dim, decodes, seed)
    return module, _export(module, calls, strict=False), calls


def llama_calls(decodes: int, seed: int) -> list[tuple[str, tuple, dict]]:
    prompt = {"input_ids": torch.tensor([_tokens(PREFILL, seed)]),
              "cache_position": torch.arange(PREFILL)}
    calls = [("prefill", (), prompt)]
    for step, token in enumerate(_tokens(decodes, seed + 1)):
        calls.append(("decode", (), {"input_ids": torch.tensor([[token]]),
                                     "cache_position": torch.tensor([PREFILL + step])}))
    return calls


def llama_methods(decodes: int = 3, seed: int = 100, layers: int = 2):
    """A tiny HF Llama with a static cache as prefill + decode, exported strict (as HF's
    ExecuTorch recipe exports it)."""
    module = llama_module(layers)
    calls = llama_calls(decodes, seed)
    return module, _export(module, calls, strict=True), calls


class CatKeyCache(torch.nn.Module):
    """One cache: each call writes keys built as ``cat([rotated, passed], -1)`` at its
    positions (Phi-3's partial rotary key) and reads the whole cache through an
    ``expand(...).clone().reshape(...)`` (HF's ``repeat_kv``) for its scores.
    ``QnnQuantizer`` observes the written key with a ``ConcatObserver`` and the copy with a
    ``MovingAverageMinMaxObserver``: two observer classes, one grid."""

    def __init__(self, dim: int = 8, positions: int = 8):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.rotated = torch.nn.Linear(dim, dim // 2)
        self.passed = torch.nn.Linear(dim, dim // 2)
        with torch.no_grad():
            for linear in (self.rotated, self.passed):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) / 3)
                linear.bias.zero_()
        self.register_buffer("cache", torch.zeros(positions, dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        key = torch.cat([self.rotated(x), self.passed(x)], -1)
        self.cache.index_copy_(0, positions, key)
        heads = self.cache[None].expand(2, *self.cache.shape).clone()
        return x @ heads.reshape(-1, self.cache.shape[-1]).T


def cat_key_methods(decodes: int = 3, seed: int = 10):
    """:class:`CatKeyCache` as a prefill of 4 positions and a one-position decode."""
    module = CatKeyCache()
    generator = torch.Generator().manual_seed(seed)
    calls = [("prefill", (torch.randn(PREFILL, 8, generator=generator),
                          torch.arange(PREFILL)), {})]
    for step in range(decodes):
        calls.append(("decode", (torch.randn(1, 8, generator=generator),
                                 torch.tensor([PREFILL + step])), {}))
    return module, _export(module, calls, strict=False), calls


def calls_in_sequence(methods: Any, calls: Sequence[Any]) -> list[torch.Tensor]:
    """The outputs of ``calls`` run in order, each on its method (a mapping of programs,
    each run as ``.module()`` built once) or all on one eager module; under no_grad."""
    if isinstance(methods, Mapping):
        modules = {name: program.module() if hasattr(program, "graph_signature") else program
                   for name, program in methods.items()}
    else:
        modules = None
    outputs = []
    with torch.no_grad():
        for method, args, kwargs in calls:
            module = modules[method] if modules is not None else methods
            out = module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
            outputs.append(out.clone())
    return outputs


def errors_per_call(expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
                    ) -> list[float]:
    return [float((a - b).abs().max()) for a, b in zip(expected, actual, strict=True)]
