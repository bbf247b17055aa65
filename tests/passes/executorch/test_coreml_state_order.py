"""coreml_state_order: the order of a functional program that coremltools 9.0 converts
when Core ML owns two or more of its buffers.

No lowering here (test_own_mutation_outputs.py and test_coreml_lowering.py lower these
programs with Core ML, which fails with ``KeyError`` without the reorder): the reordered
program computes what the original computes, bit for bit over several calls (outputs and
every buffer), its last op coremltools keeps computes no new state value, each buffer is
written from an op of its own, and a program that needs none of it comes back as it is.
"""

from __future__ import annotations

import pytest

pytest.importorskip("coremltools")  # tests.models.coreml_cases imports it

import torch

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch.coreml_state_order import coreml_state_order, needs_coreml_state_order
from tests.models.coreml_cases import CachesWrittenLast, CacheWrite, cache_inputs
from tests.models.shared_values import (
    ReturnsWrittenAndSum,
    WrittenTwice,
    WrittenTwiceAndReturned,
    vector_calls,
)

NEEDS = {
    "written_twice": (WrittenTwice, vector_calls),
    "written_twice_and_returned": (WrittenTwiceAndReturned, vector_calls),
    "caches_written_last": (CachesWrittenLast, cache_inputs),
}
NEEDS_NOT = {
    "one_cache": (CacheWrite, cache_inputs),
    "one_buffer_returned": (ReturnsWrittenAndSum, vector_calls),
}


def _functional(cls, inputs):
    ep = torch.export.export(cls(), inputs()[0])
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program


def _state_ops(ep) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The last call_function node and the op each buffer's new value comes from (through
    copies, which Core ML drops)."""
    returned = list(ep.graph.output_node().args[0])
    roots = []
    for value, spec in zip(returned, ep.graph_signature.output_specs, strict=True):
        if spec.kind.name == "BUFFER_MUTATION":
            while value.target in (torch.ops.aten.copy.default, torch.ops.aten.clone.default):
                is_copy = value.target == torch.ops.aten.copy.default
                value = value.args[1] if is_copy else value.args[0]
            roots.append(value)
    last = [n for n in ep.graph.nodes if n.op == "call_function"][-1]
    return last, roots


@pytest.mark.parametrize("case", NEEDS)
def test_reordered_program_computes_the_same_and_ends_on_a_user_output(case):
    cls, inputs = NEEDS[case]
    program = _functional(cls, inputs)
    assert needs_coreml_state_order(program)
    ordered = coreml_state_order(program)
    assert ordered is not program
    assert not needs_coreml_state_order(ordered)
    last, roots = _state_ops(ordered)
    assert len(set(roots)) == len(roots)  # each buffer written from its own op
    assert last not in roots
    # The original is untouched, and both compute what eager does.
    assert_same_behaviour(cls(), program, inputs())
    assert_same_behaviour(cls(), ordered, inputs())


def test_every_output_on_the_way_to_state_returns_through_maximum():
    """``v = tanh(out)`` is stored in two buffers and returned, and ``out`` leads to it:
    nothing but a new op can come last."""
    ordered = coreml_state_order(_functional(WrittenTwiceAndReturned, vector_calls))
    last = [n for n in ordered.graph.nodes if n.op == "call_function"][-1]
    assert last.target == torch.ops.aten.maximum.default and last.args[0] is last.args[1]
    assert last in ordered.graph.output_node().args[0]
    ordered.validate()  # torch's verifier accepts the signature naming it


@pytest.mark.parametrize("case", NEEDS_NOT)
def test_a_program_that_converts_as_it_is_comes_back_unchanged(case):
    cls, inputs = NEEDS_NOT[case]
    program = _functional(cls, inputs)
    assert not needs_coreml_state_order(program)
    assert coreml_state_order(program) is program
