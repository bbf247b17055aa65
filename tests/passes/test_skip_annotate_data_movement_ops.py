"""SkipAnnotateDataMovementOps: a mutable buffer shares the qparams of what is written into it."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torchao.quantization.pt2e.quantizer import QuantizationSpec, SharedQuantizationSpec

from pass_manager import PassManager, PreconditionError
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    conditions,
)
from passes.flow.examples import AnnotateEveryOpQuantizer, decode_inputs, kv_decoder
from passes.quantization import quantize_program
from tests.models.accumulators import Accumulator, accumulator_inputs
from tests.models.decode import decode

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


def _annotated(model: nn.Module, example: tuple, functional: bool) -> torch.fx.GraphModule:
    gm = torch.export.export(copy.deepcopy(model), example).module()
    passes = [MarkMutableBuffers()] + ([InplaceToFunctional()] if functional else [])
    gm = PassManager(passes).run(gm).program
    AnnotateEveryOpQuantizer().annotate(gm)
    return gm


def _node(gm: torch.fx.GraphModule, target) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target == target)


@functools.cache
def _kv():
    return kv_decoder(1, cache_update="index_copy")


def test_cache_write_shares_the_written_value_qparams():
    model, example = _kv()
    gm = _annotated(model, example, functional=True)
    violations = conditions.DataMovementNotAnnotated.check(gm)
    assert any("index_copy" in v and "k_cache" in v for v in violations)
    assert any("copy_" in v for v in violations)

    result = PassManager([SkipAnnotateDataMovementOps()]).run(gm)
    assert result.modified
    assert not conditions.DataMovementNotAnnotated.check(gm)
    index_copy = _node(gm, aten.index_copy.default)
    cache, written = index_copy.args[0], index_copy.args[3]
    annotation = index_copy.meta["quantization_annotation"]
    assert cache not in annotation.input_qspec_map
    assert annotation.input_qspec_map[written] == SharedQuantizationSpec(written)
    assert annotation.output_qspec == SharedQuantizationSpec((written, index_copy))
    write_back = next(n for n in gm.graph.nodes
                      if n.target == aten.copy_.default and n.args[1] is index_copy)
    assert write_back.args[0] not in write_back.meta["quantization_annotation"].input_qspec_map


def test_converted_cache_holds_values_on_the_written_value_grid():
    """Behaviour: after decoding, every cache entry is exactly representable with the
    qparams of the value written into it (one set of qparams for value and cache)."""
    model, example = _kv()
    inputs = decode_inputs(model.cfg, 6, seed=3)
    converted = quantize_program(torch.export.export(copy.deepcopy(model), example),
                                 AnnotateEveryOpQuantizer(), inputs)
    index_copy = _node(converted, aten.index_copy.default)
    written_q = index_copy.args[3].args[0]
    cache_q = next(iter(index_copy.users))
    assert written_q.target == cache_q.target == qd.quantize_per_tensor.default
    assert written_q.args[1:] == cache_q.args[1:]
    scale, zero_point, qmin, qmax, dtype = written_q.args[1:]

    program = copy.deepcopy(converted).module()
    with torch.no_grad():
        for args in inputs:
            program(*args)
    cache = program.get_buffer("layers.0.attn.k_cache")
    on_grid = qd.dequantize_per_tensor(qd.quantize_per_tensor(cache, scale, zero_point, qmin,
                                                              qmax, dtype),
                                       scale, zero_point, qmin, qmax, dtype)
    assert torch.equal(cache, on_grid)
    assert (cache[0, :, : len(inputs)].abs().amax(dim=-1) > 0).all()  # rows were written
    result = decode(model, converted, inputs)
    assert result.worst_buffer_error("layers.0.attn.k_cache") <= 8 * scale


def test_compute_ops_on_a_buffer_keep_their_annotations():
    model = Accumulator()
    gm = _annotated(model, accumulator_inputs(1)[0], functional=False)
    add_ = _node(gm, aten.add_.Tensor)
    before = dict(add_.meta["quantization_annotation"].input_qspec_map)
    PassManager([SkipAnnotateDataMovementOps()]).run(gm)
    after = add_.meta["quantization_annotation"].input_qspec_map
    assert after == before and isinstance(after[add_.args[0]], QuantizationSpec)


def test_requires_marked_buffers():
    model, example = _kv()
    gm = torch.export.export(copy.deepcopy(model), example).module()
    AnnotateEveryOpQuantizer().annotate(gm)
    with pytest.raises(PreconditionError, match="MutableBuffersMarked"):
        PassManager([SkipAnnotateDataMovementOps()]).run(gm)


class ShiftRegister(nn.Module):
    """A buffer shifted by ``roll`` (not in the default data-movement set) and refilled."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.register_buffer("window", torch.zeros(4, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = torch.roll(self.window, 1, 0)
        self.window.copy_(shifted.index_copy(0, torch.tensor([0]), x))
        return self.window.mean(0, keepdim=True) * 2.0


@pytest.mark.parametrize("extended", [False, True])
def test_the_data_movement_set_can_be_extended(extended):
    gm = _annotated(ShiftRegister(), (torch.randn(1, 8),), functional=False)
    roll = _node(gm, aten.roll.default)
    extra = {aten.roll: None} if extended else None
    PassManager([SkipAnnotateDataMovementOps(extra_ops=extra)]).run(gm)
    annotation = roll.meta["quantization_annotation"]
    assert (roll.args[0] in annotation.input_qspec_map) is not extended
    assert (annotation.output_qspec is None) is extended
