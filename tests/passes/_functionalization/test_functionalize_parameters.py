"""InplaceToFunctional on writes to parameters and constants.

torch's functionalization turns an in-place write to a parameter (one that does not require
grad, or any parameter under ``no_grad``) into a ``PARAMETER_MUTATION`` output, and refuses a
write to a lifted constant ("register it as buffer"). So do we: the parameter's new value is
an output of the ExportedProgram (a trailing ``copy_`` in the GraphModule form), in the order
``run_decompositions({})`` gives, and a constant write is a typed refusal.
"""

import copy

import pytest
import torch
from torch import nn
from torch.export.graph_signature import OutputKind

from pass_manager import PassFailedError, PassManager, assert_same_behaviour
from pass_manager.program import program_text
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    UnsupportedMutationError,
    conditions,
    mutable_buffers,
)
from tests.models.failing import ScaleConstant

from .functionalize_checks import _calls, functionalize_both_forms


def parameters_and_buffers(module):
    state = {f"parameter {n}": p.detach().clone() for n, p in module.named_parameters()}
    state.update({n: b.detach().clone() for n, b in module.named_buffers()})
    return state


class ScaledParameter(nn.Module):
    """Writes a frozen parameter in place, then a buffer from it, then reads both."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 4), requires_grad=False)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.weight.mul_(0.5).add_(x)
        self.total.add_(self.weight)
        return self.weight * 2 + self.total


class ParameterRowWrite(nn.Module):
    """Writes one row of a frozen parameter through a view, and a user input."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.arange(12.0).reshape(3, 4), requires_grad=False)
        self.bias = nn.Parameter(torch.ones(4), requires_grad=False)  # read, never written

    def forward(self, x, y):
        row = self.table[1]
        row.copy_(x)
        y.mul_(2)
        return self.table.sum(0) + self.bias + y


@pytest.mark.parametrize("factory, shapes", [
    (ScaledParameter, [(4,)]),
    (ParameterRowWrite, [(4,), (4,)]),
])
def test_parameter_writes_become_parameter_mutations_like_torch(factory, shapes):
    calls = _calls(*shapes)
    ep, module = functionalize_both_forms(factory, calls, state=parameters_and_buffers)
    decomposed = torch.export.export(factory(), copy.deepcopy(calls[0])).run_decompositions({})
    assert_same_behaviour(factory(), decomposed, calls, calls=4, state=parameters_and_buffers)
    # The same mutation outputs, in the same order, as torch's own functionalization.
    kinds = [(s.kind, s.target) for s in ep.graph_signature.output_specs]
    assert kinds == [(s.kind, s.target) for s in decomposed.graph_signature.output_specs]
    assert (OutputKind.PARAMETER_MUTATION, "weight" if factory is ScaledParameter
            else "table") in kinds
    # The written parameter is marked as state (and the read-only one is not).
    written = "weight" if factory is ScaledParameter else "table"
    for program in (ep, module):
        marks = {name: info.kind for name, info in mutable_buffers(program).items()}
        assert marks[written] == "parameter" and "bias" not in marks


def test_functional_program_with_parameter_mutation_is_left_as_it_is():
    calls = _calls((4,))
    ep, module = functionalize_both_forms(ScaledParameter, calls, state=parameters_and_buffers)
    for program in (ep, module):
        again = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
        assert not again.report.records[1].modified
        assert not conditions.Functional.check(again.program)
        assert not again.report.records[0].modified  # marked already


class FrozenParameterUnderNoGrad(nn.Module):
    """A parameter that requires grad, written under no_grad (export traces it only then)."""

    def __init__(self):
        super().__init__()
        self.ema = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        self.ema.mul_(0.9).add_(x, alpha=0.1)
        return self.ema + x


def test_parameter_requiring_grad_written_under_no_grad():
    calls = _calls((4,))
    with torch.no_grad():
        ep = torch.export.export(FrozenParameterUnderNoGrad(), calls[0])
        results = [PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            copy.deepcopy(program)).program for program in (ep, ep.module())]
        decomposed = ep.run_decompositions({})
    for result in results:
        assert not conditions.Functional.check(result)
        # run_program calls under no_grad, as the eager module must be called too.
        assert_same_behaviour(FrozenParameterUnderNoGrad(), result, calls, calls=4,
                              state=parameters_and_buffers)
    assert [(s.kind, s.target) for s in results[0].graph_signature.output_specs] == [
        (s.kind, s.target) for s in decomposed.graph_signature.output_specs]


def test_constant_write_is_refused_as_torch_refuses_it():
    calls = _calls((4,))
    ep = torch.export.export(ScaleConstant(), calls[0])
    # Not deep-copied: a deep copy of a GraphModule registers its tensor attributes as
    # buffers (torch.fx's _copy_attr), and a buffer's write is functionalized.
    for program in (ep, ep.module()):
        before = program_text(program)
        with pytest.raises(PassFailedError) as info:
            PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
        error = info.value.__cause__
        assert isinstance(error, UnsupportedMutationError) and error.kind == "writes-constant"
        assert error.node == "mul_" and "constant 'scale'" in error.reason
        assert "register it as a buffer" in error.reason
        assert program_text(program) == before
    with pytest.raises(RuntimeError, match="Constant scale is mutated"):
        ep.run_decompositions({})
