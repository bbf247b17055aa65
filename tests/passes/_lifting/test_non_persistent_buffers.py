"""A non-persistent buffer (``register_buffer(..., persistent=False)``, as HF and ExecuTorch
register their caches) stays non-persistent through every pass and the lift: listed in
the signature's ``non_persistent_buffers``, held in ``ep.constants`` (not
``ep.state_dict``), and absent from ``ep.module().state_dict()``, exactly as the original
export has it. ``quantize_program`` used to make it persistent: torchao's ``prepare_pt2e``
re-registers every buffer of the graph module it copies as persistent.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager, assert_same_behaviour
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    UnfreezeMutableBuffer,
    exported_program_from,
)
from passes.flow.examples import AnnotateEveryOpQuantizer
from passes.quantization import quantize_program
from passes.quantize_mutable_buffers import QuantizeMutableBuffers
from tests.models.shared_values import NonPersistentCache, WrittenTwice, vector_calls

# The models' buffers (a quantized program adds folded weights, as buffers, beside them).
BUFFERS = {"cache", "count", "a", "b"}


def persistence(ep):
    """What says which buffers are persistent, everywhere an ExportedProgram says it."""
    return {
        "non_persistent_buffers": sorted(ep.graph_signature.non_persistent_buffers),
        "constants": sorted(k for k in ep.constants if k in BUFFERS),
        "state_dict": sorted(k for k in ep.state_dict if k in BUFFERS),
        "module": sorted(k for k in ep.module().state_dict() if k in BUFFERS),
    }


def graph_module_persistence(gm):
    return sorted(gm._non_persistent_buffers_set), sorted(gm.state_dict())


@pytest.fixture(scope="module")
def exported():
    calls = vector_calls()
    return torch.export.export(NonPersistentCache(), calls[0]), calls


def test_the_original_export(exported):
    ep, _ = exported
    assert persistence(ep) == {"non_persistent_buffers": ["cache"], "constants": ["cache"],
                               "state_dict": ["count"], "module": ["count"]}


PIPELINES = {
    "mark": [MarkMutableBuffers()],
    "functional": [MarkMutableBuffers(), InplaceToFunctional()],
}


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_each_pass_on_an_exported_program(exported, pipeline):
    ep, calls = exported
    result = PassManager(PIPELINES[pipeline]).run(copy.deepcopy(ep)).program
    assert persistence(result) == persistence(ep)
    assert_same_behaviour(NonPersistentCache(), result, calls)


@pytest.mark.parametrize("pipeline", [*PIPELINES, "unfreeze"])
def test_each_pass_on_a_graph_module_and_the_lift(exported, pipeline):
    ep, calls = exported
    passes = PIPELINES.get(pipeline) or [*PIPELINES["functional"], UnfreezeMutableBuffer()]
    gm = copy.deepcopy(ep).module()
    result = PassManager(passes).run(gm).program
    assert graph_module_persistence(result) == graph_module_persistence(ep.module())
    for like in (ep, None):
        lifted = exported_program_from(result, like=like)
        assert persistence(lifted) == persistence(ep)
        assert_same_behaviour(NonPersistentCache(), lifted, calls)


def test_quantize_program_and_quantized_state(exported):
    ep, calls = exported
    quantized = quantize_program(copy.deepcopy(ep), AnnotateEveryOpQuantizer(), calls)
    assert persistence(quantized) == persistence(ep)
    # QuantizeMutableBuffers on the quantized program, both forms: the cache now integer.
    for form in ("ep", "gm"):
        program = copy.deepcopy(quantized)
        program = program if form == "ep" else program.module()
        result = PassManager([MarkMutableBuffers(), InplaceToFunctional(),
                              QuantizeMutableBuffers(strict=True)]).run(program).program
        lifted = result if form == "ep" else exported_program_from(result, like=ep)
        assert persistence(lifted) == persistence(ep)
        assert lifted.constants["cache"].dtype == torch.uint8  # the quantizer's grid
        if form == "gm":
            assert graph_module_persistence(result)[0] == ["cache"]


def test_a_graph_module_copied_as_torchao_copies_it_is_lifted_like_its_program(exported):
    """prepare_pt2e copies the graph module (``GraphModule(root, graph)``), which registers
    every buffer as persistent; ``like`` says which are not."""
    ep, calls = exported
    gm = PassManager(PIPELINES["functional"]).run(copy.deepcopy(ep).module()).program
    copied = torch.fx.GraphModule(gm, gm.graph)
    assert graph_module_persistence(copied)[0] == []  # what the copy leaves
    lifted = exported_program_from(copied, like=ep)
    assert persistence(lifted) == persistence(ep)
    assert_same_behaviour(NonPersistentCache(), lifted, calls)


def test_written_twice_keeps_its_non_persistent_buffer():
    calls = vector_calls()
    ep = torch.export.export(WrittenTwice(), calls[0])
    functional = PassManager(PIPELINES["functional"]).run(copy.deepcopy(ep)).program
    assert persistence(functional) == persistence(ep)
    assert persistence(ep)["non_persistent_buffers"] == ["b"]
    lifted = exported_program_from(
        PassManager(PIPELINES["functional"]).run(copy.deepcopy(ep).module()).program, like=ep)
    assert persistence(lifted) == persistence(ep)
    assert_same_behaviour(WrittenTwice(), lifted, calls)
