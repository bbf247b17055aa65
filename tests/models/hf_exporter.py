"""Tiny random Llama and Qwen3 put through transformers' own exporter, stopped before lowering.

Hugging Face users now reach ExecuTorch through ``transformers.exporters``::

    ExecutorchExporter().export_for_generation(
        model, {"input_ids": ..., "attention_mask": ...}, ExecutorchConfig(backend="xnnpack"),
        generation_config=GenerationConfig(cache_implementation="static", max_cache_len=N))

It runs ``generate`` once to capture a prefill and a decode call, exports each with
``torch.export`` (HF's patches applied, cache classes registered as pytrees), repairs the
programs (``apply_fx_program_fixes`` / ``apply_fx_node_fixes``) and hands each to
``to_edge_transform_and_lower``. :func:`export` runs exactly that, and takes each program at the
hand-over instead of lowering it: the ExportedPrograms this library's passes meet on HF's path.

Their state is *carried*, not resident: the ``StaticCache`` is a keyword input (``cache=``)
whose flattened leaves are user inputs. The decode mutates every layer's keys and values
(``index_copy_``) and ``cumulative_length`` counter (``add_``) in place and also returns them;
the prefill takes only the counters (mutated in place), creates the keys and values in its graph
(``zeros`` then ``index_copy_``) and returns them inside a new ``StaticCache``. HF threads that
returned cache into the next decode (:func:`thread_calls`).

Models are seeded and built from tiny configs: no download. Other architectures
(:data:`SWEEP_ARCHITECTURES`: Mistral, Phi3, Gemma 1-3, GPT-NeoX, OLMo2, Phi, Qwen2, Falcon,
Cohere2, GPT-Neo) export the
same way; :func:`cache_options` reads the cache mapping from the programs' call specs for any of
them, sliding-window layers included.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ARCHITECTURES",
    "MAX_CACHE",
    "PROMPT",
    "STATE_LAYOUTS",
    "SWEEP_ARCHITECTURES",
    "HfExport",
    "cache_options",
    "cache_paths",
    "decode_kwargs",
    "eager_generate",
    "export",
    "export_llama",
    "export_qwen3",
    "exported_cache_calls",
    "generation_config",
    "prompt_inputs",
    "resident_cache_options",
    "thread_calls",
    "tiny_model",
    "tiny_sweep_model",
]

MAX_CACHE = 16
PROMPT = 4
ARCHITECTURES = ("llama", "qwen3")


def tiny_model(architecture: str = "llama", layers: int = 2) -> torch.nn.Module:
    """A seeded random ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (hidden 16, 2 heads, one
    KV head)."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[architecture]
    config = config_class(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        use_cache=True,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return model_class(config).eval()
    finally:
        torch.random.set_rng_state(state)


def generation_config(max_cache_len: int = MAX_CACHE):
    """Greedy generation over a ``StaticCache`` of ``max_cache_len`` positions."""
    from transformers import GenerationConfig

    return GenerationConfig(cache_implementation="static", max_cache_len=max_cache_len,
                            do_sample=False, pad_token_id=0)


def prompt_inputs(length: int = PROMPT) -> dict[str, torch.Tensor]:
    """The ``generate`` keyword inputs of a fixed prompt of ``length`` tokens."""
    tokens = torch.randint(1, 64, (1, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": tokens, "attention_mask": torch.ones(1, length, dtype=torch.long)}


@dataclass
class HfExport:
    """What HF's exporter produced for one model, before ExecuTorch lowering.

    Attributes:
        model: the eager model (not mutated by the export).
        prefill: the prefill's ExportedProgram (state: counters in, caches created and returned).
        decode: the decode's ExportedProgram (state: caches and counters mutated in place).
        prefill_kwargs: the keyword inputs the prefill was exported with (``input_ids``,
            ``position_ids``, ``cache``: a fresh ``StaticCache``).
        decode_kwargs: the keyword inputs the decode was exported with (``input_ids``,
            ``attention_mask``, ``position_ids``, ``cache``: the cache after the prefill).
        generation_config: the ``GenerationConfig`` the export captured with.
    """

    model: torch.nn.Module
    prefill: torch.export.ExportedProgram
    decode: torch.export.ExportedProgram
    prefill_kwargs: dict[str, Any]
    decode_kwargs: dict[str, Any]
    generation_config: Any

    def fresh(self) -> HfExport:
        """A deep copy: programs and inputs whose tensors nothing else shares."""
        return copy.deepcopy(self)


class _Handover:
    """Stands in for the ``EdgeProgramManager``: ``to_executorch`` gives the program back."""

    def __init__(self, program: torch.export.ExportedProgram):
        self.program = program

    def to_executorch(self, config: Any = None) -> torch.export.ExportedProgram:
        return self.program


@functools.cache
def _export(architecture: str, max_cache_len: int, prompt: int) -> HfExport:
    from transformers.exporters import ExecutorchConfig, ExecutorchExporter, exporter_executorch
    from transformers.exporters.utils import decompose_for_generation

    model = (tiny_model(architecture) if architecture in ARCHITECTURES
             else tiny_sweep_model(architecture))
    inputs = prompt_inputs(prompt)
    config = generation_config(max_cache_len)
    captured = {name: kwargs for name, (_, kwargs) in decompose_for_generation(
        model, copy.deepcopy(inputs), generation_config=config).items()}
    lower = exporter_executorch.to_edge_transform_and_lower
    # HF's own exporter, every step up to ExecuTorch's lowering; the program it would lower is
    # what comes back as the component's program.
    exporter_executorch.to_edge_transform_and_lower = lambda program, **_: _Handover(program)
    try:
        exported = ExecutorchExporter().export_for_generation(
            model, copy.deepcopy(inputs), ExecutorchConfig(backend="xnnpack"),
            generation_config=config)
    finally:
        exporter_executorch.to_edge_transform_and_lower = lower
    programs = {name: c.program for name, c in exported.components.items()}
    # generate's flags (use_cache, return_dict) were fixed at export: keep the program's inputs.
    kwargs = {name: {key: captured[name][key] for key in _keywords(program)}
              for name, program in programs.items()}
    return HfExport(model, programs["prefill"], programs["decode"], kwargs["prefill"],
                    kwargs["decode"], config)


def _keywords(program: torch.export.ExportedProgram) -> list[str]:
    """The keyword inputs ``program`` takes, in its call spec's order."""
    return list(program.call_spec.in_spec.child(1).context)


def export(architecture: str = "llama", max_cache_len: int = MAX_CACHE,
           prompt: int = PROMPT) -> HfExport:
    """HF's exporter's prefill and decode programs for a tiny model, before lowering.

    Exported once per argument set and deep-copied on every call, so callers may mutate what
    they get (run passes, call the programs) freely.
    """
    return _export(architecture, max_cache_len, prompt).fresh()


def export_llama(**options: Any) -> HfExport:
    """:func:`export` of the tiny Llama."""
    return export("llama", **options)


def export_qwen3(**options: Any) -> HfExport:
    """:func:`export` of the tiny Qwen3."""
    return export("qwen3", **options)


def decode_kwargs(like: dict[str, Any], token: int, position: int, cache: Any) -> dict[str, Any]:
    """The decode's keyword inputs for ``token`` at ``position``, shaped like ``like``'s."""
    def mask(like_mask: torch.Tensor) -> torch.Tensor:
        # HF's static-cache mask: boolean (or additive) over the cache's positions.
        if like_mask.dtype == torch.bool:
            visible = torch.zeros_like(like_mask)
            visible[..., : position + 1] = True
            return visible
        additive = torch.full_like(like_mask, torch.finfo(like_mask.dtype).min)
        additive[..., : position + 1] = 0
        return additive

    if "decoder_input_ids" in like:  # encoder-decoder: the encoder's inputs stay as they were
        return {**like, "decoder_input_ids": torch.tensor([[token]]),
                "decoder_attention_mask": mask(like["decoder_attention_mask"]), "cache": cache}
    kwargs = {
        "input_ids": torch.tensor([[token]]),
        # Qwen3 takes one mask per attention kind ({"full_attention": mask}); a layer kind
        # needing none (LFM2's convolutions, Mamba) has None.
        "attention_mask": torch.utils._pytree.tree_map(
            lambda m: None if m is None else mask(m), like.get("attention_mask"),
            is_leaf=lambda m: m is None),
        "position_ids": torch.tensor([[position]]),
        "cache": cache,
    }
    return {key: value for key, value in kwargs.items() if key in like}


def thread_calls(hf: HfExport, prefill: Any, decode: Any, steps: int) -> Iterator[tuple[Any, Any]]:
    """Greedy generation with callables shaped like HF's programs, threading the cache as HF does.

    ``prefill(**kwargs)`` and ``decode(**kwargs)`` return ``(logits, cache)`` (HF's programs: a
    ``CausalLMOutputWithPast``, read by position); the prefill gets
    ``hf.prefill_kwargs``, each decode the previous call's cache and its argmax token. Yields each
    call's ``(logits, cache)``: the prefill's, then ``steps`` decodes'.
    """
    kwargs = copy.deepcopy(hf.prefill_kwargs)
    result = prefill(**kwargs)
    logits, cache = result[0], result[1]
    yield logits, cache
    position = kwargs.get("decoder_input_ids", kwargs.get("input_ids")).shape[-1]
    for _ in range(steps):
        token = int(logits[0, -1].argmax())
        result = decode(**decode_kwargs(hf.decode_kwargs, token, position, cache))
        logits, cache = result[0], result[1]
        yield logits, cache
        position += 1


def eager_generate(hf: HfExport, new_tokens: int) -> torch.Tensor:
    """HF eager ``generate``'s greedy tokens for the export's prompt (the reference)."""
    inputs = prompt_inputs(hf.prefill_kwargs["input_ids"].shape[-1])
    config = copy.deepcopy(hf.generation_config)
    config.max_new_tokens = config.min_new_tokens = new_tokens
    with torch.no_grad():
        tokens = copy.deepcopy(hf.model).generate(**inputs, generation_config=config)
    return tokens[0, inputs["input_ids"].shape[-1]:]


_LAYER_LEAVES = ("keys", "values", "cumulative_length")


def resident_cache_options(hf: HfExport) -> dict[str, dict[str, Any]]:
    """``InputsToBuffers`` options making the prefill's and the decode's ``StaticCache`` one
    resident state, per method: what a user writes for HF's programs.

    The cache's flat leaves are per layer ``keys, values, cumulative_length``; the prefill
    takes only the counters (``cache.<layer>``) and returns all three per layer. Each leaf
    becomes ``cache.layers.<layer>.<leaf>`` in both methods: the decode's inputs are written
    in place and returned (paired by name, ``cache.*`` with ``cache.*``) and start as a fresh
    cache (zeros); the prefill's counters are written in place and returned, its keys and
    values created in the graph and returned.
    """
    layers = hf.model.config.num_hidden_layers
    names = {f"cache.{len(_LAYER_LEAVES) * layer + i}": f"cache.layers.{layer}.{leaf}"
             for layer in range(layers) for i, leaf in enumerate(_LAYER_LEAVES)}
    examples = torch.utils._pytree.tree_leaves(hf.decode_kwargs["cache"])
    fresh = {buffer: torch.zeros_like(value) for buffer, value in zip(
        names.values(), examples, strict=True)}
    counters = {f"cache.{layer}": f"cache.layers.{layer}.cumulative_length"
                for layer in range(layers)}
    returned = {v: k for k, v in names.items()}
    return {
        "prefill": {
            "buffers": counters,
            "next_values": {i: returned[b] for i, b in counters.items()},
            "created": {o: b for o, b in names.items() if not b.endswith("cumulative_length")},
        },
        "decode": {"buffers": names, "pair_by_name": ("cache.", "cache."),
                   "initial_values": fresh},
    }


# -- other architectures, and the cache mapping read from the programs' call specs -----------

SWEEP_ARCHITECTURES = ("mistral", "phi3", "gemma", "gemma2", "gemma3", "gpt_neox", "olmo2",
                       "phi", "qwen2", "falcon", "cohere2", "gpt_neo")
"""Tiny random decoders HF's exporter takes, with the cache layout each gives: every one a
``StaticCache`` of per-layer ``keys, values, cumulative_length``; ``mistral`` all sliding-window
layers (``StaticSlidingWindowLayer``, window 8 < the cache's 16), ``gemma2`` / ``gemma3`` /
``cohere2`` one sliding and one global layer; ``falcon`` its new decoder (one fused
query-key-value projection, grouped keys and values); ``gpt_neo`` one global and one local
layer, whose attention reads the updated keys back through ``to(float32)`` and HF's decode
returns that cast as the cache."""


STATE_LAYOUTS = ("t5", "mamba", "lfm2")
"""Tiny random models whose state HF's exporter lays out otherwise: ``t5`` an
``EncoderDecoderCache`` (per layer a self-attention cache the decode writes and a
cross-attention cache the prefill creates and the decode only reads, returning it as it
was), ``mamba`` a recurrent convolution and SSM state per layer (``LinearAttentionLayer``),
``lfm2`` a convolution state beside an attention layer's keys and values."""


def _state_layout_model(t: Any, architecture: str, layers: int) -> torch.nn.Module:
    if architecture == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=layers, num_heads=2,
            decoder_start_token_id=0, pad_token_id=0))
    if architecture == "mamba":
        return t.MambaForCausalLM(t.MambaConfig(
            vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=layers, expand=2,
            conv_kernel=4))
    return t.Lfm2ForCausalLM(t.Lfm2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        layer_types=["conv", "full_attention"][:layers]))


def tiny_sweep_model(architecture: str, layers: int = 2) -> torch.nn.Module:
    """A seeded random causal LM of ``architecture`` (hidden 32, 2 heads, vocab 64; sliding
    window 8 where the architecture has one)."""
    import transformers as t

    if architecture in STATE_LAYOUTS:
        state = torch.random.get_rng_state()
        torch.manual_seed(0)
        try:
            return _state_layout_model(t, architecture, layers).eval()
        finally:
            torch.random.set_rng_state(state)
    config_class, model_class, extra = {
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": 8, "head_dim": 16}),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, {"pad_token_id": 0}),
        "gemma": (t.GemmaConfig, t.GemmaForCausalLM, {"head_dim": 16}),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 8}),
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM, {
            "head_dim": 16, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"][:layers]}),
        "gpt_neox": (t.GPTNeoXConfig, t.GPTNeoXForCausalLM, {}),
        "olmo2": (t.Olmo2Config, t.Olmo2ForCausalLM, {}),
        "phi": (t.PhiConfig, t.PhiForCausalLM, {}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),
        "falcon": (t.FalconConfig, t.FalconForCausalLM, {"new_decoder_architecture": True,
                                                          "num_kv_heads": 1}),
        "cohere2": (t.Cohere2Config, t.Cohere2ForCausalLM, {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"][:layers]}),
        "gpt_neo": (t.GPTNeoConfig, t.GPTNeoForCausalLM, {
            "num_layers": layers, "num_heads": 2, "window_size": 8,
            "attention_types": ([[["global", "local"], 1]] if layers == 2
                                else [[["global"], layers]])}),
    }[architecture]
    options = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 64, "use_cache": True, **extra}
    if architecture in ("gpt_neox", "falcon"):
        del options["num_key_value_heads"]
    if architecture == "gpt_neo":  # its own names for layers and heads, no grouped heads
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            del options[name]
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return model_class(config_class(**options)).eval()
    finally:
        torch.random.set_rng_state(state)


def _leaf_paths(spec: Any) -> list[str]:
    """The attribute path of each flat leaf of a cache input or output (``layers.0.keys``),
    read from HF's pytree context (``{"_t": "tensor", "i": n}`` marks leaf ``n``); plain
    positions for any other container."""
    found: dict[int, str] = {}

    def walk(context: Any, path: str) -> None:
        if isinstance(context, dict) and context.get("_t") == "tensor":
            found[context["i"]] = path
        elif isinstance(context, dict) and context.get("_t") == "obj":
            walk(context["s"], path)
        elif isinstance(context, dict) and context.get("_t") == "items":  # {key: tensor}
            for key, value in context["v"]:
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(context, dict) and "_t" not in context:
            for key, value in context.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(context, list):
            for index, value in enumerate(context):
                walk(value, f"{path}.{index}" if path else str(index))

    walk(spec.context, "")
    if sorted(found) != list(range(spec.num_leaves)):
        return [str(i) for i in range(spec.num_leaves)]
    return [found[i] for i in range(spec.num_leaves)]


def _cache_spec(spec: Any, keyword: str) -> Any:
    keys = spec.context
    return spec.children()[list(keys).index(keyword)]


def cache_options(hf: HfExport, keyword: str = "cache") -> dict[str, dict[str, Any]]:
    """``InputsToBuffers`` options making the prefill's and the decode's cache one resident
    state, derived from the programs' call specs (any layer layout, sliding or not).

    Each cache leaf becomes the buffer ``cache.<its attribute path>``
    (``cache.layers.1.values``) in both methods. The decode's leaves are inputs written in
    place and returned (paired by name); they start as zeros. The prefill's cache inputs (the
    counters) are written in place and returned; the outputs it creates (keys, values) become
    the same buffers.
    """
    decode_in = _cache_spec(hf.decode.call_spec.in_spec.child(1), keyword)
    prefill_in = _cache_spec(hf.prefill.call_spec.in_spec.child(1), keyword)
    prefill_out = _cache_spec(hf.prefill.call_spec.out_spec, keyword)
    decode_names = {f"{keyword}.{i}": f"{keyword}.{path}"
                    for i, path in enumerate(_leaf_paths(decode_in))}
    examples = torch.utils._pytree.tree_leaves(hf.decode_kwargs[keyword])
    fresh = {buffer: torch.zeros_like(value) for buffer, value in zip(
        decode_names.values(), examples, strict=True)}
    returned = {f"{keyword}.{path}": f"{keyword}.{i}"
                for i, path in enumerate(_leaf_paths(prefill_out))}
    taken = {f"{keyword}.{i}": f"{keyword}.{path}"
             for i, path in enumerate(_leaf_paths(prefill_in))}
    return {
        "prefill": {
            "buffers": taken,
            "next_values": {i: returned[b] for i, b in taken.items()},
            "created": {o: b for b, o in returned.items() if b not in taken.values()},
        },
        "decode": {"buffers": decode_names, "pair_by_name": (f"{keyword}.", f"{keyword}."),
                   "initial_values": fresh},
    }


def exported_cache_calls(hf: HfExport, program: Any, keyword: str = "cache") -> Any:
    """``program`` (HF's decode, as a module) called with the cache re-wrapped in the
    structure it was exported with: the tensors threaded, the Python attributes as at export.

    A sliding-window layer keeps a Python int (``cumulative_length_int``) that HF's pytree
    context bakes into the decode's input spec, so the cache a decode returns no longer
    matches that spec and HF's decode cannot take it again; a runtime passes tensors only,
    which this does.
    """
    spec = _cache_spec(hf.decode.call_spec.in_spec.child(1), keyword)

    def call(**kwargs: Any) -> Any:
        leaves = torch.utils._pytree.tree_leaves(kwargs[keyword])
        kwargs[keyword] = torch.utils._pytree.tree_unflatten(leaves, spec)
        return program(**kwargs)
    return call


def cache_paths(hf: HfExport, keyword: str = "cache") -> list[str]:
    """The attribute path of each flat leaf of the decode's cache input (``layers.0.keys``,
    ...), in flat order."""
    return _leaf_paths(_cache_spec(hf.decode.call_spec.in_spec.child(1), keyword))
