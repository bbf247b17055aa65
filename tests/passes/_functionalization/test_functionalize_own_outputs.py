"""Each mutation output gets a value of its own.

One value written into two buffers (``a.copy_(v); b.copy_(v)``) used to leave two
``BUFFER_MUTATION`` outputs on one node: torch's ``buffers_to_mutate`` (a dict by output
name) then collapsed them and its verifier rejected the program in every re-validation
(``run_decompositions``, every ExecuTorch lowering). The same for a written buffer also
returned and a returned value also written. Each case: both program forms, outputs and
buffers equal to eager over several calls, the functional program re-validated by torch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.export.graph_signature import OutputKind

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers, exported_program_from
from passes.errors import UnsupportedMutationError
from tests.models.shared_values import (
    ReturnsNewValue,
    ReturnsWritten,
    ReturnsWrittenAndSum,
    SharedStorage,
    TiedBuffers,
    WrittenTwice,
    WrittenTwiceAndReturned,
    vector_calls,
)

from .functionalize_checks import _calls, functionalize_both_forms, refused_in_both_forms

aten = torch.ops.aten
CASES = {
    "written_twice": (WrittenTwice, {"a", "b"}),
    "written_twice_and_returned": (WrittenTwiceAndReturned, {"a", "b"}),
    "returns_written": (ReturnsWritten, {"b"}),
    "returns_written_and_sum": (ReturnsWrittenAndSum, {"b"}),
    "returns_new_value": (ReturnsNewValue, {"b"}),
}


def _functional(program):
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


def _check_own_values(ep, written):
    """One BUFFER_MUTATION per buffer, each on a node no other output names."""
    outputs = list(ep.graph.output_node().args[0])
    specs = ep.graph_signature.output_specs
    mutations = [s for s in specs if s.kind == OutputKind.BUFFER_MUTATION]
    assert set(ep.graph_signature.buffers_to_mutate.values()) == written
    assert len(mutations) == len(written)
    for spec, node in zip(specs, outputs, strict=True):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            assert outputs.count(node) == 1, f"{node.name} is also another output"


@pytest.mark.parametrize("case", CASES)
def test_exported_program(case):
    cls, written = CASES[case]
    calls = vector_calls()
    ep = torch.export.export(cls(), calls[0])
    functional = _functional(ep)
    _check_own_values(functional, written)
    assert_same_behaviour(cls(), functional, calls)
    # torch's verifier accepts it again, and so does its own functionalization.
    decomposed = functional.run_decompositions({})
    assert set(decomposed.graph_signature.buffers_to_mutate.values()) == written
    assert_same_behaviour(cls(), decomposed, calls)


@pytest.mark.parametrize("case", CASES)
def test_graph_module_and_its_lift(case):
    cls, written = CASES[case]
    calls = vector_calls()
    ep = torch.export.export(cls(), calls[0])
    functional = _functional(copy.deepcopy(ep).module())
    assert_same_behaviour(cls(), functional, calls)
    for like in (ep, None):
        lifted = exported_program_from(functional, like=like)
        _check_own_values(lifted, written)
        assert_same_behaviour(cls(), lifted, calls)
        lifted.run_decompositions({})


def test_one_value_into_two_buffers_is_one_value_and_one_copy():
    ep = _functional(torch.export.export(WrittenTwice(), vector_calls()[0]))
    outputs = ep.graph.output_node().args[0]
    by_target = {s.target: n for s, n in zip(ep.graph_signature.output_specs, outputs,
                                             strict=True) if s.target}
    copy_node = by_target["b"]
    assert copy_node.target is aten.copy.default
    assert copy_node.args[1] is by_target["a"]
    assert copy_node.args[0].name == "b_b"  # the buffer's own input: copy(b, v) is v


def test_a_second_run_changes_nothing():
    ep = _functional(torch.export.export(WrittenTwiceAndReturned(), vector_calls()[0]))
    before = str(ep.graph)
    result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep)
    assert not result.modified
    assert str(result.program.graph) == before


@pytest.mark.parametrize("form", ["ep", "gm"])
def test_buffers_sharing_a_storage_are_refused(form):
    """``head`` is a view of ``whole``: the graph takes them as two inputs, so a functional
    program would read ``whole``'s old value; refused, naming the buffers."""
    calls = vector_calls()
    ep = torch.export.export(SharedStorage(), calls[0])
    program = ep if form == "ep" else ep.module()
    before = str(program.graph)
    with pytest.raises(UnsupportedMutationError, match="'head' shares its storage with "
                       "buffer 'whole'") as caught:
        MarkMutableBuffers()(program)
        InplaceToFunctional().call(program)
    assert caught.value.kind == "shared-storage"
    assert str(program.graph) == before


class WritesInputReadsOther(nn.Module):
    """Writes ``cache`` in place and reads ``other``, which a call may pass as a view of
    ``cache``."""

    def forward(self, x, cache, other):
        cache.add_(x)
        return other * 2


def _aliased_inputs(other):
    cache = torch.zeros(2, 3)
    return torch.ones(2, 3), cache, other(cache)


@pytest.mark.parametrize("form", ["ep", "gm"])
def test_a_written_input_a_call_also_passes_as_a_view_is_refused(form):
    """Exported as ``f(x, cache, cache[0])``, the program reads the written cache through
    ``other``; functional, it read ``other``'s old value (0 where eager and the program as
    exported give 2), silently. Export's traced values keep the aliasing: refused, naming
    both inputs."""
    ep = torch.export.export(WritesInputReadsOther(), _aliased_inputs(lambda c: c[0]))
    program = ep if form == "ep" else ep.module()
    before = str(program.graph)
    with pytest.raises(UnsupportedMutationError, match="user_input 'cache' shares its storage "
                       "with user_input 'other'") as caught:
        MarkMutableBuffers()(program)
        InplaceToFunctional().call(program)
    assert caught.value.kind == "shared-storage"
    assert str(program.graph) == before


@pytest.mark.parametrize("other", [lambda c: c, lambda c: torch.zeros(3)],
                         ids=["the same tensor twice", "no shared storage"])
def test_inputs_a_write_cannot_reach_another_way_stay_functionalized(other):
    """The same tensor given twice is one placeholder to export (the other has no users);
    with no storage shared, nothing is refused either. Both follow the program as
    exported."""
    x, cache, read = _aliased_inputs(other)
    ep = torch.export.export(WritesInputReadsOther(), (x, cache, read))
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    expected_x, expected_cache, expected_read = _aliased_inputs(other)
    got_x, got_cache, got_read = _aliased_inputs(other)
    for _ in range(3):
        assert torch.equal(functional.module()(got_x, got_cache, got_read),
                           ep.module()(expected_x, expected_cache, expected_read))
        assert torch.equal(got_cache, expected_cache)


class ExpandedBuffer(nn.Module):
    """A buffer registered expanded (stride 0): its three rows are one row of memory."""

    def __init__(self, rows: int = 3):
        super().__init__()
        self.register_buffer("rows", torch.arange(4.0).expand(rows, 4))

    def forward(self, x):
        self.rows[0].add_(x)
        return self.rows * 2


def test_written_expanded_buffer_is_refused():
    """Eager's write to row 0 changes all three rows; the functional program's new value
    cannot be stored into the buffer (``copy_`` refuses a destination whose elements share
    memory), so it used to fail when called, with an untyped RuntimeError, as torch's
    ``run_decompositions({})`` does. Refused at the pass, naming the buffer."""
    error = refused_in_both_forms(ExpandedBuffer, [(torch.ones(4),)], "overlap")
    assert "'rows' is an expanded tensor" in str(error)


def test_written_buffer_expanded_along_one_row_is_functionalized():
    """An expand adding a size-1 dim (HF's ``position_ids = arange(n).expand((1, -1))``)
    addresses each element once: written and stored back like any buffer."""
    calls = [(torch.full((4,), float(k)),) for k in range(4)]
    functionalize_both_forms(lambda: ExpandedBuffer(rows=1), calls)


def test_tied_buffers_are_one_piece_of_state():
    """One tensor under two names is not refused: export reads and writes it through one
    input (the other is unused), the graph module through one tensor, so the functional
    programs are exact. (torch 2.13's own run_decompositions fails on this export.)"""
    calls = vector_calls()
    ep = torch.export.export(TiedBuffers(), calls[0])
    assert_same_behaviour(TiedBuffers(), _functional(copy.deepcopy(ep)), calls)
    functional = _functional(copy.deepcopy(ep).module())
    assert_same_behaviour(TiedBuffers(), functional, calls)
    assert_same_behaviour(TiedBuffers(), exported_program_from(functional, like=ep), calls)


class StackedCacheRows(nn.Module):
    """One stacked cache whose rows (a key and a value cache per layer) are registered as
    buffers of their own, plus the interleaved columns of another: buffers sharing a storage
    but no element are independent state."""

    def __init__(self):
        super().__init__()
        stacked = torch.zeros(2, 2, 3, 4)  # layer, key/value, position, feature
        for layer in range(2):
            self.register_buffer(f"k{layer}", stacked[layer, 0])
            self.register_buffer(f"v{layer}", stacked[layer, 1])
        columns = torch.arange(8.0).reshape(2, 4)
        self.register_buffer("even", columns[:, ::2])
        self.register_buffer("odd", columns[:, 1::2])
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        at = (self.pos % 3).view(1)
        y = x
        for layer in range(2):
            getattr(self, f"k{layer}").index_copy_(0, at, y)
            getattr(self, f"v{layer}").index_copy_(0, at, y * 2)
            y = (getattr(self, f"k{layer}") * getattr(self, f"v{layer}")).sum(0, keepdim=True) + y
        self.pos.add_(1)
        self.even.add_(x[:, :2])
        return y, self.k0 + self.v1, self.odd * self.even


def test_buffers_sharing_a_storage_but_no_element_are_functionalized():
    """Refused before (``shared-storage``), though neither buffer sees the other's writes."""
    functionalize_both_forms(StackedCacheRows, _calls((1, 4)))
    functionalize_both_forms(StackedCacheRows, _calls((1, 4)), strict=True)
