"""to_delegate on programs holding higher-order ops (map, cond, while_loop, grad-mode and
autocast regions): a lowered op takes its bodies into the delegate's sub-program, and the
lowered program runs like the eager model, call after call, state included. What cannot
be lowered is a typed DelegationError naming the node, never a verifier crash."""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager, assert_same_behaviour
from passes import ConsumeBufferMutationsInDelegate, InplaceToFunctional, MarkMutableBuffers
from passes.delegation import (
    AllNodePartitioner,
    DelegationError,
    OpSupportPartitioner,
    PartitionError,
    delegates,
    partitions_to_delegates,
    program_state,
    to_delegate,
)
from tests.models.higher_order_ops import (
    HIGHER_ORDER_CASES,
    MapOverRows,
    WritesInNoGradRegion,
)


def _functional(model, example):
    ep = torch.export.export(copy.deepcopy(model), example)
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program


def _calls_to(program, op):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is op]


@pytest.mark.parametrize("case", sorted(HIGHER_ORDER_CASES))
def test_a_lowered_higher_order_op_runs_in_its_delegate_like_eager(case):
    model_class, op, calls = HIGHER_ORDER_CASES[case]
    eager = model_class()
    ep = _functional(eager, calls[0])
    assert _calls_to(ep, op), f"the exported program holds no {op.name()}"

    lowered = to_delegate(ep, AllNodePartitioner())
    lowered.validate()
    (delegate,) = delegates(lowered)
    (hop,) = _calls_to(delegate.program, op)
    bodies = [a for a in hop.all_input_nodes if a.op == "get_attr"]
    assert bodies and all(
        isinstance(delegate.program.graph_module.get_submodule(b.target), torch.fx.GraphModule)
        for b in bodies)
    # The top level keeps no op and no body: they moved with the partition.
    assert not _calls_to(lowered, op)
    assert [name for name, _ in lowered.graph_module.named_children()] == [delegate.name]
    assert_same_behaviour(eager, lowered, calls, state=program_state)

    consumed = PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered).program
    (owner,) = delegates(consumed)
    assert owner.owned_buffers  # the buffer the top level updated now lives in the delegate
    assert_same_behaviour(eager, consumed, calls, state=program_state)


@pytest.mark.parametrize("case", ["map", "cond", "while_loop"])
def test_ops_that_survive_run_decompositions_lower_from_torchs_functional_form(case):
    model_class, op, calls = HIGHER_ORDER_CASES[case]
    eager = model_class()
    ep = torch.export.export(copy.deepcopy(eager), calls[0]).run_decompositions({})
    assert _calls_to(ep, op)
    lowered = to_delegate(ep, AllNodePartitioner())
    assert_same_behaviour(eager, lowered, calls, state=program_state)


def test_a_body_also_called_outside_the_partition_is_read_twice():
    """Two maps share one body; only the first is lowered. The delegate reads the body
    through its own get_attr, the top level keeps it for the second map."""
    _, op, calls = HIGHER_ORDER_CASES["map"]

    class TwoMaps(MapOverRows):
        def forward(self, xs, y):
            return super().forward(super().forward(xs, y), y)

    eager = TwoMaps()
    ep = _functional(eager, calls[0])
    first, second = _calls_to(ep, op)
    shared, other = first.args[0], second.args[0]
    second.replace_input_with(other, shared)
    ep.graph.erase_node(other)
    ep.graph_module.delete_all_unused_submodules()
    ep.graph_module.recompile()
    assert_same_behaviour(eager, ep, calls, state=program_state)

    lowered = to_delegate(ep, OpSupportPartitioner(lambda node: node.name == first.name))
    lowered.validate()
    (delegate,) = delegates(lowered)
    (inside,) = _calls_to(delegate.program, op)
    (outside,) = _calls_to(lowered, op)
    assert inside.args[0].target == outside.args[0].target == shared.target
    assert_same_behaviour(eager, lowered, calls, state=program_state)


def test_a_partition_reading_a_plain_attribute_is_refused_naming_the_node():
    _, _, calls = HIGHER_ORDER_CASES["map"]
    ep = _functional(MapOverRows(), calls[0])
    gm = ep.graph_module
    gm.register_buffer("stray", torch.ones(2))
    output = gm.graph.output_node()
    with gm.graph.inserting_before(output):
        stray = gm.graph.get_attr("stray")
        added = gm.graph.call_function(torch.ops.aten.add.Tensor, (output.args[0][-1], stray))
    added.meta["val"] = output.args[0][-1].meta["val"]
    output.args = ((*output.args[0][:-1], added),)
    with pytest.raises(PartitionError) as info:
        to_delegate(ep, AllNodePartitioner())
    assert f"node {added.name} reads attribute 'stray'" in str(info.value)
    assert added.name in info.value.nodes


def test_a_sub_program_the_verifier_rejects_is_a_partition_error(monkeypatch):
    """The last line of defence: without carrying the bodies (the bug this file guards
    against), torch's verifier rejects the sub-program; the caller gets a typed error."""
    monkeypatch.setattr(partitions_to_delegates, "_with_subgraphs", lambda gm, tag, nodes: nodes)
    _, _, calls = HIGHER_ORDER_CASES["map"]
    with pytest.raises(PartitionError) as info:
        to_delegate(_functional(MapOverRows(), calls[0]), AllNodePartitioner())
    assert "fails torch's export verifier" in str(info.value)
    assert "body_graph_0" in str(info.value) and "map_impl" in info.value.nodes


def test_a_region_writing_a_buffer_in_its_body_is_refused_naming_the_node():
    ep = torch.export.export(WritesInNoGradRegion(), (torch.ones(2),))
    (region,) = _calls_to(ep, torch.ops.higher_order.wrap_with_set_grad_enabled)
    with pytest.raises(DelegationError) as info:
        to_delegate(ep, AllNodePartitioner())
    assert f"{region.name}: higher-order op wrap_with_set_grad_enabled writes b_acc" in str(
        info.value)
