"""The copies BufferOwningPartitioner adds: only for a use of a new buffer value outside its owner.

Each case lowers the built-in one-layer decoder (or a returned accumulator) with
``to_edge_transform_and_lower`` and ``to_executorch()``, counts the whole-buffer copies the
program makes per call (in delegates and at the top level) next to ExecuTorch alone, and
checks that the lowered program still decodes exactly: 4 calls against an eager deep copy,
outputs and every buffer wherever it lives.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
from torch.export.graph_signature import InputKind

from pass_manager import assert_same_behaviour
from passes.delegation import BufferConsumptionError
from passes.examples import decoder_job
from passes.executorch import BufferOwningPartitioner, executorch_state
from passes.executorch.new_value_copies import buffer_neighbourhood, functional
from tests.models.executorch_cases import (
    DEMO_BACKEND,
    OpPartitioner,
    ReturnsBuffer,
    everything,
    vector_inputs,
    whole_buffer_copies,
)

CACHES = frozenset({"layers.0.attn.k_cache", "layers.0.attn.v_cache"})
ATOL = 1e-5  # ExecuTorch's Edge decompositions round a little differently from eager


def _decoder():
    model, _, steps = decoder_job(n_layers=1, steps=4)
    return model, steps


def _returns_buffer():
    return ReturnsBuffer(), vector_inputs()


# name -> (model and calls, partitioner, copies with ExecuTorch alone (None: it fails),
#          copies wrapped, the buffers owned, the buffers whose new value gets a copy)
CASES = {
    "owning": (_decoder, everything, Counter(), Counter(), CACHES, set()),
    "not_owning": (_decoder, XnnpackPartitioner, Counter({"top level": 2}),
                   Counter({"top level": 2}), set(), set()),
    # The functional program already gives the mutation its own value (aten.copy): the
    # wrapper has nothing left to copy.
    "user_output": (_returns_buffer, everything, None, Counter({"delegate": 1}), {"acc"},
                    set()),
    "update_only": (_decoder, lambda: OpPartitioner({"index_put": "update"}), None,
                    Counter({"delegate": 2}), CACHES, CACHES),
}


def _lower(model, calls, partitioner):
    ep = torch.export.export(copy.deepcopy(model), calls[0])
    with torch.no_grad():  # to_executorch writes buffers back in place
        return to_edge_transform_and_lower(ep, partitioner=[partitioner])


def _owned(wrapper: BufferOwningPartitioner) -> set[str]:
    return {v.fqn for v in wrapper.ownership if v.consumable}


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_buffer_copies_per_call_next_to_executorch_alone(case):
    make, partitioner, alone, wrapped_copies, owned, copied = CASES[case]
    model, calls = make()
    wrapper = BufferOwningPartitioner(partitioner())
    lowered = _lower(model, calls, wrapper)
    assert_same_behaviour(model, lowered.exported_program(), calls, atol=ATOL,
                          state=executorch_state)
    assert _owned(wrapper) == owned
    assert wrapper.copy_plan.copied == copied
    with torch.no_grad():
        assert whole_buffer_copies(lowered.to_executorch(), model) == wrapped_copies
    if alone is not None:
        with torch.no_grad():
            assert whole_buffer_copies(_lower(model, calls, partitioner()).to_executorch(),
                                       model) == alone


def _values(ep, feeds):
    """Every node's value when ``ep``'s graph runs on ``feeds`` (placeholder name -> value)."""
    values = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, node):
            values[node.name] = feeds[node.name] if node.op == "placeholder" else (
                super().run_node(node))
            return values[node.name]

    Record(ep.graph_module).run(*[feeds[n.name] for n in ep.graph.nodes if n.op == "placeholder"])
    return values


def _lifted(ep):
    tensors = {**ep.state_dict, **ep.constants}
    return {s.arg.name: tensors[s.target] for s in ep.graph_signature.input_specs
            if s.target is not None}


def test_the_neighbourhood_computes_what_the_program_computes():
    """The trial partition's program: the caches, their updates and the attention's reads of
    them, nothing else; run on the values the whole program gives its inputs, it computes
    the same values."""
    model, calls = _decoder()
    program = functional(torch.export.export(copy.deepcopy(model), calls[0]))
    neighbourhood = buffer_neighbourhood(program)
    ops = [n.target for n in neighbourhood.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert ops == [aten.index_copy.default, aten.index_copy.default, aten.transpose.int,
                   aten.matmul.default]
    assert set(neighbourhood.graph_signature.buffers_to_mutate.values()) == CACHES
    user = dict(zip([s.arg.name for s in program.graph_signature.input_specs
                     if s.kind == InputKind.USER_INPUT], calls[0], strict=True))
    whole = _values(program, {**_lifted(program), **user})
    feeds = {n.name: whole[n.name] for n in neighbourhood.graph.nodes if n.op == "placeholder"}
    part = _values(neighbourhood, {**feeds, **_lifted(neighbourhood)})
    returned = neighbourhood.graph.output_node().args[0]
    assert len(returned) == 4
    for node in returned:
        assert torch.equal(part[node.name], whole[node.name]), node.name


class ContextPartitioner(Partitioner):
    """Tags differently in the whole decoder (it has an ``mm``) and in the trial's program.

    ``whole`` / ``trial``: "all" (every op, one partition), "update" (the cache updates
    only) or "raise"; then ExecuTorch's buffer tagging, as a stateful backend does.
    """

    def __init__(self, whole: str, trial: str):
        super().__init__()
        self.whole, self.trial = whole, trial
        self.delegation_spec = DelegationSpec(DEMO_BACKEND, [])

    def partition(self, exported_program) -> PartitionResult:
        names = {str(getattr(n.target, "__name__", "")) for n in exported_program.graph.nodes}
        mode = self.whole if "aten.mm.default" in names else self.trial
        if mode == "raise":
            raise RuntimeError("this partitioner needs the whole model")
        for node in exported_program.graph.nodes:
            name = str(getattr(node.target, "__name__", ""))
            if node.op == "call_function" and (mode == "all" or "index_put" in name):
                node.meta["delegation_tag"] = "owner"
        tag_constant_data(exported_program)
        tag_mutated_buffer(exported_program)
        return PartitionResult(exported_program, {"owner": self.delegation_spec})


def test_a_wrong_prediction_keeps_the_buffer_at_the_top_level_and_says_why():
    """The trial keeps the attention inside the owner, the real partition leaves it out:
    no copy carries the new value out, so the caches stay at the top level, correctly."""
    model, calls = _decoder()
    wrapper = BufferOwningPartitioner(ContextPartitioner(whole="update", trial="all"))
    lowered = _lower(model, calls, wrapper)
    assert wrapper.copy_plan.copied == set() and wrapper.copy_plan.inside == CACHES
    assert _owned(wrapper) == set()
    assert len(wrapper.notes) == 2
    assert all("the trial partition run before decomposition kept every use inside" in note
               for note in wrapper.notes)
    assert_same_behaviour(model, lowered.exported_program(), calls, atol=ATOL,
                          state=executorch_state)
    strict = BufferOwningPartitioner(ContextPartitioner(whole="update", trial="all"),
                                     strict=True)
    with pytest.raises(BufferConsumptionError) as info:
        _lower(model, calls, strict)
    assert info.value.buffer in CACHES and "trial partition" in info.value.reason


def test_a_failed_trial_copies_every_shared_new_value():
    model, calls = _decoder()
    wrapper = BufferOwningPartitioner(ContextPartitioner(whole="update", trial="raise"))
    lowered = _lower(model, calls, wrapper)
    assert wrapper.copy_plan.copied == CACHES
    assert "RuntimeError: this partitioner needs the whole model" in wrapper.copy_plan.failure
    assert wrapper.notes[0].startswith("the trial partition deciding the copies")
    assert _owned(wrapper) == CACHES
    assert_same_behaviour(model, lowered.exported_program(), calls, atol=ATOL,
                          state=executorch_state)
    with torch.no_grad():
        assert whole_buffer_copies(lowered.to_executorch(), model) == Counter({"delegate": 2})


class PrefixWrite(torch.nn.Module):
    """``cache[:n] = 2 * x`` for a dynamic ``n``, and an accumulator; both read inside."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))
        self.register_buffer("acc", torch.zeros(1, 4))

    def forward(self, x):
        self.cache[: x.shape[0]] = x * 2
        self.acc.add_(x.sum(0, keepdim=True))
        return self.cache.sum(0) + self.acc


def test_the_trial_of_a_dynamic_shape_program_copies_nothing_for_core_ml():
    """Core ML keeps ``aten.sym_size`` whole; the trial partition, which delegates nothing,
    then failed ExecuTorch's check that each op kept whole was delegated (8dcccbe), and every
    new value used besides its write-back was copied: a whole cache returned per call. Now
    the trial runs, no new value is copied, and the program equals eager over 4 calls of
    4 lengths."""
    pytest.importorskip("coremltools")
    from tests.models.coreml_cases import coreml_partitioner

    generator = torch.Generator().manual_seed(0)
    calls = [(torch.randn(n, 4, generator=generator),) for n in (3, 5, 1, 8)]
    rows = torch.export.Dim("rows", min=1, max=8)
    with torch.no_grad():
        ep = torch.export.export(PrefixWrite(), calls[0], dynamic_shapes=({0: rows},))
    wrapper = BufferOwningPartitioner(coreml_partitioner())
    edge = to_edge_transform_and_lower(ep, partitioner=[wrapper])
    assert wrapper.copy_plan.failure is None
    assert wrapper.copy_plan.copied == frozenset()
    assert wrapper.notes == ["'cache' owned by partition 'tag1'", "'acc' owned by partition 'tag1'"]
    assert_same_behaviour(PrefixWrite(), edge.exported_program(), calls, atol=ATOL,
                          state=executorch_state)
    edge.to_executorch()
