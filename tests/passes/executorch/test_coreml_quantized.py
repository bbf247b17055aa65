"""A CoreMLQuantizer-quantized attention with KV caches, lowered with Core ML owning them.

``CoreMLQuantizer`` (ExecuTorch's, coremltools 9.0) through our ``quantize_program``;
``QuantizeMutableBuffers(state_owner="coreml")`` keeps the caches float (Core ML keeps
float state only); ``BufferOwningPartitioner(CoreMLPartitioner(take_over_mutable_buffer=
True))`` lowers on Linux with Core ML owning both caches, and the lowered program run in
Python (each delegate's Edge program) computes what the quantized program does, call
after call, outputs and caches.

The quantizer annotates with the four patterns the model holds (``PatternSubsetQuantizer``):
all 405 of CoreMLQuantizer's cost 100-260 s here (a strict ``torch.export`` per pattern,
whatever the model) and annotate this model the same way
(benchmarks/bench_coreml_quantizer.py).
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest

pytest.importorskip("coremltools")

import torch
from executorch.exir import to_edge_transform_and_lower

from pass_manager import PassManager, assert_same_behaviour
from passes import QuantizeMutableBuffers
from passes.executorch import BufferOwningPartitioner, DelegateStateWarning, executorch_state
from passes.quantization import quantize_program
from tests.models.coreml_cases import (
    COREML_BACKEND,
    TinyAttention,
    attention_inputs,
    coreml_partitioner,
    coreml_quantizer,
    coreml_states,
    delegates,
    owned_buffers,
)

CACHES = {"k_cache", "v_cache"}


@pytest.fixture(scope="module")
def quantized():
    """TinyAttention quantized by CoreMLQuantizer, its caches kept float for Core ML."""
    calls = attention_inputs()
    with torch.no_grad():
        program = torch.export.export(TinyAttention(), calls[0])
    program = quantize_program(program, coreml_quantizer(), calls[:3])
    result = PassManager([QuantizeMutableBuffers(state_owner="coreml")], strict=True).run(
        program)
    return result.program, result.report.records[0], calls


def test_core_ml_quantizer_annotates_the_model(quantized):
    program, _, _ = quantized
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert sum("quantize_per_tensor" in op for op in ops) >= 4  # activations
    assert any("dequantize_per_channel" in op for op in ops)  # int8 per-channel weights


def test_owned_caches_stay_float(quantized):
    program, record, _ = quantized
    for fqn in CACHES:
        assert program.state_dict[fqn].dtype == torch.float32
        assert record.statistics[f"{fqn}: kept float for coreml"] == 1
        (note,) = [n for n in record.notes if n.startswith(f"{fqn}: ")]
        assert "coreml will own it: Core ML keeps state as float only" in note


def test_lowered_core_ml_owns_the_caches_and_runs_like_the_quantized_program(quantized):
    program, _, calls = quantized
    wrapped = BufferOwningPartitioner(coreml_partitioner())
    logging.disable(logging.WARNING)  # coremltools' progress and fp16-state lines
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            edge = to_edge_transform_and_lower(copy.deepcopy(program), partitioner=[wrapped])
    finally:
        logging.disable(logging.NOTSET)
    edge.to_executorch()
    lowered = edge.exported_program()
    (delegate,) = [d for d in delegates(lowered) if owned_buffers(d)]
    assert delegate.backend_id == COREML_BACKEND
    assert owned_buffers(delegate) == CACHES
    assert not lowered.graph_signature.buffers_to_mutate  # nothing written back on top
    assert coreml_states(delegate) == {fqn: "FLOAT16" for fqn in CACHES}
    said = sorted(w.message.buffer for w in caught
                  if isinstance(w.message, DelegateStateWarning) and w.message.issue == "fp16")
    assert said == sorted(CACHES)
    assert_same_behaviour(copy.deepcopy(program), lowered, calls, atol=0,
                          state=executorch_state)
