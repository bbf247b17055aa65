"""PassQuantizer: pass pipelines around another torchao quantizer, with real torchao.

The whole pt2e flow through it (decode accuracy against fp32) is tested in
tests/passes/flow/test_quantization.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
from torchao.quantization.pt2e.quantizer import Quantizer

from pass_manager import PassManagerError
from passes import MarkMutableBuffers, SkipAnnotateDataMovementOps, mutable_buffers
from passes.flow.examples import AnnotateEveryOpQuantizer, kv_decoder
from passes.quantization import PassQuantizer, QuantizationFlowError

CACHES = ("layers.0.attn.k_cache", "layers.0.attn.v_cache")


def kv_model():
    return kv_decoder(1, cache_update="index_copy")


class _RecordingQuantizer(Quantizer):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def transform_for_annotation(self, model):
        self.calls.append("transform")
        return model

    def annotate(self, model):
        self.calls.append("annotate")
        return model

    def validate(self, model):
        self.calls.append("validate")


def test_pass_quantizer_runs_pipelines_around_the_wrapped_quantizer():
    model, example = kv_model()
    gm = torch.export.export(copy.deepcopy(model), example).module()
    inner = _RecordingQuantizer()
    quantizer = PassQuantizer(inner, transform=[MarkMutableBuffers()],
                              after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_pt2e(gm, quantizer)
    assert inner.calls == ["transform", "annotate", "validate"]
    assert [r.name for report in quantizer.reports for r in report.records] == [
        "MarkMutableBuffers", "SkipAnnotateDataMovementOps"]
    assert sorted(mutable_buffers(prepared)) == sorted(CACHES)


def test_pass_quantizer_rejects_a_non_quantizer_and_out_of_place_annotation():
    with pytest.raises(TypeError, match="not a torchao pt2e Quantizer"):
        PassQuantizer(AnnotateEveryOpQuantizer)

    class Replacing(_RecordingQuantizer):
        def annotate(self, model):
            return copy.deepcopy(model)

    model, example = kv_model()
    gm = torch.export.export(copy.deepcopy(model), example).module()
    with pytest.raises(QuantizationFlowError, match="returned a new graph module") as error:
        prepare_pt2e(gm, PassQuantizer(Replacing()))
    assert isinstance(error.value, PassManagerError)


class CacheWrittenWithoutGrad(torch.nn.Module):
    """A key cache and a running sum written under ``no_grad``, as a model trained with
    state writes them (eager fails on the second backward otherwise)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.k = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(6, 4))
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x, pos):
        k = self.k(x)
        with torch.no_grad():
            self.cache.index_copy_(0, pos, k)
            self.acc.add_(k.mean(0))
        return torch.softmax(k @ self.cache.T, -1) @ self.cache + self.acc


def test_qat_training_loop_over_state_written_under_no_grad():
    """``prepare_qat_pt2e`` through the flow's PassQuantizer, then epochs of SGD over 6
    decode calls each: the inlined no_grad writes used to carry the step's autograd graph
    into the cache, and the second backward failed (``Trying to backward through the graph
    a second time``). Now the state never holds a grad history, and the trained program
    converts: the converted cache and sum are within 0.86% and 0.80% of their largest value of
    the fake-quantized program's, over the same 6 calls."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    from pass_manager import PassManager
    from passes import InplaceToFunctional, UnfreezeMutableBuffer, reset_mutable_buffers

    calls = [(torch.randn(1, 4, generator=torch.Generator().manual_seed(i)), torch.tensor([i]))
             for i in range(6)]
    quantizer = PassQuantizer(
        XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=True)),
        transform=[MarkMutableBuffers(), InplaceToFunctional()],
        after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_qat_pt2e(
        torch.export.export(CacheWrittenWithoutGrad(), calls[0]).module(), quantizer)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for _ in range(2):
        for args in calls:
            optimizer.zero_grad()
            prepared(*args).pow(2).sum().backward()
            optimizer.step()
            assert not prepared.cache.requires_grad and not prepared.acc.requires_grad
        reset_mutable_buffers(prepared)
    move_exported_model_to_eval(prepared)
    with torch.no_grad():
        fake_quantized = copy.deepcopy(prepared)
        for args in calls:
            fake_quantized(*args)
        converted = PassManager([UnfreezeMutableBuffer()]).run(convert_pt2e(prepared)).program
        for args in calls:
            converted(*args)
    for name in ("cache", "acc"):
        want = getattr(fake_quantized, name)
        assert (getattr(converted, name) - want).abs().max() <= 0.02 * want.abs().max()
