"""Main-job factories (contract v2) for tiny random Hugging Face decoders and stateful models.

Each Hugging Face model is built from a tiny seeded config (no download) and wrapped with
HF's own ExecuTorch export recipe (``transformers.integrations.executorch``,
``TorchExportableModuleWithStaticCache``), the module ``convert_and_export_with_cache``
exports strict under ``torch.no_grad()`` with ``input_ids=`` / ``cache_position=`` keyword
inputs. ``python -m passes run tests.models.hf:llama`` runs the whole flow on one.
"""

from __future__ import annotations

import torch

MAX_CACHE = 16
STEPS = 8


def seeded(build, seed: int = 0):
    """``build()`` under torch's ``seed``, the caller's random state kept."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return build()
    finally:
        torch.random.set_rng_state(state)


def _exportable(model_class, config) -> torch.nn.Module:
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model = seeded(lambda: model_class(config)).eval()
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": MAX_CACHE},
    )
    return TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_CACHE)


def _tiny(config_class, layers: int = 2, **extra):
    return config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        use_cache=True,
        **extra,
    )


def _tokens(count: int, start: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(start)
    return torch.randint(1, 64, (count,), generator=generator).tolist()


def decode_steps(count: int, start: int = 0) -> list[tuple[tuple, dict]]:
    """One-token decode calls ``((), {input_ids, cache_position})`` from position ``start``."""
    return [
        (
            (),
            {
                "input_ids": torch.tensor([[token]]),
                "cache_position": torch.tensor([start + i]),
            },
        )
        for i, token in enumerate(_tokens(count, start))
    ]


def _v2(module: torch.nn.Module, steps: int = STEPS) -> dict:
    calls = decode_steps(steps)
    return {
        "module": module,
        "example_kwargs": calls[0][1],
        "steps": calls,
        "export": "strict",
    }


def llama_module(layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _exportable(LlamaForCausalLM, _tiny(LlamaConfig, layers))


def llama() -> dict:
    return _v2(llama_module())


def qwen3() -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _v2(_exportable(Qwen3ForCausalLM, _tiny(Qwen3Config)))


def gemma3() -> dict:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # One sliding-window layer and one global layer, as Gemma 3 alternates them.
    config = _tiny(
        Gemma3TextConfig,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )
    return _v2(_exportable(Gemma3ForCausalLM, config))


def llama_prefill_then_decode(prefill: int = 4) -> dict:
    """A prefill of ``prefill`` tokens, then one-token decode steps: a dynamic token dimension."""
    from torch.export import Dim

    tokens = Dim("tokens", min=1, max=MAX_CACHE)
    prompt = {
        "input_ids": torch.tensor([_tokens(prefill, 100)]),
        "cache_position": torch.arange(prefill),
    }
    return {
        "module": llama_module(),
        "example_kwargs": prompt,
        "steps": [((), prompt), *decode_steps(STEPS - 1, start=prefill)],
        "dynamic_shapes": {"input_ids": {1: tokens}, "cache_position": {0: tokens}},
    }


def llama_prefill_and_decode_methods(prefill: int = 4, decodes: int = 3) -> dict:
    """Contract v3: the tiny Llama as two static-shape methods over one cache, a prefill of
    ``prefill`` tokens and a one-token decode, as QNN / Core ML deployments export it."""
    prompt = {
        "input_ids": torch.tensor([_tokens(prefill, 100)]),
        "cache_position": torch.arange(prefill),
    }
    decodes_ = decode_steps(decodes, start=prefill)
    return {
        "module": llama_module(),
        "methods": {
            "prefill": {"example_kwargs": prompt},
            "decode": {"example_kwargs": decodes_[0][1]},
        },
        "steps": [("prefill", (), prompt), *(("decode", (), kw) for _, kw in decodes_)],
        "export": "strict",
    }


def llama_exported_module() -> dict:
    """The module of HF's own exported program (``convert_and_export_with_cache(...).module()``)."""
    from transformers.integrations.executorch import convert_and_export_with_cache

    module = llama_module()
    calls = decode_steps(STEPS)
    program = convert_and_export_with_cache(
        module.model, calls[0][1]["input_ids"], calls[0][1]["cache_position"]
    )
    return {"module": program.module(), "example_kwargs": calls[0][1], "steps": calls}


def t5_decoder() -> dict:
    """A T5 decoder step (HF's seq2seq ExecuTorch recipe): self-attention cache written,
    cross-attention over a fixed encoder output."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.integrations.executorch import (
        Seq2SeqLMDecoderExportableModuleWithStaticCache,
    )

    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    )
    model = seeded(lambda: T5ForConditionalGeneration(config)).eval()
    module = Seq2SeqLMDecoderExportableModuleWithStaticCache(
        model, max_static_cache_length=MAX_CACHE, batch_size=1
    )
    encoded = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    steps = [
        (
            (),
            {
                "decoder_input_ids": kwargs["input_ids"],
                "encoder_hidden_states": encoded,
                "cache_position": kwargs["cache_position"],
            },
        )
        for _, kwargs in decode_steps(STEPS)
    ]
    return {"module": module, "example_kwargs": steps[0][1], "steps": steps}


class NoGradState(torch.nn.Module):
    """Keeps a running mean and a step counter, written under ``torch.no_grad()``."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = seeded(lambda: torch.nn.Linear(dim, dim))
        self.register_buffer("mean", torch.zeros(1, dim))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        with torch.no_grad():
            self.count.add_(1)
            self.mean.mul_(0.5).add_(y, alpha=0.5)
        return y - self.mean


def no_grad_state() -> dict:
    generator = torch.Generator().manual_seed(1)
    calls = [(torch.randn(1, 8, generator=generator),) for _ in range(STEPS)]
    return {"module": NoGradState(), "example_args": calls[0], "steps": calls}


class WritesItsWeight(torch.nn.Module):
    """Adapts a plain tensor attribute in place at every call: export lifts it as a
    constant, whose write neither torch's functionalization nor the passes can express."""

    def __init__(self):
        super().__init__()
        self.weight = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.mul_(0.9)
        return x * self.weight


def unsupported() -> dict:
    return {"module": WritesItsWeight(), "example_args": (torch.ones(4),)}
