"""A reproducer's program file keeps what the passes read: annotations, marks, delegates,
frozen constants. Each program is saved, loaded, and both are run or passed the same way.
A marked ExportedProgram is saved in the safe format and loads without trust; the
GraphModules and delegated programs here are pickled and load with trusted=True."""

from __future__ import annotations

import copy

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
from passes.delegation import DELEGATION_TAG, AllNodePartitioner, delegates, to_delegate
from passes.delegation.ownership import program_state
from passes.flow.examples import AnnotateEveryOpQuantizer, decode_inputs, kv_decoder
from passes.quantization import PassQuantizer
from tests.models.accumulators import Accumulator, accumulator_inputs
from tests.models.higher_order_ops import HIGHER_ORDER_CASES

ANNOTATION = "quantization_annotation"
MARKS = ("mutable_buffer", DELEGATION_TAG)


def _round_trip(program, path):
    # These programs are pickled (a GraphModule, a delegate call): reading them needs trust.
    assert save_program(program, path).format == "pickled"
    return load_program(path, trusted=True)


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


def test_marked_exported_program_loads_untrusted_and_the_passes_treat_it_the_same(tmp_path):
    model, example = kv_decoder(1)
    ep = PassManager([MarkMutableBuffers()]).run(torch.export.export(model, example)).program
    AllNodePartitioner()(ep)  # delegation tags: node meta torch.export.save does not keep
    saved = save_program(ep, tmp_path / "marked.pt")
    assert (saved.format, saved.dropped) == ("exported", [])
    loaded = load_program(tmp_path / "marked.pt")
    marked = 0
    for before, after in zip(ep.graph.nodes, loaded.graph.nodes, strict=True):
        assert [before.meta.get(k) for k in MARKS] == [after.meta.get(k) for k in MARKS]
        if "mutable_buffer_initial" in before.meta:
            marked += 1
            assert torch.equal(before.meta["mutable_buffer_initial"],
                               after.meta["mutable_buffer_initial"])
    assert marked == 2  # the two caches
    expected = PassManager([InplaceToFunctional()]).run(ep).program
    actual = PassManager([InplaceToFunctional()]).run(loaded).program
    assert program_text(actual) == program_text(expected)
    calls = decode_inputs(model.cfg, 3)
    assert first_difference(run_program(expected, calls, state=program_state),
                            run_program(actual, calls, state=program_state)) is None


def test_a_program_with_a_higher_order_op_loads_untrusted_and_lowers_the_same(tmp_path):
    model_class, _, calls = HIGHER_ORDER_CASES["map"]
    ep = torch.export.export(model_class(), calls[0])
    ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    assert save_program(ep, tmp_path / "map.pt").format == "exported"
    loaded = load_program(tmp_path / "map.pt")
    expected = to_delegate(copy.deepcopy(ep), AllNodePartitioner())
    actual = to_delegate(loaded, AllNodePartitioner())
    assert len(delegates(actual)) == 1
    assert first_difference(run_program(expected, calls, state=program_state),
                            run_program(actual, calls, state=program_state)) is None
