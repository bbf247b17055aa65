"""to_delegate, the partitioners and the reference backend, before any buffer consumption.

A lowered program must stay a valid ExportedProgram, run through ``ep.module()`` like
the eager module for several calls in a row (state included), and keep its buffer
updates at the top level: delegates take buffers as inputs and return new values.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.operator_support import create_op_support

from pass_manager import PassManager, PassManagerError, assert_same_behaviour
from pass_manager.program import program_text
from passes import ConsumeBufferMutationsInDelegate, InplaceToFunctional, MarkMutableBuffers
from passes.delegation import (
    DELEGATION_TAG,
    AllNodePartitioner,
    DelegationError,
    LoweredBackendModule,
    OpSupportPartitioner,
    PartitionError,
    call_delegate,
    delegates,
    program_state,
    to_delegate,
)
from passes.flow.examples import decode_inputs, kv_decoder

aten = torch.ops.aten
CALLS = 4


@pytest.fixture(scope="module")
def decoder():
    model, example = kv_decoder(2)
    ep = torch.export.export(copy.deepcopy(model), example).run_decompositions({})
    return model, ep, decode_inputs(model.cfg, CALLS, start=5)


def test_op_support_partitioner_tags_supported_nodes(decoder):
    _, ep, _ = decoder
    work = copy.deepcopy(ep)
    partitions = OpSupportPartitioner([aten.index_copy.default])(work)
    # Two layers depend on each other through unsupported ops: one partition per layer.
    assert {tag: [n.name for n in nodes] for tag, nodes in partitions.items()} == {
        "delegate_0": ["index_copy", "index_copy_1"],
        "delegate_1": ["index_copy_2", "index_copy_3"],
    }
    tagged = [n for n in work.graph.nodes if DELEGATION_TAG in n.meta]
    assert all(n.target is aten.index_copy.default for n in tagged) and len(tagged) == 4


@pytest.mark.parametrize(
    "supported",
    [
        aten.index_copy,
        lambda node: node.target is aten.index_copy.default,
        create_op_support(lambda _, node: node.target is aten.index_copy.default),
    ],
    ids=["packet", "predicate", "operator_support"],
)
def test_op_support_partitioner_accepts_every_kind_of_support(decoder, supported):
    _, ep, _ = decoder
    partitions = OpSupportPartitioner(supported, tag_prefix="npu")(copy.deepcopy(ep))
    assert sorted(partitions) == ["npu_0", "npu_1"]


def test_all_node_partitioner_makes_one_partition(decoder):
    _, ep, _ = decoder
    work = copy.deepcopy(ep)
    partitions = AllNodePartitioner()(work)
    compute = [n for n in work.graph.nodes if n.op == "call_function"]
    assert list(partitions) == ["delegate_0"] and partitions["delegate_0"] == compute


class _TwoIndependentUpdates(nn.Module):
    """Two computations that share no node: a counter update and an unrelated output."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x, y):
        self.count.add_(x)
        return self.count * 2, y.sin()


def test_all_node_partitioner_groups_unconnected_computations_in_one_delegate():
    eager = _TwoIndependentUpdates()
    calls = [(torch.randn(3), torch.randn(2)) for _ in range(CALLS)]
    ep = torch.export.export(copy.deepcopy(eager), calls[0]).run_decompositions({})
    lowered = to_delegate(ep, AllNodePartitioner())
    assert [d.tag for d in delegates(lowered)] == ["delegate_0"]
    assert not [n for n in lowered.graph.nodes if n.op == "call_function"
                and n.target not in (call_delegate, operator.getitem)]
    assert_same_behaviour(eager, lowered, calls)


class _DecaysItsWeight(nn.Module):
    """Writes a frozen parameter in place (a PARAMETER_MUTATION once functional) and a
    buffer from it; a second parameter is only read."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0, 1, 4), requires_grad=False)
        self.bias = nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.weight.mul_(0.5).add_(x)
        self.total.add_(self.weight)
        return self.weight * 2 + self.total + self.bias


def _weight_and_buffers(module):
    state = program_state(module)
    state["weight"] = module.get_parameter("weight").detach().clone()
    return state


@pytest.mark.parametrize("functionalize", ["passes", "run_decompositions"])
def test_a_written_parameter_stays_top_level_state(functionalize):
    eager = _DecaysItsWeight()
    calls = [(torch.randn(4),) for _ in range(CALLS)]
    ep = torch.export.export(copy.deepcopy(eager), calls[0])
    if functionalize == "passes":
        ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    else:
        ep = ep.run_decompositions({})
    lowered = to_delegate(ep, AllNodePartitioner())
    lowered.validate()
    # The read-only parameter moves into the delegate; the written one cannot, because
    # the top level returns its new value as a PARAMETER_MUTATION.
    params = [s.target for s in lowered.graph_signature.input_specs
              if s.kind == InputKind.PARAMETER]
    assert params == ["weight"]
    assert [(s.kind, s.target) for s in lowered.graph_signature.output_specs][:2] == [
        (OutputKind.PARAMETER_MUTATION, "weight"), (OutputKind.BUFFER_MUTATION, "total")]
    assert_same_behaviour(eager, lowered, calls, state=_weight_and_buffers)
    consumed = PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered).program
    (delegate,) = delegates(consumed)
    assert list(delegate.owned_buffers) == ["total"]
    assert_same_behaviour(eager, consumed, calls, state=_weight_and_buffers)


@pytest.mark.parametrize(
    "partitioner",
    [AllNodePartitioner(), OpSupportPartitioner([aten.index_copy])],
    ids=["everything", "cache_update"],
)
def test_lowered_program_keeps_buffer_updates_at_top_level(decoder, partitioner):
    eager, ep, inputs = decoder
    before = program_text(ep)
    lowered = to_delegate(ep, partitioner)
    assert program_text(ep) == before
    assert not [n for n in ep.graph.nodes if DELEGATION_TAG in n.meta]
    lowered.validate()

    sig = lowered.graph_signature
    buffers = [s.target for s in sig.input_specs if s.kind == InputKind.BUFFER]
    assert sorted(buffers) == sorted(f"layers.{i}.attn.{c}_cache" for i in range(2) for c in "kv")
    outputs = lowered.graph.output_node().args[0]
    returned = dict(zip((s.arg.name for s in sig.output_specs), outputs, strict=True))
    for spec in sig.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            value = returned[spec.arg.name]
            assert value.target is operator.getitem and value.args[0].target is call_delegate
    for d in delegates(lowered):
        assert isinstance(d.module, LoweredBackendModule) and d.tag.startswith("delegate_")
        kinds = {s.kind for s in d.program.graph_signature.input_specs}
        assert InputKind.BUFFER not in kinds
        assert {s.kind for s in d.program.graph_signature.output_specs} == {OutputKind.USER_OUTPUT}
        assert d.owned_buffers == {}
    assert_same_behaviour(eager, lowered, inputs)
    assert_same_behaviour(eager, lowered, inputs, state=program_state)


def test_parameters_used_only_by_a_delegate_move_into_it(decoder):
    _, ep, _ = decoder
    everything = to_delegate(ep, AllNodePartitioner())
    specs = everything.graph_signature.input_specs
    assert InputKind.PARAMETER not in [s.kind for s in specs]
    assert set(everything.state_dict) == {s.target for s in specs if s.kind == InputKind.BUFFER}
    (delegate,) = delegates(everything)
    params = [s.target for s in delegate.program.graph_signature.input_specs
              if s.kind == InputKind.PARAMETER]
    assert "layers.0.attn.wq.weight" in params and "out.weight" in params
    assert isinstance(delegate.program.state_dict["out.weight"], nn.Parameter)

    partial = to_delegate(ep, OpSupportPartitioner([aten.index_copy]))
    assert "out.weight" in partial.state_dict


def test_lowered_module_runs_repeatedly_with_state(decoder):
    eager, ep, inputs = decoder
    eager = copy.deepcopy(eager)
    module = copy.deepcopy(to_delegate(ep, AllNodePartitioner())).module()
    with torch.no_grad():
        for args in inputs:
            torch.testing.assert_close(module(*args), eager(*args), rtol=0, atol=0)
    expected = dict(eager.named_buffers())
    for name, value in module.named_buffers():
        assert torch.equal(value, expected[name]), name


def test_delegate_for_a_backend_without_a_runtime_is_a_typed_error(decoder):
    _, ep, inputs = decoder
    lowered = to_delegate(ep, AllNodePartitioner(), backend_id="npu_without_runtime_here")
    with pytest.raises(DelegationError, match="npu_without_runtime_here"):
        lowered.module()(*inputs[0])


def test_retracing_a_lowered_program_keeps_the_delegate(decoder):
    eager, ep, inputs = decoder
    lowered = to_delegate(ep, OpSupportPartitioner([aten.index_copy]))
    retraced = copy.deepcopy(lowered).run_decompositions({})
    assert len(delegates(retraced)) == 2
    assert_same_behaviour(eager, retraced, inputs)


class Diamond(nn.Module):
    def forward(self, x):
        a = x + 1
        b = torch.relu(a)
        return a * b


def test_partition_that_would_create_a_cycle_is_rejected():
    ep = torch.export.export(Diamond(), (torch.randn(3),)).run_decompositions({})

    def add_and_mul(program):
        for node in program.graph.nodes:
            if node.target in (aten.add.Tensor, aten.mul.Tensor):
                node.meta[DELEGATION_TAG] = "outer"

    with pytest.raises(PartitionError) as raised:
        to_delegate(ep, add_and_mul)
    assert raised.value.tag == "outer" and raised.value.nodes == ["add", "mul"]
    assert isinstance(raised.value, PassManagerError)


def test_program_with_in_place_writes_is_rejected():
    model, example = kv_decoder(1)
    ep = torch.export.export(model, example)
    with pytest.raises(DelegationError, match="index_copy_"):
        to_delegate(ep, AllNodePartitioner())


def test_untagged_program_gets_no_delegate(decoder):
    eager, ep, inputs = decoder
    lowered = to_delegate(ep, lambda program: None)
    assert delegates(lowered) == []
    assert_same_behaviour(eager, lowered, inputs)


def test_lowering_twice_keeps_earlier_delegates(decoder):
    eager, ep, inputs = decoder
    once = to_delegate(ep, OpSupportPartitioner([aten.index_copy], tag_prefix="cache"))
    twice = to_delegate(once, AllNodePartitioner(tag_prefix="rest"))
    tags = [d.tag for d in delegates(twice)]
    assert tags.count("cache_0") == 1 and tags.count("cache_1") == 1
    assert any(t.startswith("rest_") for t in tags)
    assert_same_behaviour(eager, twice, inputs)

    def everything_tagged(program):
        for node in program.graph.nodes:
            if node.op == "call_function":
                node.meta[DELEGATION_TAG] = "all"

    with pytest.raises(PartitionError, match="earlier lowering"):
        to_delegate(once, everything_tagged)


class _SplitsItsCache(nn.Module):
    """A cache written, halved, then split in two: the ``split`` and its ``getitem``
    nodes are separate nodes a partitioner may tag apart."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x.unsqueeze(0))
        self.cache.mul_(0.5)
        first, second = self.cache.split(2)
        return torch.stack([first, second]).sum(0), second.sum()


@pytest.mark.parametrize("getitem_tag", ["other", None], ids=["in_another", "at_top_level"])
def test_a_split_and_its_getitems_tagged_apart_lower_together(getitem_tag):
    """The partitioner puts ``split`` in one partition and its ``getitem`` nodes in
    another: lowering the first pulled them in and the second then failed on nodes no
    longer in the graph (an untyped ``KeyError: getitem_2`` on main). Left at the top
    level they were pulled in already. A ``getitem`` goes with its source, so the tuple
    stays inside one delegate; the program runs like eager, state included, and after
    its buffer consumption too."""
    eager = _SplitsItsCache()
    calls = [(torch.randn(3, generator=torch.Generator().manual_seed(i)), torch.tensor([i % 4]))
             for i in range(CALLS)]
    ep = torch.export.export(copy.deepcopy(eager), calls[0]).run_decompositions({})

    def partitioner(program):
        for node in program.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is operator.getitem:
                if getitem_tag is not None:
                    node.meta[DELEGATION_TAG] = getitem_tag
            elif node.target.overloadpacket in (aten.stack, aten.sum):
                node.meta[DELEGATION_TAG] = "other"
            else:
                node.meta[DELEGATION_TAG] = "writes"

    lowered = to_delegate(ep, partitioner)
    assert sorted(d.tag for d in delegates(lowered)) == ["other", "writes"]
    assert_same_behaviour(copy.deepcopy(eager), lowered, calls, state=program_state)
    consumed = PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered).program
    assert_same_behaviour(copy.deepcopy(eager), consumed, calls, state=program_state)
