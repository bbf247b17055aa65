"""The lift of a converted graph module that copies one value into two buffers.

``ep.module()`` (and InplaceToFunctional on a graph module) write one new value into two
buffers as two trailing ``copy_`` of one node; lifted, each becomes a mutation output of
its own (the second an ``aten.copy(state, value)``), where before both named one node and
torch's verifier rejected the program. Checked on the graph module torchao's convert
gives, as ``quantize_program`` lifts it: the lifted program computes exactly what the
graph module computes, call after call, outputs and buffers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pass_manager import PassManager, assert_same_behaviour
from pass_manager.validation import output_errors, run_program
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
    exported_program_from,
    reset_mutable_buffers,
)
from passes.flow.examples import xnnpack_quantizer
from passes.quantization import PassQuantizer, quantize_program
from tests.models.shared_values import WrittenTwice, WrittenTwiceAndReturned, vector_calls

CASES = {"written_twice": WrittenTwice, "written_twice_and_returned": WrittenTwiceAndReturned}


def _converted(ep, calls):
    quantizer = PassQuantizer(xnnpack_quantizer(),
                              transform=[MarkMutableBuffers(), InplaceToFunctional()],
                              after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_pt2e(copy.deepcopy(ep).module(), quantizer)
    with torch.no_grad():
        for args in calls:
            prepared(*args)
    reset_mutable_buffers(prepared)
    converted = convert_pt2e(prepared)
    return PassManager([UnfreezeMutableBuffer()]).run(converted).program


@pytest.mark.parametrize("case", CASES)
def test_a_converted_graph_module_lifts(case):
    cls = CASES[case]
    calls = vector_calls(calls=6)
    ep = torch.export.export(cls(), calls[0])
    converted = _converted(ep, calls)
    writes = [n for n in converted.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert {w.args[0].target for w in writes} == {"a", "b"}
    assert len({w.args[1] for w in writes}) == 1  # one value, written into both
    lifted = exported_program_from(converted, like=ep)
    assert set(lifted.graph_signature.buffers_to_mutate.values()) == {"a", "b"}
    assert_same_behaviour(converted, lifted, calls)
    assert_same_behaviour(converted, lifted.run_decompositions({}), calls)


@pytest.mark.parametrize("case", CASES)
def test_quantize_program_gives_a_valid_program(case):
    cls = CASES[case]
    calls = vector_calls(calls=6)
    ep = torch.export.export(cls(), calls[0])
    quantized = quantize_program(copy.deepcopy(ep), xnnpack_quantizer(), calls)
    assert set(quantized.graph_signature.buffers_to_mutate.values()) == {"a", "b"}
    signature = quantized.graph_signature
    assert signature.non_persistent_buffers == ep.graph_signature.non_persistent_buffers
    decomposed = quantized.run_decompositions({})
    assert_same_behaviour(quantized, decomposed, calls)
    # within the int8 grids' error of eager (outputs of a few units)
    assert max(output_errors(run_program(cls(), calls), run_program(quantized, calls))) < 0.3
