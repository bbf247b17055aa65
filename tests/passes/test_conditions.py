"""passes.conditions.ZeroInitialState: a condition a user requires (Core ML zero-fills its
state when a model is prewarmed), checked on both program forms, marked or not, and on a
buffer stored as integers (its initial value dequantized)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from pass_manager import Pass, PassManager, PreconditionError
from passes import MarkMutableBuffers, QuantizeMutableBuffers
from passes.conditions import ZeroInitialState
from tests.models.quantized_state import GridCache, exported, grid_inputs, on_grid_initial


class TwoCaches(nn.Module):
    def __init__(self, initial: float) -> None:
        super().__init__()
        self.register_buffer("zeros", torch.zeros(4))
        self.register_buffer("start", torch.full((4,), initial))

    def forward(self, x):
        self.zeros.add_(x)
        self.start.mul_(x)
        return self.zeros + self.start


@dataclass(frozen=True, repr=False)
class LowerForCoreML(Pass):
    """A user's last step before a backend that zero-fills state."""

    requires = frozenset({ZeroInitialState})

    def call(self, program):
        return None


def _forms(initial: float):
    model, x = TwoCaches(initial), (torch.ones(4),)
    ep = torch.export.export(model, x)
    marked = torch.export.export(TwoCaches(initial), x)
    PassManager([MarkMutableBuffers()]).run(marked)
    return {"exported_program": ep, "graph_module": ep.module(), "marked": marked}


@pytest.mark.parametrize("form", ["exported_program", "graph_module", "marked"])
def test_names_each_buffer_with_a_nonzero_initial_value(form):
    assert ZeroInitialState.check(_forms(0.0)[form]) == []
    (violation,) = ZeroInitialState.check(_forms(2.0)[form])
    assert violation.startswith("start: initial value has 4 non-zero element(s) of 4")


def test_the_kept_initial_value_counts_not_the_value_after_calls():
    program = _forms(0.0)["marked"]
    program.module()(torch.ones(4))  # state advanced by a run
    program.state_dict["zeros"].fill_(5.0)
    assert ZeroInitialState.holds(program)


def test_integer_state_is_judged_by_the_value_it_stands_for():
    """A buffer QuantizeMutableBuffers stores as integers: zeros on a grid whose zero point
    is 3 are the integers 3, and still an all-zero state."""
    for initial, holds in ((None, True), (on_grid_initial(), False)):
        program = exported(GridCache("index_copy", initial), grid_inputs(1)[0],
                           "exported_program")
        PassManager([QuantizeMutableBuffers()]).run(program)
        assert program.state_dict["cache"].dtype == torch.int8
        if initial is None:
            assert bool(program.state_dict["cache"].eq(3).all())
        assert ZeroInitialState.holds(program) is holds


def test_a_pass_requiring_it_is_refused_naming_the_buffer():
    with pytest.raises(PreconditionError) as info:
        PassManager([LowerForCoreML()]).run(_forms(2.0)["exported_program"])
    assert info.value.condition == "ZeroInitialState"
    assert [v.split(":")[0] for v in info.value.violations] == ["start"]
    PassManager([LowerForCoreML()]).run(_forms(0.0)["exported_program"])
