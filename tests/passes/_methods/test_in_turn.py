"""run_methods: the methods of one model called in turn on one state, as on a device."""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import ValidationInputError
from passes._methods.in_turn import run_methods
from tests.models.input_state import WritesItsInput


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.total.add_(x.sum(0))
        return self.total * 2


def _methods():
    model = Counter()
    programs = {"many": torch.export.export(model, (torch.ones(4, 3),)),
                "one": torch.export.export(model, (torch.ones(1, 3),))}
    shared = programs["many"].state_dict["total"]
    programs["one"].state_dict["total"] = shared  # export copied it: one state again
    return programs


def test_methods_called_in_turn_share_their_state_like_the_eager_module():
    programs = _methods()
    before = {m: p.state_dict["total"].clone() for m, p in programs.items()}
    x4, x1 = torch.arange(12.0).reshape(4, 3), torch.ones(1, 3)
    calls = [("many", (x4,), {}), ("one", (x1,), {}), ("one", (x1,), {})]
    trace = run_methods(programs, calls)
    eager = Counter()
    expected = [eager(x4).clone(), eager(x1).clone(), eager(x1).clone()]
    for got, want in zip(trace.outputs, expected, strict=True):
        assert torch.equal(got[0], want)
    assert torch.equal(trace.buffers[-1]["total"], eager.total)
    # the caller's programs keep their state
    assert all(torch.equal(p.state_dict["total"], before[m]) for m, p in programs.items())


def test_methods_holding_separate_copies_do_not_see_each_others_writes():
    programs = _methods()
    programs["one"].state_dict["total"] = copy.deepcopy(programs["many"].state_dict["total"])
    trace = run_methods(programs, [("many", (torch.ones(4, 3),), {}),
                                   ("one", (torch.ones(1, 3),), {})])
    assert torch.equal(trace.outputs[1][0], torch.full((3,), 2.0))  # not 10: its own zeros


def test_a_positional_input_passed_by_keyword_is_bound_as_eager_binds_it():
    """``one(x=...)``: the eager module and quantize_methods' calibration take it; before,
    the exported program's module raised torch's ValueError ("Ran into a kwarg keyword
    mismatch")."""
    x4, x1 = torch.arange(12.0).reshape(4, 3), torch.ones(1, 3)
    trace = run_methods(_methods(), [("many", (x4,), {}), ("one", (), {"x": x1})])
    eager = Counter()
    expected = [eager(x4).clone(), eager(x=x1).clone()]
    for got, want in zip(trace.outputs, expected, strict=True):
        assert torch.equal(got[0], want)
    assert torch.equal(trace.buffers[-1]["total"], eager.total)


def test_a_call_naming_no_method_is_named():
    with pytest.raises(ValidationInputError, match=r"calls\[0\].*names method 'decode'; the "
                                                   r"methods are 'many', 'one'"):
        run_methods(_methods(), [("decode", (torch.ones(1, 3),), {})])


def test_share_by_name_runs_methods_whose_state_was_copied_apart_on_one_state():
    programs = _methods()
    programs["one"].state_dict["total"] = copy.deepcopy(programs["many"].state_dict["total"])
    calls = [("many", (torch.ones(4, 3),), {}), ("one", (torch.ones(1, 3),), {})]
    trace = run_methods(programs, calls, share_by_name=True)
    assert torch.equal(trace.outputs[1][0], torch.full((3,), 10.0))  # 4 + 1, doubled


class AdvancesBy(torch.nn.Module):
    """A position counter advanced by a read-only step buffer (a prefill of ``step`` tokens,
    a one-token decode): quantized, HF's ``cumulative_length.add_(4)`` and ``add_(1)`` read
    their step from a lifted ``_tensor_constant_<n>`` buffer of one name in both methods."""

    def __init__(self, step: int):
        super().__init__()
        self.register_buffer("position", torch.zeros((), dtype=torch.long))
        self.register_buffer("step", torch.tensor(step))

    def forward(self, x):
        self.position.add_(self.step)
        return x + self.position


def test_share_by_name_shares_state_but_not_read_only_buffers_of_one_name():
    """The .pte shares mutable buffers only: a read-only buffer each method holds under one
    name keeps each method's own value (a decode must not advance by the prefill's 4)."""
    x = torch.zeros(1)
    programs = {"prefill": torch.export.export(AdvancesBy(4), (x,)),
                "decode": torch.export.export(AdvancesBy(1), (x,))}
    calls = [("prefill", (x,), {}), ("decode", (x,), {}), ("decode", (x,), {})]
    for methods in (programs, {m: p.module() for m, p in programs.items()}):
        trace = run_methods(methods, calls, share_by_name=True)
        assert [float(out[0]) for out in trace.outputs] == [4.0, 5.0, 6.0]
        assert int(trace.buffers[-1]["position"]) == 6
    assert [int(p.state_dict["step"]) for p in programs.values()] == [4, 1]


def test_share_by_name_refuses_buffers_of_one_name_that_cannot_be_one_tensor():
    programs = _methods()
    programs["one"].state_dict["total"] = torch.zeros(5)
    with pytest.raises(ValidationInputError, match=r"buffer 'total' is \(3,\) torch.float32 in "
                                                   r"method 'many' but \(5,\)"):
        run_methods(programs, [("many", (torch.ones(4, 3),), {})], share_by_name=True)


def test_state_carried_in_an_input_carries_across_calls_and_the_caller_keeps_its_tensor():
    """Input-carried state (Hugging Face's exporter passes its caches so): the calls share
    one copy of the tensor they all pass, as eager does, and the caller's stays as it was."""
    cache = torch.zeros(3)
    trace = run_methods({"step": WritesItsInput()},
                        [("step", (torch.ones(3), cache), {})] * 3)
    assert [out[0].tolist() for out in trace.outputs] == [[2.0] * 3, [4.0] * 3, [6.0] * 3]
    assert cache.tolist() == [0.0] * 3
