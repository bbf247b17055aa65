"""A reproducer's program file keeps what the passes read: annotations, marks, delegates,
frozen constants. Each program is saved, loaded, and both are run or passed the same way."""

from __future__ import annotations

import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pass_manager import PassManager, first_difference, load_program, run_program, save_program
from pass_manager.program import program_text
from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
)
from passes.delegation import AllNodePartitioner, to_delegate
from passes.delegation.ownership import program_state
from passes.flow.examples import AnnotateEveryOpQuantizer, decode_inputs, kv_decoder
from passes.quantization import PassQuantizer
from tests.models.accumulators import Accumulator, accumulator_inputs

ANNOTATION = "quantization_annotation"


def _round_trip(program, path):
    save_program(program, path)
    return load_program(path)


def test_annotated_graph_keeps_its_annotations_and_marks(tmp_path):
    saved = {}

    def keep(gm):
        saved["program"] = _round_trip(gm, tmp_path / "annotated.pt")
        saved["text"] = program_text(gm)
        saved["annotated"] = sum(ANNOTATION in n.meta for n in gm.graph.nodes)

    model, example = kv_decoder(1)
    quantizer = PassQuantizer(AnnotateEveryOpQuantizer(), transform=[MarkMutableBuffers()],
                              after_annotate=[keep])
    prepare_pt2e(torch.export.export(model, example).module(), quantizer)
    loaded = saved["program"]
    assert program_text(loaded) == saved["text"]
    assert sum(ANNOTATION in n.meta for n in loaded.graph.nodes) == saved["annotated"] > 0
    # Annotation keys are nodes of the loaded graph, so the pass finds the cache edges.
    (record,) = PassManager([SkipAnnotateDataMovementOps()]).run(loaded).report.records
    assert record.statistics["buffer input annotations removed"] == 2


def test_converted_program_with_frozen_constants_runs_the_same(tmp_path):
    model, inputs = Accumulator().eval(), accumulator_inputs(4)
    prepared = prepare_pt2e(torch.export.export(model, inputs[0]).module(),
                            AnnotateEveryOpQuantizer())
    with torch.no_grad():
        for args in inputs:
            prepared(*args)
    converted = convert_pt2e(prepared, fold_quantize=True)
    loaded = _round_trip(converted, tmp_path / "converted.pt")
    assert first_difference(run_program(converted, inputs), run_program(loaded, inputs)) is None
    (record,) = PassManager([UnfreezeMutableBuffer()]).run(loaded).report.records
    assert record.statistics == {"frozen buffer reads unfrozen": 1}


def test_delegated_program_round_trips_with_its_sub_programs(tmp_path):
    model, example = kv_decoder(1)
    ep = torch.export.export(model, example)
    ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    lowered = to_delegate(ep, AllNodePartitioner())
    loaded = _round_trip(lowered, tmp_path / "lowered.pt")
    calls = decode_inputs(model.cfg, 3)
    expected = PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered).program
    actual = PassManager([ConsumeBufferMutationsInDelegate()]).run(loaded).program
    assert first_difference(run_program(expected, calls, state=program_state),
                            run_program(actual, calls, state=program_state)) is None
