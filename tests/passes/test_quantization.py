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
