"""Core ML: the cases of issue 31's table, lowered with ExecuTorch's own Core ML partitioner.

``coreml_partitioner`` is ``CoreMLPartitioner(take_over_mutable_buffer=True)`` with an iOS 18
compile spec (Core ML state needs iOS 18 / macOS 15); conversion to an ``.mlpackage`` runs on
Linux, only running it needs macOS. A lowered delegate keeps its Edge sub-program
(``original_module``), which ExecuTorch's Python execution of the lowered program runs, and
its processed bytes (the flattened ``.mlpackage``), whose spec :func:`coreml_states` reads.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import coremltools
import torch
from executorch.backends.apple.coreml import executorchcoreml
from executorch.backends.apple.coreml.compiler import CoreMLBackend
from executorch.backends.apple.coreml.partition import CoreMLPartitioner
from executorch.backends.apple.coreml.quantizer import CoreMLQuantizer
from executorch.backends.apple.coreml.quantizer._annotation_config import AnnotationConfig
from executorch.backends.apple.coreml.quantizer._coreml_quantizer import (
    _AnnotationPatternRegistry,
)
from executorch.exir.lowered_backend_module import LoweredBackendModule
from torch import nn

from passes.flow.examples import decode_inputs, kv_decoder

from .executorch_cases import ReturnsBuffer

__all__ = [
    "CALLS",
    "CASES",
    "COREML_BACKEND",
    "Accumulator",
    "CacheWrite",
    "CachesWrittenLast",
    "CoreMLCase",
    "CountedCache",
    "Fp16Caches",
    "PatternSubsetQuantizer",
    "ReturnsBufferAndSum",
    "RunningMean",
    "TinyAttention",
    "attention_inputs",
    "coreml_io",
    "coreml_ops",
    "coreml_partitioner",
    "coreml_quantizer",
    "coreml_states",
    "delegates",
    "owned_buffers",
]

COREML_BACKEND = "CoreMLBackend"
CALLS = 4
# The spec of the .mlpackage, inside the delegate's flattened directory.
MLPACKAGE = os.path.join("lowered_module", "model.mlpackage")


def coreml_partitioner(skip_ops: tuple[str, ...] = (),
                       precision: coremltools.precision = coremltools.precision.FLOAT16
                       ) -> CoreMLPartitioner:
    """ExecuTorch's Core ML partitioner taking mutable buffers over as Core ML state,
    computing in ``precision`` (Core ML's default: fp16)."""
    specs = CoreMLBackend.generate_compile_specs(
        minimum_deployment_target=coremltools.target.iOS18, compute_precision=precision)
    return CoreMLPartitioner(compile_specs=specs, take_over_mutable_buffer=True,
                             skip_ops_for_coreml_delegation=list(skip_ops))


class PatternSubsetQuantizer(CoreMLQuantizer):
    """``CoreMLQuantizer`` annotating with some of its patterns (in its own order).

    Each ``annotate`` of ``CoreMLQuantizer`` builds its 405 pattern graphs with a strict
    ``torch.export`` each (every convolution, pool and op-activation pair), 100-260 s on the
    suite's 2 cores whatever the model. A model holding none of the left-out patterns gets
    the same annotation from the subset (benchmarks/bench_coreml_quantizer.py checks it
    for :class:`TinyAttention`, with the times).
    """

    def __init__(self, config, patterns: tuple[str, ...]) -> None:
        super().__init__(config)
        known = _AnnotationPatternRegistry.get_annotators()
        unknown = sorted(set(patterns) - set(known))
        if unknown:
            raise ValueError(f"not CoreMLQuantizer patterns: {unknown}; known: {list(known)}")
        self.patterns = tuple(patterns)

    def _annotate_all_patterns(self, model, quantization_config, filter_fn=None):
        config = AnnotationConfig.from_quantization_config(quantization_config)
        for name, annotator in _AnnotationPatternRegistry.get_annotators().items():
            if name in self.patterns:
                annotator(model, config, filter_fn)


# The patterns TinyAttention holds: linear layers, adds, muls and matmuls, none followed
# by an activation CoreMLQuantizer fuses.
TINY_ATTENTION_PATTERNS = ("linear", "add", "mul", "matmul")


def coreml_quantizer(patterns: tuple[str, ...] | None = TINY_ATTENTION_PATTERNS):
    """CoreMLQuantizer with ExecuTorch's documented 8-bit config (symmetric, per-channel
    int8 weights, uint8 activations); ``patterns=None``: all its patterns."""
    from coremltools.optimize.torch.quantization.quantization_config import (
        LinearQuantizerConfig,
        QuantizationScheme,
    )

    config = LinearQuantizerConfig.from_dict({"global_config": {
        "quantization_scheme": QuantizationScheme.symmetric,
        "activation_dtype": torch.quint8,
        "weight_dtype": torch.qint8,
        "weight_per_channel": True,
    }})
    return CoreMLQuantizer(config) if patterns is None else PatternSubsetQuantizer(
        config, patterns)


class TinyAttention(nn.Module):
    """One attention head with a K and a V cache written by ``index_copy_``: the decoder's
    stateful core, with no activation after a linear layer (so a few CoreMLQuantizer
    patterns annotate it as all of them do)."""

    def __init__(self, dim: int = 8, max_seq: int = 8) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        with torch.no_grad():
            for layer in (self.q, self.k, self.v, self.o):
                layer.weight.copy_(torch.randn(dim, dim, generator=generator) / dim ** 0.5)
                layer.bias.copy_(torch.randn(dim, generator=generator) / 4)
        self.register_buffer("k_cache", torch.zeros(1, max_seq, dim))
        self.register_buffer("v_cache", torch.zeros(1, max_seq, dim))
        self.scale = dim ** -0.5
        self.max_seq = max_seq

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k_cache.index_copy_(1, pos, self.k(x))
        self.v_cache.index_copy_(1, pos, self.v(x))
        visible = torch.arange(self.max_seq) <= pos.view(-1, 1)
        scores = torch.matmul(self.q(x), self.k_cache.transpose(1, 2)) * self.scale
        scores = scores.masked_fill(~visible, float("-inf"))
        return x + self.o(torch.matmul(torch.softmax(scores, dim=-1), self.v_cache))


def attention_inputs(calls: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 1, 8, generator=generator), torch.tensor([step]))
            for step in range(calls)]


class CacheWrite(nn.Module):
    """PR #4830's model: a row written into a cache with ``index_put_``, then ``mm``."""

    def __init__(self, initial: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4) if initial is None else initial)
        self.weight = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_put_((pos,), x)
        return torch.mm(self.cache, self.weight)


class Accumulator(nn.Module):
    """An fp32 accumulator of small increments on a large total, beside a cache: in fp16
    (spacing 0.5 at 1000) every increment of ``x / 1000`` would be lost."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.full((1, 4), 1000.0))
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.acc.add_(x * 1e-3)
        self.cache.index_copy_(0, pos, x)
        return self.acc * 2 + self.cache.sum(0)


class CachesWrittenLast(nn.Module):
    """Two caches read for the output, then written (``index_copy_``): the program's last
    op computes a new state value, which coremltools 9.0 fails to convert (``KeyError``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(8, 4))
        self.register_buffer("v_cache", torch.zeros(8, 4))
        self.weight = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = torch.mm(self.k_cache, self.weight) + self.v_cache
        self.k_cache.index_copy_(0, pos, x)
        self.v_cache.index_copy_(0, pos, x * 2)
        return out


class ReturnsBufferAndSum(nn.Module):
    """The mutated buffer returned beside a value computed from it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.b.add_(x)
        return self.b, x + self.b


class CountedCache(nn.Module):
    """A cache written at the position a counter buffer of ``dtype`` holds, the counter
    then advanced (HF's ``cumulative_length``; a bool counter flips between two rows)."""

    def __init__(self, dtype: torch.dtype = torch.int64, start: int = 0) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))
        self.register_buffer("position", torch.full((), start, dtype=dtype))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        row = self.position.long().remainder(8).view(1)
        self.cache.index_copy_(0, row, x)
        if self.position.dtype == torch.bool:
            self.position.logical_not_()
        else:
            self.position.add_(1)
        return self.cache.sum(0, keepdim=True) * self.position.float()


class Fp16Caches(nn.Module):
    """Four float16 caches (Core ML's own state dtype) written from float32 values cast to
    fp16: by ``index_copy_``, ``cache[pos] = v`` (``index_put_``), ``scatter_`` and
    ``index_add_`` (which adds in fp16)."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("k", "v", "s", "a"):
            self.register_buffer(name, torch.zeros(8, 4, dtype=torch.float16))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(0, pos, x.half())
        self.v[pos] = (x * 3).half()
        self.s.scatter_(0, pos.view(1, 1).expand(1, 4), (x - 1).half())
        self.a.index_add_(0, pos % 2, (x / 3).half())
        both = self.k.float() * self.v.float() + self.s.float() - self.a.float()
        return both.sum(0, keepdim=True) + x


class RunningMean(nn.Module):
    """The mean of the inputs so far: a float sum and an int64 count of calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(1, 4))
        self.register_buffer("count", torch.zeros(1, dtype=torch.int64))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        self.count.add_(1)
        return self.total / self.count.float()


def cache_inputs(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 4, generator=generator), torch.tensor([step % 8]))
            for step in range(CALLS)]


def vector_inputs(seed: int = 0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, generator=generator),) for _ in range(CALLS)]


def decoder() -> tuple[nn.Module, list[tuple]]:
    model, _ = kv_decoder(1)
    return model, decode_inputs(model.cfg, CALLS, start=2)


@dataclass(frozen=True)
class CoreMLCase:
    """A model with state, its inputs, the ops Core ML must leave out, what ExecuTorch 1.5.1
    alone does (``None``: lowers; else the error type and a piece of its message), and the
    buffers the Core ML delegate owns once wrapped."""

    description: str
    make: Callable[[], tuple[nn.Module, list[tuple]]]
    skip_ops: tuple[str, ...]
    alone: tuple[type[BaseException], str] | None
    owned: frozenset[str]


_RETURNED = (AssertionError, "currently not supported")
CACHES = frozenset({"layers.0.attn.k_cache", "layers.0.attn.v_cache"})
CASES = {
    "cache_write": CoreMLCase(
        "#4830's model: index_put_ into a cache, mm", lambda: (CacheWrite(), cache_inputs()),
        (), None, frozenset({"cache"})),
    "returns_buffer": CoreMLCase(
        "b.add_(x); return b", lambda: (ReturnsBuffer(), vector_inputs()),
        (), _RETURNED, frozenset({"acc"})),
    "returns_buffer_and_sum": CoreMLCase(
        "b.add_(x); return b, x + b", lambda: (ReturnsBufferAndSum(), vector_inputs()),
        (), _RETURNED, frozenset({"b"})),
    "mm_outside": CoreMLCase(
        "#4830's model with mm kept out of Core ML", lambda: (CacheWrite(), cache_inputs()),
        ("aten.mm.default",), (ValueError, "Cannot lower a model with no outputs"),
        frozenset({"cache"})),
    "decoder": CoreMLCase("a 1-layer decoder", decoder, (), None, CACHES),
    "caches_written_last": CoreMLCase(
        "two caches written after the output is computed",
        lambda: (CachesWrittenLast(), cache_inputs()), (),
        (KeyError, "coreml_update_state"), frozenset({"k_cache", "v_cache"})),
}


def exported(model: nn.Module, inputs: list[tuple]) -> torch.export.ExportedProgram:
    """A fresh export of a copy: each lowering owns its buffers (ExecuTorch's Python run of
    a delegate updates the tensors its program holds)."""
    return torch.export.export(copy.deepcopy(model), inputs[0])


def delegates(program: torch.export.ExportedProgram) -> list[LoweredBackendModule]:
    return [getattr(program.graph_module, node.target)
            for node in program.graph.find_nodes(op="get_attr")
            if node.target.startswith("lowered_module")]


def owned_buffers(delegate: LoweredBackendModule) -> set[str]:
    """The buffers a delegate owns: its sub-program reads them and writes them back."""
    sig = delegate.original_module.graph_signature
    return set(sig.buffers_to_mutate.values()) & set(sig.inputs_to_buffers.values())


def _spec(delegate: LoweredBackendModule):
    """The spec (protobuf) of a Core ML delegate's ``.mlpackage``."""
    with tempfile.TemporaryDirectory() as folder:
        if not executorchcoreml.unflatten_directory_contents(delegate.processed_bytes, folder):
            raise ValueError(f"{delegate.backend_id} delegate: not a flattened .mlpackage")
        return coremltools.utils.load_spec(os.path.join(folder, MLPACKAGE))


def _dtype_name(array_type) -> str:
    from coremltools.proto import FeatureTypes_pb2

    return FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(array_type.dataType)


def coreml_states(delegate: LoweredBackendModule) -> dict[str, str]:
    """State name -> data type (``"FLOAT16"``) in the spec of a Core ML delegate's
    ``.mlpackage`` (names are FQNs with ``.`` as ``_``)."""
    return {state.name: _dtype_name(state.type.stateType.arrayType)
            for state in _spec(delegate).description.state}


def coreml_io(delegate: LoweredBackendModule) -> tuple[dict[str, str], dict[str, str]]:
    """The inputs and the outputs of a Core ML delegate's model, name -> data type
    (a buffer the delegate receives is named ``b_<fqn>``)."""
    description = _spec(delegate).description
    return ({i.name: _dtype_name(i.type.multiArrayType) for i in description.input},
            {o.name: _dtype_name(o.type.multiArrayType) for o in description.output})


def coreml_ops(delegate: LoweredBackendModule) -> list[tuple[str, list[str]]]:
    """The MIL program of a Core ML delegate, constants left out: (op type, the names its
    inputs read, in no set order: the spec keeps them in a map), in program order."""
    ops = []
    for function in _spec(delegate).mlProgram.functions.values():
        for block in function.block_specializations.values():
            ops += [(op.type, [a.name for v in op.inputs.values() for a in v.arguments])
                    for op in block.operations if op.type != "const"]
    return ops
