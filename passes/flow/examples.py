"""What the main job (``python -m passes run``) uses by default, shipped with the package.

* :func:`decoder_job` / :func:`kv_decoder`: a seeded Llama-style decoder (RMSNorm, attention
  over a per-layer KV cache, gated SiLU MLP) that decodes one position per call and writes
  its K/V into registered buffers in place, with ``index_copy_`` or ``cache[:, :, pos] = k``
  (``index_put_``). No downloads: weights come from a seeded generator.
* :func:`prefill_decode_job`: the same decoder deployed as two methods sharing its caches,
  a prefill of several positions and a one-position decode (factory contract v3).
* :class:`AnnotateEveryOpQuantizer`: a quantizer in the style of the Qualcomm QNN backend's,
  annotating every aten op with a float result, data movement included (``--quantizer
  every-op``): the style under which a KV cache gets observed on its initial state.
* :func:`xnnpack_quantizer`: torchao's XNNPACK-style quantizer (the default).

Tests and benchmarks build on these too; they import them from here.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.observer import MinMaxObserver
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)

from .._analysis.non_finite_observations import beyond_any_grid

__all__ = [
    "ACTIVATION_QSPEC",
    "WEIGHT_QSPEC",
    "AnnotateEveryOpQuantizer",
    "DecoderConfig",
    "KVDecoder",
    "decode_inputs",
    "decoder_job",
    "kv_decoder",
    "prefill_decode_job",
    "stateful_decoder_job",
    "xnnpack_quantizer",
]


class DecoderConfig:
    def __init__(
        self,
        n_layers: int = 1,
        dim: int = 32,
        n_heads: int = 2,
        hidden: int = 64,
        max_seq: int = 16,
        cache_update: str = "index_copy",
        running_state: bool = False,
    ):
        if cache_update not in ("index_copy", "index_put"):
            raise ValueError(
                f"cache_update must be 'index_copy' or 'index_put', got {cache_update!r}"
            )
        self.n_layers, self.dim, self.n_heads = n_layers, dim, n_heads
        self.hidden, self.max_seq, self.cache_update = hidden, max_seq, cache_update
        self.running_state = running_state
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
    """Decodes one position per call: ``forward(x [1, 1, dim], input_pos [1]) -> [1, 1, dim]``.

    With ``cfg.running_state`` it also keeps a decaying summary of what it has decoded
    (``summary <- summary / 2 + h``, from a non-zero start), added to the last hidden state:
    state read on every call and updated by a compute op (``add_``), the kind of buffer
    whose quantized read ``convert_pt2e`` folds into a constant and whose calibration
    leaves its value behind.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        if cfg.running_state:
            self.register_buffer("summary", torch.randn(1, 1, cfg.dim))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, input_pos)
        if self.cfg.running_state:
            self.summary.mul_(0.5).add_(x)
            x = x + self.summary
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


def stateful_decoder_job(n_layers: int = 2, steps: int = 8, seed: int = 0) -> tuple:
    """The main job's default model: :func:`decoder_job`'s decoder with a running summary
    beside its KV caches (``DecoderConfig(running_state=True)``), where what the passes fix
    shows in the outputs, not only in the state."""
    model, example = kv_decoder(n_layers, seed=seed, running_state=True)
    return model, example, decode_inputs(model.cfg, steps, seed=seed)


def prefill_decode_job(
    n_layers: int = 2, prefill: int = 4, decode_steps: int = 7, seed: int = 0
) -> dict:
    """The decoder as two methods over one state (factory contract v3): ``prefill`` takes
    ``x [1, prefill, dim]`` at positions ``0 .. prefill-1``, ``decode`` one position; the
    steps are one prefill, then ``decode_steps`` decodes at the following positions."""
    model, _ = kv_decoder(n_layers, seed=seed)
    cfg = model.cfg
    generator = torch.Generator().manual_seed(seed + 2)
    prompt = (torch.randn(1, prefill, cfg.dim, generator=generator), torch.arange(prefill))
    decodes = decode_inputs(cfg, decode_steps, seed=seed, start=prefill)
    return {
        "module": model,
        "methods": {
            "prefill": {"example_args": prompt},
            "decode": {"example_args": decodes[0]},
        },
        "steps": [("prefill", prompt), *(("decode", call) for call in decodes)],
    }


ACTIVATION_QSPEC = QuantizationSpec(
    dtype=torch.uint8,
    quant_min=0,
    quant_max=255,
    qscheme=torch.per_tensor_affine,
    observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-20),
)
WEIGHT_QSPEC = QuantizationSpec(
    dtype=torch.int8,
    quant_min=-127,
    quant_max=127,
    qscheme=torch.per_tensor_symmetric,
    observer_or_fake_quant_ctr=MinMaxObserver.with_args(
        qscheme=torch.per_tensor_symmetric, eps=2**-20
    ),
)

_LINEAR_OPS = (torch.ops.aten.linear.default,)


def _is_float_tensor(node: object) -> bool:
    if not isinstance(node, Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


# Ops giving a finite result for an infinite input (softmax of a -inf mask is 0 there): the
# first op after a masked value that can be quantized again.
_BOUNDING_OPS = (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default,
                 torch.ops.aten.exp.default, torch.ops.aten.sigmoid.default,
                 torch.ops.aten.tanh.default)


def _holds_non_finite(model: GraphModule, node: Node) -> bool:
    """A buffer or constant read (``get_attr``) whose value holds inf, NaN or a value at
    +-65504 or beyond now (:func:`~passes._analysis.non_finite_observations.beyond_any_grid`)."""
    if node.op != "get_attr":
        return False
    value = model
    for name in str(node.target).split("."):
        value = getattr(value, name, None)
    return isinstance(value, torch.Tensor) and beyond_any_grid(value)


class AnnotateEveryOpQuantizer(Quantizer):
    """Annotate every aten op with a float result: float inputs and the output, uint8 affine.

    Linear weights get a symmetric int8 spec; linear biases stay in float. A value that may
    hold inf stays in float: an op with a non-finite constant argument (the attention
    mask's ``masked_fill(..., -inf)``, or ``torch.finfo(torch.float32).min``: any number at
    +-65504 or beyond, whose grid would read every other value as 0) or reading a buffer
    holding one (a ``-inf`` mask kept as state), and every op after it up to one that
    bounds it (softmax, exp, sigmoid, tanh), which reads it in float: a quantization grid
    is finite, and a quantized -inf mask no longer masks.
    """

    def annotate(self, model: GraphModule) -> GraphModule:
        unbounded: set[Node] = {node for node in model.graph.nodes
                                if _holds_non_finite(model, node)}
        for node in model.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            if not _is_float_tensor(node):
                continue
            leaves = pytree.tree_leaves((node.args, node.kwargs))
            if any(beyond_any_grid(v) for v in leaves if isinstance(v, float)) or (
                    node.target not in _BOUNDING_OPS
                    and any(isinstance(v, Node) and v in unbounded for v in leaves)):
                unbounded.add(node)
                continue
            input_qspec_map = {}
            for position, arg in enumerate(leaves):
                if not _is_float_tensor(arg) or arg in input_qspec_map or arg in unbounded:
                    continue
                if node.target in _LINEAR_OPS and position == 2:
                    continue
                weight = node.target in _LINEAR_OPS and position == 1
                input_qspec_map[arg] = WEIGHT_QSPEC if weight else ACTIVATION_QSPEC
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map=input_qspec_map,
                output_qspec=ACTIVATION_QSPEC,
                _annotated=True,
            )
        return model

    def validate(self, model: GraphModule) -> None:
        return None


def xnnpack_quantizer() -> Quantizer:
    """torchao's XNNPACK-style quantizer: static per-tensor symmetric int8."""
    # torchao 0.18 ships XNNPACKQuantizer only under torchao.testing; the public one is
    # ExecuTorch's (executorch.backends.xnnpack.quantizer), an optional extra the package
    # cannot require, so the default quantizer comes from torchao's copy.
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "XNNPACKQuantizer is deprecated"
        return XNNPACKQuantizer().set_global(get_symmetric_quantization_config())
