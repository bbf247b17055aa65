"""ConsumeBufferMutationsInDelegate: buffers move into the delegate that updates them.

Every behaviour test lowers a real exported module, runs the pass, calls the result 4
times (changing cache positions for the decoder) and compares outputs and every buffer
(read from the top level or from the delegate owning it) with the eager module, exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from pass_manager import (
    EXPORTED_PROGRAM,
    PassFailedError,
    PassManager,
    ProgramFormError,
    assert_same_behaviour,
    function_pass,
)
from pass_manager.program import program_text
from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
    mutable_buffers,
    reset_mutable_buffers,
)
from passes.conditions import BufferMutationsInDelegates, Functional
from passes.delegation import (
    DELEGATION_TAG,
    AllNodePartitioner,
    BufferAliasingError,
    BufferConsumptionError,
    OpSupportPartitioner,
    delegates,
    program_state,
    to_delegate,
)
from passes.flow.examples import decode_inputs, kv_decoder
from tests.models.accumulators import ReadBeforeUpdate, TwoBuffers

aten = torch.ops.aten
CALLS = 4


# -- partitioners of the correctness bar ------------------------------------------------
def _module_path(node: torch.fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()), ("", ""))


def in_attention(node: torch.fx.Node) -> bool:
    """Attention ops proper: the cache update and everything reading it, not the projections."""
    return str(_module_path(node)[1]).endswith("Attention")


def update_then_attention(ep) -> None:
    """Two partitions per layer: the cache update, and the attention ops reading the cache."""
    for node in ep.graph.nodes:
        if node.op != "call_function" or not in_attention(node):
            continue
        layer = _module_path(node)[0]
        if node.target in (aten.index_copy.default, aten.index_put.default):
            node.meta[DELEGATION_TAG] = f"update:{layer}"
        elif any(str(a.meta.get(DELEGATION_TAG, "")).endswith(layer) for a in node.all_input_nodes):
            node.meta[DELEGATION_TAG] = f"attention:{layer}"


PARTITIONERS = {
    "everything": AllNodePartitioner(),
    "attention": OpSupportPartitioner(in_attention),
    "cache_update": OpSupportPartitioner([aten.index_copy, aten.index_put]),
    "two_partitions": update_then_attention,
}


@pytest.fixture(scope="module")
def decoders():
    """``(eager, functional ExportedProgram, inputs)`` per (layers, cache_update), exported once."""
    cache: dict = {}

    def get(n_layers: int, cache_update: str = "index_copy"):
        key = (n_layers, cache_update)
        if key not in cache:
            model, example = kv_decoder(n_layers, cache_update=cache_update)
            ep = torch.export.export(copy.deepcopy(model), example).run_decompositions({})
            cache[key] = (model, ep, decode_inputs(model.cfg, CALLS, start=2))
        return cache[key]

    return get


def lower_and_consume(ep, partitioner, **options):
    lowered = to_delegate(ep, partitioner)
    return lowered, PassManager([ConsumeBufferMutationsInDelegate(**options)]).run(lowered)


def owners(program) -> dict[str, str]:
    """FQN -> tag of the delegate owning it, with the sub-program signature checked."""
    found = {}
    for d in delegates(program):
        sig = d.program.graph_signature
        consumed = {s.target for s in sig.input_specs if s.kind == InputKind.BUFFER}
        mutated = {s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
        assert consumed == mutated, d.tag
        found.update(dict.fromkeys(consumed, d.tag))
    return found


@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
@pytest.mark.parametrize("n_layers", [1, 4])
def test_decoder_caches_move_into_delegates(decoders, n_layers, partitioner):
    eager, ep, inputs = decoders(n_layers)
    _, result = lower_and_consume(ep, PARTITIONERS[partitioner])
    program = result.program
    caches = {f"layers.{i}.attn.{c}_cache" for i in range(n_layers) for c in "kv"}

    sig = program.graph_signature
    assert not [s for s in sig.input_specs if s.kind == InputKind.BUFFER]
    assert not [s for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
    assert caches.isdisjoint(program.state_dict)
    owned = owners(program)
    assert set(owned) == caches
    per_layer = {"everything": 0, "attention": 1, "cache_update": 1, "two_partitions": 2}
    assert len(delegates(program)) == max(1, per_layer[partitioner] * n_layers)
    if partitioner != "everything":
        # One delegate per layer owns both of its caches.
        assert len(set(owned.values())) == n_layers
    assert BufferMutationsInDelegates.check(program) == []
    assert_same_behaviour(eager, program, inputs, state=program_state)


def test_index_put_cache_update_only(decoders):
    eager, ep, inputs = decoders(1, "index_put")
    _, result = lower_and_consume(ep, PARTITIONERS["cache_update"])
    assert set(owners(result.program)) == {"layers.0.attn.k_cache", "layers.0.attn.v_cache"}
    # The attention outside still reads the new cache: the delegate returns it as well.
    assert all("returns its new value" in note for note in result.report.records[0].notes)
    assert_same_behaviour(eager, result.program, inputs, state=program_state)


@pytest.mark.parametrize("cache_update", ["index_copy", "index_put"])
def test_pipeline_from_raw_export(cache_update):
    """MarkMutableBuffers + InplaceToFunctional instead of run_decompositions, then delegation."""
    model, example = kv_decoder(1, cache_update=cache_update, seed=1)
    lower = function_pass(
        lambda ep: to_delegate(ep, PARTITIONERS["cache_update"]),
        requires={Functional},
        accepts=(EXPORTED_PROGRAM,),
        name="to_delegate",
    )
    pipeline = PassManager(
        [MarkMutableBuffers(), InplaceToFunctional(), lower, ConsumeBufferMutationsInDelegate()]
    )
    result = pipeline.run(torch.export.export(copy.deepcopy(model), example))
    program = result.program
    caches = {"layers.0.attn.k_cache", "layers.0.attn.v_cache"}
    assert set(owners(program)) == caches and mutable_buffers(program) == {}
    (delegate,) = delegates(program)
    assert set(mutable_buffers(delegate.program)) == caches
    inputs = decode_inputs(model.cfg, CALLS, seed=1, start=6)
    assert_same_behaviour(model, program, inputs, state=program_state)

    # The delegate's sub-program keeps the marks, so its state resets like any program's.
    module = program.module()
    with torch.no_grad():
        module(*inputs[0])
    assert any(t.abs().sum() > 0 for t in delegate.owned_buffers.values())
    reset_mutable_buffers(delegate.program)
    assert all(t.abs().sum() == 0 for t in program_state(module).values())


def test_final_cache_values_are_read_from_the_owning_delegate(decoders):
    eager, ep, inputs = decoders(1)
    eager = copy.deepcopy(eager)
    _, result = lower_and_consume(ep, PARTITIONERS["attention"])
    module = copy.deepcopy(result.program).module()
    with torch.no_grad():
        for args in inputs:
            torch.testing.assert_close(module(*args), eager(*args), rtol=0, atol=0)
    (delegate,) = delegates(module)
    expected = dict(eager.named_buffers())
    assert set(delegate.owned_buffers) == set(expected)
    for fqn, value in delegate.owned_buffers.items():
        assert torch.equal(value, expected[fqn]), fqn
    assert delegate.owned_buffers["layers.0.attn.k_cache"][:, :, 2:2 + CALLS].abs().sum() > 0


def test_condition_lists_consumable_buffers_before_the_pass(decoders):
    _, ep, _ = decoders(1)
    lowered, result = lower_and_consume(ep, PARTITIONERS["everything"])
    violations = BufferMutationsInDelegates.check(lowered)
    assert len(violations) == 2 and "layers.0.attn.k_cache" in violations[0]
    again = PassManager([ConsumeBufferMutationsInDelegate()]).run(result.program)
    assert not again.modified


def test_graph_module_is_rejected(decoders):
    _, ep, _ = decoders(1)
    lowered = to_delegate(ep, PARTITIONERS["everything"])
    with pytest.raises(ProgramFormError):
        PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered.module())


# -- small models, one per rule ---------------------------------------------------------
def tag(rules):
    """A partitioner tagging each call_function node with the first matching rule's tag."""

    def partitioner(ep):
        for node in ep.graph.nodes:
            for matches, name in rules:
                if node.op == "call_function" and matches(node):
                    node.meta[DELEGATION_TAG] = name
                    break

    return partitioner


def is_op(op, first_arg_placeholder=None):
    def matches(node):
        if node.target != op:
            return False
        return first_arg_placeholder is None or (
            (node.args[0].op == "placeholder") == first_arg_placeholder
        )

    return matches


class ReturnsState(nn.Module):
    """Returns the accumulator it updates; also counts calls in a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        self.acc.add_(x)
        self.calls.add_(1)
        return self.acc, self.calls * 10


class TwoUpdates(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(4))

    def forward(self, x):
        self.state.add_(x)
        self.state.mul_(2)
        return self.state.sum()


class ViewOfOldValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(3, 4))

    def forward(self, x):
        first_row = self.state[0] * 2
        self.state.add_(x)
        return first_row + self.state.sum()


def _export(model):
    eager = copy.deepcopy(model)
    ep = torch.export.export(model, (torch.ones(4),)).run_decompositions({})
    calls = [(torch.randn(4, generator=torch.Generator().manual_seed(i)),) for i in range(CALLS)]
    return eager, ep, calls


def test_returned_state_is_consumed_and_returned_by_the_delegate():
    eager, ep, calls = _export(ReturnsState())
    _, result = lower_and_consume(ep, AllNodePartitioner(), strict=True)
    (delegate,) = delegates(result.program)
    sig = delegate.program.graph_signature
    mutation = next(s for s in sig.output_specs if s.target == "acc")
    returned = [s for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT]
    assert mutation.kind == OutputKind.BUFFER_MUTATION
    assert mutation.arg.name in [s.arg.name for s in returned]
    assert "calls" in delegate.program.constants  # non-persistent: a constant, not state_dict
    assert owners(result.program) == {"acc": "delegate_0", "calls": "delegate_0"}
    assert [s.kind for s in result.program.graph_signature.output_specs] == [
        OutputKind.USER_OUTPUT,
        OutputKind.USER_OUTPUT,
    ]
    assert_same_behaviour(eager, result.program, calls, state=program_state)
    # The sub-program is an ExportedProgram in its own right: valid, and runnable alone.
    delegate.program.validate()
    assert_same_behaviour(eager, delegate.program, calls)


@pytest.mark.parametrize(
    "model, rules, reason, partitions",
    [
        (
            ReadBeforeUpdate,
            [(is_op(aten.add.Tensor, True), "writer")],
            "read outside the delegate that mutates it, by node mul",
            ["writer"],
        ),
        (
            ReadBeforeUpdate,
            [(is_op(aten.mul.Tensor), "reader"), (is_op(aten.add.Tensor), "writer")],
            "read outside the delegate that mutates it, by delegate 'reader'",
            ["reader", "writer"],
        ),
        (
            TwoUpdates,
            [(is_op(aten.add.Tensor), "first"), (is_op(aten.mul.Tensor), "second")],
            "mutated in 2 delegates (first, second)",
            ["first", "second"],
        ),
    ],
    ids=["read_at_top_level", "read_in_two_partitions", "mutated_in_two_partitions"],
)
def test_unconsumable_buffer_stays_at_top_level(model, rules, reason, partitions):
    eager, ep, calls = _export(model())
    lowered, result = lower_and_consume(ep, tag(rules))
    assert not result.modified
    (note,) = result.report.records[0].notes
    assert "kept 'state'" in note and reason in note
    kinds = {s.target: s.kind for s in result.program.graph_signature.output_specs if s.target}
    assert kinds == {"state": OutputKind.BUFFER_MUTATION}
    assert owners(result.program) == {}
    assert_same_behaviour(eager, result.program, calls, state=program_state)

    with pytest.raises(BufferConsumptionError) as raised:
        ConsumeBufferMutationsInDelegate(strict=True).call(lowered)
    assert raised.value.buffer == "state" and raised.value.partitions == partitions
    assert "'state'" in str(raised.value) and partitions[0] in str(raised.value)


def test_buffer_updated_outside_delegates_is_not_an_error_even_when_strict():
    eager, ep, calls = _export(ReadBeforeUpdate())
    _, result = lower_and_consume(ep, tag([(is_op(aten.mul.Tensor), "reader")]), strict=True)
    (note,) = result.report.records[0].notes
    assert "computed outside any delegate" in note
    assert_same_behaviour(eager, result.program, calls, state=program_state)


def test_view_of_the_old_value_leaving_the_delegate_is_an_aliasing_error():
    _, ep, _ = _export(ViewOfOldValue())
    rules = [(is_op(aten.select.int), "d"), (is_op(aten.add.Tensor, True), "d")]
    lowered = to_delegate(ep, tag(rules))
    before = program_text(lowered)
    with pytest.raises(BufferAliasingError) as raised:
        ConsumeBufferMutationsInDelegate().call(lowered)
    assert raised.value.buffer == "state" and raised.value.partition == "d"
    assert "select" in str(raised.value)
    with pytest.raises(PassFailedError) as wrapped:
        PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered)
    assert isinstance(wrapped.value.__cause__, BufferAliasingError)
    assert program_text(lowered) == before


def test_state_sharing_storage_is_an_aliasing_error():
    _, ep, _ = _export(TwoBuffers())
    ep.state_dict["b"] = ep.state_dict["a"]
    lowered = to_delegate(ep, AllNodePartitioner())
    before = program_text(lowered)
    with pytest.raises(BufferAliasingError, match="shares storage with 'b'"):
        ConsumeBufferMutationsInDelegate().call(lowered)
    assert program_text(lowered) == before
    assert "a" in lowered.state_dict
