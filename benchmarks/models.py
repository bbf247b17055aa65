"""Small, seeded models with mutable state, shared by tests, benchmarks and the main job.

The main one is a Llama-style decoder (RMSNorm, attention over a per-layer KV cache,
gated SiLU MLP) that decodes one position per call and writes its K/V into registered
buffers in place, either with ``index_copy_`` or with ``cache[:, :, pos] = k``
(``index_put_``). No downloads: weights come from a seeded generator.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["DecoderConfig", "KVDecoder", "decode_inputs", "decoder_job", "kv_decoder"]


class DecoderConfig:
    def __init__(
        self,
        n_layers: int = 1,
        dim: int = 32,
        n_heads: int = 2,
        hidden: int = 64,
        max_seq: int = 16,
        cache_update: str = "index_copy",
    ):
        if cache_update not in ("index_copy", "index_put"):
            raise ValueError(
                f"cache_update must be 'index_copy' or 'index_put', got {cache_update!r}"
            )
        self.n_layers, self.dim, self.n_heads = n_layers, dim, n_heads
        self.hidden, self.max_seq, self.cache_update = hidden, max_seq, cache_update
        self.head_dim = dim // n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        shape = (1, cfg.n_heads, cfg.max_seq, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        if cfg.cache_update == "index_copy":
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
        else:
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
        scores = q @ self.k_cache.transpose(2, 3) / math.sqrt(cfg.head_dim)
        visible = torch.arange(cfg.max_seq) <= input_pos.view(-1, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ self.v_cache
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, cfg.dim))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), input_pos)
        h = self.mlp_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class KVDecoder(nn.Module):
    """Decodes one position per call: ``forward(x [1, 1, dim], input_pos [1]) -> [1, 1, dim]``."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, input_pos)
        return self.out(self.norm(x))


def kv_decoder(
    n_layers: int = 1, cache_update: str = "index_copy", seed: int = 0, **config
) -> tuple[KVDecoder, tuple[torch.Tensor, torch.Tensor]]:
    """A seeded decoder and example inputs for position 0: the factory shape ``make run`` uses."""
    cfg = DecoderConfig(n_layers=n_layers, cache_update=cache_update, **config)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = KVDecoder(cfg).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    return model, decode_inputs(cfg, 1, seed=seed)[0]


def decode_inputs(
    cfg: DecoderConfig, steps: int, seed: int = 0, start: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(x, input_pos)`` tuple per decode step, positions start, start+1, ..."""
    if start + steps > cfg.max_seq:
        raise ValueError(f"{steps} steps from {start} exceed max_seq={cfg.max_seq}")
    generator = torch.Generator().manual_seed(seed + 1)
    return [
        (torch.randn(1, 1, cfg.dim, generator=generator), torch.tensor([start + step]))
        for step in range(steps)
    ]


def decoder_job(
    n_layers: int = 2, steps: int = 8, cache_update: str = "index_copy", seed: int = 0
) -> tuple[KVDecoder, tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The main job's default model: a decoder, example inputs, and one input per decode step."""
    model, example = kv_decoder(n_layers, cache_update, seed)
    return model, example, decode_inputs(model.cfg, steps, seed=seed)
