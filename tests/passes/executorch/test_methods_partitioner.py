"""BufferOwningPartitioner told the methods it lowers: shared state stays at the top level.

The decoder with a prefill-only and a decode-only counter (``PerMethodState``) as two
methods, lowered with ExecuTorch's AllNodePartitioner on its demo backend (whose delegates
run in Python). Without ``methods`` every delegate takes every cache, so the decode's
delegate never sees what the prefill's wrote; with it the caches stay at the top level of
both methods (memory planning shares them) and each counter stays with the one delegate
that uses it. The Python programs share their top-level buffers by FQN, as the ``.pte``'s
shared arena does, and are compared with the eager module called in the same order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.exir import to_edge, to_edge_transform_and_lower

from pass_manager import PassManagerError
from passes.errors import SharedBufferError
from passes.executorch import (
    BufferOwningPartitioner,
    ExecuTorchInputError,
    SharedBufferDelegationError,
)
from passes.executorch.method_state import method_state
from tests.models.executorch_cases import everything
from tests.models.methods_on_runtime import (
    PerMethodState,
    accumulator_methods,
    eager_outputs,
    prefill_decode,
    run_sharing_state,
    worst,
)

CACHES = {"decoder.layers.0.attn.k_cache", "decoder.layers.0.attn.v_cache"}
METHODS = ["prefill", "decode"]


@pytest.fixture(scope="module")
def case():
    return prefill_decode(PerMethodState())


def _lower(programs, wrapper):
    with torch.no_grad():
        edge = to_edge_transform_and_lower(copy.deepcopy(programs), partitioner=[wrapper])
    return {name: edge.exported_program(name) for name in edge.methods}


def _delegate_owned(ep) -> set[str]:
    """The buffers some delegate of ``ep`` writes in its own sub-program."""
    owned = set()
    for node in ep.graph.nodes:
        if node.op == "get_attr" and str(node.target).startswith("lowered_module"):
            sub = getattr(ep.graph_module, node.target).original_module
            owned |= set(sub.graph_signature.buffers_to_mutate.values())
    return owned


@pytest.fixture(scope="module")
def edge(case):
    return to_edge(copy.deepcopy(case.programs))


@pytest.fixture(scope="module")
def wrapped(case):
    wrapper = BufferOwningPartitioner(everything(), methods=case.programs)
    return wrapper, _lower(case.programs, wrapper)


def test_without_methods_each_method_delegate_takes_the_shared_caches(case):
    """The failure the issue measured: nothing says the caches are shared."""
    lowered = _lower(case.programs, BufferOwningPartitioner(everything()))
    for name in METHODS:
        assert not CACHES & set(lowered[name].graph_signature.buffers_to_mutate.values())
        assert CACHES <= _delegate_owned(lowered[name])
    errors = worst(eager_outputs(case.model, case.calls),
                   run_sharing_state(lowered, case.calls))
    assert errors[0] <= 1e-5 and min(errors[1:]) > 0.01, errors


def test_shared_caches_stay_top_level_in_every_method(case, wrapped):
    wrapper, lowered = wrapped
    mutated = {name: set(ep.graph_signature.buffers_to_mutate.values())
               for name, ep in lowered.items()}
    for name in METHODS:
        assert CACHES <= mutated[name]
        assert not CACHES & _delegate_owned(lowered[name])
    # A buffer one method alone uses keeps today's ownership: its delegate owns it.
    assert _delegate_owned(lowered["prefill"]) == {"prompt_tokens"}
    assert _delegate_owned(lowered["decode"]) == {"steps"}
    for name in METHODS:
        notes = wrapper.method_notes[name]
        for fqn in CACHES:
            (note,) = [n for n in notes if repr(fqn) in n]
            assert note.startswith(f"kept {fqn!r} at the top level: the methods 'prefill', "
                                   "'decode' use it")
        assert all(f"[{name}] {n}" in wrapper.notes for n in notes)
    errors = worst(eager_outputs(case.model, case.calls),
                   run_sharing_state(lowered, case.calls))
    assert max(errors) <= 1e-5, errors


def test_a_method_reading_state_another_writes_does_not_keep_it_as_a_constant():
    """The demo backend's delegate takes a buffer its method only reads as a constant: the
    narrow method would read the initial total forever."""
    acc = accumulator_methods()
    expected = eager_outputs(acc.model, acc.calls)
    alone = _lower(acc.programs, BufferOwningPartitioner(everything()))
    errors = worst(expected, run_sharing_state(alone, acc.calls))
    assert errors[0] == 0 and min(errors[2::2]) > 0.1, errors
    wrapper = BufferOwningPartitioner(everything(), methods=acc.programs)
    lowered = _lower(acc.programs, wrapper)
    assert set(lowered["narrow"].graph_signature.inputs_to_buffers.values()) == {"total"}
    (note,) = wrapper.method_notes["narrow"]
    assert note.startswith("kept 'total' at the top level: the methods 'narrow', 'wide' use it")
    assert max(worst(expected, run_sharing_state(lowered, acc.calls))) <= 1e-6


def test_strict_names_the_buffer_and_the_methods(case, edge):
    program = copy.deepcopy(edge.exported_program("decode"))
    tags = {n.name: n.meta.get("delegation_tag") for n in program.graph.nodes}
    wrapper = BufferOwningPartitioner(everything(), methods=case.programs, strict=True)
    with pytest.raises(SharedBufferDelegationError) as info:
        wrapper.partition(program)
    error = info.value
    assert isinstance(error, PassManagerError)
    assert error.buffer in CACHES and error.methods == METHODS
    assert error.partitions and "'prefill', 'decode'" in str(error)
    assert {n.name: n.meta.get("delegation_tag") for n in program.graph.nodes} == tags


def test_methods_are_recognized_in_their_lowered_form(case, edge):
    state = method_state(case.programs)
    for name in METHODS:
        assert state.methods_of(case.programs[name]) == (name,)
        assert state.methods_of(edge.exported_program(name)) == (name,)
    assert state.used["prefill"] == CACHES | {"prompt_tokens"}
    assert state.used["decode"] == CACHES | {"steps"}


def test_alike_methods_are_both_candidates_and_their_state_shared(case):
    """Two methods that lowering cannot tell apart: whichever a call is for, the buffers it
    writes are the other's too."""
    one = case.programs["decode"]
    state = method_state({"decode": one, "decode_again": copy.deepcopy(one)})
    assert state.methods_of(one) == ("decode", "decode_again")
    assert set(state.shared(one)) == CACHES | {"steps"}
    alone = method_state({"decode": one})
    assert alone.shared(one) == {}
    # A program matching no method given: any buffer a method uses is shared with it.
    other = method_state({"prefill": case.programs["prefill"]})
    assert other.methods_of(one) == ()
    assert set(other.shared(one)) == CACHES


@pytest.mark.parametrize("methods, argument", [
    ([1, 2], "methods"),
    ({}, "methods"),
    ({"prefill": "not a program"}, "methods['prefill']"),
])
def test_methods_that_are_not_a_mapping_of_programs(methods, argument):
    with pytest.raises(ExecuTorchInputError) as info:
        BufferOwningPartitioner(everything(), methods=methods)
    assert info.value.argument == argument


class _Total(torch.nn.Module):
    """A running total of the inputs, of any shape, dtype and initial value."""

    def __init__(self, shape=(1,), dtype=torch.float32, initial=0.0) -> None:
        super().__init__()
        self.register_buffer("total", torch.full(shape, initial, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum().to(self.total.dtype))
        return x * self.total.float().sum()


@pytest.mark.parametrize("other, aspect", [
    (_Total(dtype=torch.float64), "dtype"),
    (_Total(dtype=torch.int64), "dtype"),
    (_Total(shape=(2,)), "shape"),
    (_Total(initial=1.0), "initial value"),
])
def test_methods_disagreeing_about_a_shared_buffer_are_refused(other, aspect):
    """Lowered anyway, memory planning gives ``total`` one place and one initial value: the
    narrow method started from the wide one's 1.0 (3.0 for 2.0 on its first call) or read
    a float64 / (2,) total as its own fp32 (1,) one."""
    narrow, wide = (torch.ones(1, 2),), (torch.ones(1, 4),)
    with torch.no_grad():
        methods = {"narrow": torch.export.export(_Total(), narrow),
                   "wide": torch.export.export(other, wide)}
    with pytest.raises(SharedBufferError) as info:
        BufferOwningPartitioner(everything(), methods=methods)
    assert (info.value.buffer, info.value.methods, info.value.aspect) == (
        "total", ["narrow", "wide"], aspect)
    assert "BufferOwningPartitioner(methods=...)" in str(info.value)
