"""Each pass counts what it did; the report shows the counts per pass (MLIR -pass-statistics)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pass_manager import PassManager, PassManagerError, assert_same_behaviour
from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
)
from passes.delegation import DELEGATION_TAG, to_delegate
from passes.delegation.ownership import program_state
from passes.flow.examples import AnnotateEveryOpQuantizer, kv_decoder
from passes.quantization import PassQuantizer
from tests.models.accumulators import Accumulator, accumulator_inputs

aten = torch.ops.aten


class CacheAndInput(nn.Module):
    """A cache row written through a view, a counter bumped in place, an input mutated."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x, scratch):
        self.cache[1].copy_(x)
        self.count.add_(1)
        scratch.mul_(2)
        return self.cache.sum(0) + self.count + scratch


def _calls():
    return [(torch.full((3,), float(i)), torch.ones(3)) for i in range(3)]


@pytest.mark.parametrize("form", ["ExportedProgram", "GraphModule"])
def test_functionalization_counts_marks_rewrites_and_write_backs(form):
    model = CacheAndInput()
    ep = torch.export.export(copy.deepcopy(model), _calls()[0])
    program = ep if form == "ExportedProgram" else ep.module()
    result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
    assert_same_behaviour(model, result.program, _calls())
    mark, functionalize = result.report.records
    assert mark.statistics == {"mutable buffers marked": 2, "mutated user inputs marked": 1}
    assert functionalize.statistics == {
        "in-place ops rewritten: aten.copy_": 1,
        "writes through a view written back into their base": 1,
        "in-place ops rewritten: aten.add_": 1,
        "in-place ops rewritten: aten.mul_": 1,
        "mutated buffers written back": 2,
        "mutated user inputs written back": 1,
    }
    table = result.report.table()
    assert "statistics:" in table and "1  in-place ops rewritten: aten.add_" in table
    assert result.report.to_dict()["records"][1]["statistics"] == functionalize.statistics


def test_a_refusal_is_a_statistic_of_the_failed_pass_in_the_error_report(constant_writer):
    with pytest.raises(PassManagerError) as info:
        PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(constant_writer)
    report = info.value.report
    assert [r.name for r in report.records] == ["MarkMutableBuffers", "InplaceToFunctional"]
    failed = report.records[-1]
    assert failed.statistics == {"refused: writes-constant": 1}
    assert failed.error.startswith("PassFailedError:")
    assert "FAILED" in report.table()
    assert 0 < failed.wall_time < 60  # timed up to the rollback


def test_a_group_sums_what_its_passes_counted():
    group = PassManager([MarkMutableBuffers(), InplaceToFunctional()], name="functionalize")
    ep = torch.export.export(CacheAndInput(), _calls()[0])
    (record,) = PassManager([group]).run(ep).report.records
    assert record.statistics["MarkMutableBuffers: mutable buffers marked"] == 2
    assert record.statistics["InplaceToFunctional: in-place ops rewritten: aten.mul_"] == 1


class TwoCaches(nn.Module):
    """``kept`` is read outside the delegate that updates it; ``moved`` only inside."""

    def __init__(self):
        super().__init__()
        self.register_buffer("moved", torch.zeros(4))
        self.register_buffer("kept", torch.ones(4))

    def forward(self, x):
        old = self.kept * 2
        self.kept.add_(x)
        self.moved.add_(x)
        return old + self.moved.sum() + self.kept


def _all_but_mul(ep):
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target != aten.mul.Tensor:
            node.meta[DELEGATION_TAG] = "delegate"


def test_consume_counts_buffers_moved_and_kept_with_their_reason():
    model = TwoCaches()
    ep = torch.export.export(copy.deepcopy(model), (torch.ones(4),)).run_decompositions({})
    lowered = to_delegate(ep, _all_but_mul)
    result = PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered)
    calls = [(torch.full((4,), float(i)),) for i in range(3)]
    assert_same_behaviour(model, result.program, calls, state=program_state)
    assert result.report.records[0].statistics == {
        "buffers moved into a delegate": 1,
        "buffers kept at the top level: read outside its delegate": 1,
    }


def test_quantization_passes_count_annotations_and_unfrozen_reads():
    model, example = kv_decoder(1)
    quantizer = PassQuantizer(AnnotateEveryOpQuantizer(), transform=[MarkMutableBuffers()],
                              after_annotate=[SkipAnnotateDataMovementOps()])
    prepare_pt2e(torch.export.export(model, example).module(), quantizer)
    (skip,) = quantizer.reports[-1].records
    # The two cache writes drop their cache's annotation and share the written value's
    # qparams; the transposed read of the k cache after the write shares them too.
    assert skip.statistics == {
        "buffer input annotations removed": 2,
        "buffer input annotations shared": 1,
        "outputs sharing qparams": 3,
    }
    assert len(skip.notes) == sum(v for k, v in skip.statistics.items() if k.startswith("outputs"))

    accumulator = Accumulator().eval()
    inputs = accumulator_inputs(3)
    prepared = prepare_pt2e(torch.export.export(accumulator, inputs[0]).module(),
                            AnnotateEveryOpQuantizer())
    with torch.no_grad():
        for args in inputs:
            prepared(*args)
    converted = convert_pt2e(prepared, fold_quantize=True)
    (unfreeze,) = PassManager([UnfreezeMutableBuffer()]).run(converted).report.records
    assert unfreeze.statistics == {"frozen buffer reads unfrozen": 1}
