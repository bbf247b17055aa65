"""Each built-in pass keeps its declared contract: in_place passes return the program they
were given; ConsumeBufferMutationsInDelegate returns a new one and leaves its input working."""

import copy

import torch

from pass_manager import PassManager, assert_same_behaviour
from pass_manager.program import program_text
from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
)
from passes.delegation import AllNodePartitioner, program_state, to_delegate
from tests.models.pass_inputs import PASSES, inputs_for


class Cache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, pos, x):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0) * 2


INPUTS = [(torch.tensor([i]), torch.full((1, 3), float(i + 1))) for i in range(3)]


def test_declared_contracts():
    for p in (MarkMutableBuffers(), InplaceToFunctional(), SkipAnnotateDataMovementOps(),
              UnfreezeMutableBuffer()):
        assert p.effects.in_place is True and p.effects.writes_state is False
    assert ConsumeBufferMutationsInDelegate.effects.in_place is False
    for p in (MarkMutableBuffers(), InplaceToFunctional()):
        assert isinstance(p.requires | p.provides, frozenset)


def test_in_place_passes_return_the_program_they_are_given():
    program = torch.export.export(Cache(), INPUTS[0])
    result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
    assert result.program is program and result.modified


def test_consume_returns_a_new_program_and_leaves_its_input_working():
    program = torch.export.export(Cache(), INPUTS[0])
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    lowered = to_delegate(functional, AllNodePartitioner())
    before = program_text(lowered)
    reference = copy.deepcopy(lowered)
    result = PassManager([ConsumeBufferMutationsInDelegate(strict=True)]).run(lowered)
    assert result.modified and result.program is not lowered
    assert program_text(lowered) == before
    assert_same_behaviour(reference, lowered, INPUTS, state=program_state)
    assert_same_behaviour(Cache(), result.program, INPUTS, state=program_state)


def test_passes_declaring_no_in_place_meta_edits_make_none():
    """Under strict=True the manager copies meta objects anyway and checks the declaration,
    on each pass's real input (tests/models/pass_inputs.py, the overhead benchmark's, at two
    layers)."""
    factories, _ = inputs_for({"n_layers": 2})
    for name, make_pass in PASSES.items():
        assert make_pass().effects.edits_meta_in_place is False, name
        strict = PassManager([make_pass()], strict=True).run(factories[name]())
        loose = PassManager([make_pass()]).run(factories[name]())
        assert strict.modified == loose.modified, name
        assert program_text(strict.program) == program_text(loose.program), name
