"""A decoder shaped like Hugging Face's Llama exported for ExecuTorch, with no download.

Shared by the tests and ``benchmarks/bench_pass_cost.py`` (the pass-cost tables' decoder).

What makes real-model graphs bigger per layer than :mod:`passes.examples`' decoder, kept
here on purpose: token embedding, rotary position embedding computed from an ``inv_freq``
buffer each call (``rotate_half`` by slicing and ``cat``), grouped-query attention (fewer
K/V heads, repeated with ``expand`` + ``reshape``), a static KV cache written with
``index_copy_(2, cache_position, k)`` as ``transformers``' ``StaticCache`` does, a causal
mask built from ``cache_position``, ``scaled_dot_product_attention``, and a gated SiLU MLP.

``forward(input_ids [1, seq], cache_position [seq]) -> logits [1, seq, vocab]``, exported
the way HF exports for ExecuTorch (strict, under ``torch.no_grad()``): :func:`export_llama`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "LlamaConfig",
    "LlamaShaped",
    "export_llama",
    "llama_inputs",
    "llama_job",
    "llama_shaped",
]


class LlamaConfig:
    def __init__(
        self,
        n_layers: int = 2,
        dim: int = 64,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        hidden: int = 128,
        vocab: int = 128,
        max_seq: int = 32,
        rope_theta: float = 10000.0,
    ):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        self.n_layers, self.dim, self.n_heads, self.n_kv_heads = n_layers, dim, n_heads, n_kv_heads
        self.hidden, self.vocab, self.max_seq, self.rope_theta = hidden, vocab, max_seq, rope_theta
        self.head_dim = dim // n_heads


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Rotary(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta**exponents, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (freqs @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    if times == 1:
        return x
    b, heads, seq, head_dim = x.shape
    x = x[:, :, None, :, :].expand(b, heads, times, seq, head_dim)
    return x.reshape(b, heads * times, seq, head_dim)


class _Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        shape = (1, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, x, cos, sin, mask, cache_position):
        cfg = self.cfg
        b, seq, _ = x.shape
        q = self.q_proj(x).view(b, seq, -1, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, seq, -1, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, seq, -1, cfg.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.k_cache.index_copy_(2, cache_position, k)
        self.v_cache.index_copy_(2, cache_position, v)
        groups = cfg.n_heads // cfg.n_kv_heads
        keys, values = _repeat_kv(self.k_cache, groups), _repeat_kv(self.v_cache, groups)
        out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, seq, cfg.dim))


class _Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.dim)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.dim)
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask, cache_position):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_position)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaShaped(nn.Module):
    """``forward(input_ids, cache_position) -> logits``, updating per-layer static caches."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.rotary = _Rotary(cfg)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = _RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        position_ids = cache_position.unsqueeze(0)
        cos, sin = self.rotary(x, position_ids)
        keys = torch.arange(self.cfg.max_seq, device=x.device)
        mask = (keys[None, :] <= cache_position[:, None])[None, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache_position)
        return self.lm_head(self.norm(x))


def llama_shaped(n_layers: int = 2, seed: int = 0, **config) -> LlamaShaped:
    """A seeded Llama-shaped decoder in eval mode."""
    cfg = LlamaConfig(n_layers=n_layers, **config)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return LlamaShaped(cfg).eval()
    finally:
        torch.random.set_rng_state(generator_state)


def llama_inputs(
    cfg: LlamaConfig, steps: int, seed: int = 0, start: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(input_ids [1, 1], cache_position [1])`` tuple per decode step."""
    if start + steps > cfg.max_seq:
        raise ValueError(f"{steps} steps from {start} exceed max_seq={cfg.max_seq}")
    generator = torch.Generator().manual_seed(seed + 1)
    return [
        (torch.randint(cfg.vocab, (1, 1), generator=generator), torch.tensor([start + step]))
        for step in range(steps)
    ]


def export_llama(model: LlamaShaped, example: tuple[torch.Tensor, torch.Tensor]):
    """Export as HF exports for ExecuTorch: strict, under ``torch.no_grad()``."""
    with torch.no_grad():
        return torch.export.export(model, example, strict=True)


def llama_job(
    n_layers: int = 2, steps: int = 8, seed: int = 0
) -> tuple[LlamaShaped, tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """A main-job factory: ``python -m passes run tests.models.llama_shaped:llama_job``."""
    model = llama_shaped(n_layers, seed=seed)
    calls = llama_inputs(model.cfg, steps, seed=seed)
    return model, calls[0], calls
