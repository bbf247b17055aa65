"""The pairing rules of passes._carried.pairs: which output a program returns an input's next
value in, when nobody said. They must find the state forms static-shape backends use and stay
silent on programs without state (or the runtime helpers would refuse ordinary programs)."""

from __future__ import annotations

import pytest
import torch

from passes._carried.pairs import pairs_of, suspected_pairs
from passes.errors import StateNameError, UnpairedStateError
from tests.models.carried_state import (
    NamedState,
    SelectiveScan,
    SlidingWindow,
    named_state_inputs,
    scan_inputs,
    window_inputs,
)
from tests.models.paired_state import paired_cache_methods


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.f = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.f(x), torch.relu(x)


class ScattersIntoNew(torch.nn.Module):
    """Writes into a tensor it creates, not into an input: no state."""

    def forward(self, x, index):
        return torch.zeros(8, 4).index_copy(0, index, x)


class SameName(torch.nn.Module):
    def forward(self, x, *, step):
        return {"y": x * step, "step": step + 1}


class NoneBesideState(torch.nn.Module):
    """A keyword input that is None (HF's prefill passes ``attention_mask={"full_attention":
    None}``): a leaf of the call spec with no placeholder, before the state."""

    def forward(self, x, *, mask, step):
        return {"y": x * step, "step": step + 1}


def _both_forms(program):
    return [program, program.module()]


def _found(program):
    return [(p.input_name, p.output_name) for p in suspected_pairs(program)]


@pytest.mark.parametrize("module, inputs, expected", [
    (SlidingWindow(), window_inputs(), [("window", "1")]),
    (NamedState(), named_state_inputs(), [("past_key_values.0.key", "present.0.key"),
                                          ("past_key_values.0.value", "present.0.value")]),
    (SameName(), ((torch.ones(2),), {"step": torch.ones(2)}), [("step", "step")]),
    (NoneBesideState(), ((torch.ones(2),), {"mask": {"full": None}, "step": torch.ones(2)}),
     [("step", "step")]),
    (SelectiveScan(), scan_inputs(), []),  # arithmetic state: not suspected (documented)
    (Residual(), (torch.ones(2, 4),), []),
    (ScattersIntoNew(), (torch.ones(1, 4), torch.tensor([2])), []),
])
def test_suspected_pairs(module, inputs, expected):
    args, kwargs = inputs if isinstance(inputs[-1], dict) and len(inputs) == 2 and \
        isinstance(inputs[0], tuple) else (inputs, {})
    program = torch.export.export(module, args, kwargs)
    for form in _both_forms(program):
        assert _found(form) == expected


def test_the_paired_decoder_is_suspected_in_both_forms():
    _, programs = paired_cache_methods()
    for form in _both_forms(programs["decode"]):
        assert _found(form) == [("cache", "1")]
        with pytest.raises(UnpairedStateError, match="next_values=\\{'cache': '1'\\}"):
            pairs_of(form, None, None, "helper")
        assert pairs_of(form, {}, None, "helper") == []
        assert [(p.input, p.output) for p in pairs_of(form, {"cache": "1"}, None, "h")] == [
            (2, 1)]
        with pytest.raises(StateNameError):
            pairs_of(form, {"cache": "2"}, None, "helper")


def test_inputs_written_in_place_are_not_suspected():
    class InPlaceAndReturned(torch.nn.Module):
        def forward(self, x, cache):
            cache.index_copy_(0, torch.tensor([0]), x)
            return cache.sum(), cache

    program = torch.export.export(InPlaceAndReturned(), (torch.ones(1, 3), torch.zeros(4, 3)))
    assert _found(program) == []
