"""Each built-in pass's ``Raises:`` section is true.

For every error type a pass documents, a program that triggers it makes the pass raise
it: called as ``pass_(program)`` (what a PassManager raises too, where a refusal of the
pass's own arrives as the cause of a PassFailedError, which ``call`` raises directly). And
every error a pass raises on any of these programs is documented.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re

import pytest
import torch
from torch import nn

import pass_manager.errors
import passes.delegation.errors
import passes.errors
from pass_manager import PassFailedError, PassManager, PassManagerError
from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
)
from passes.delegation import AllNodePartitioner, OpSupportPartitioner, to_delegate
from passes.flow.examples import xnnpack_quantizer
from passes.flow.quantization import torchao_recipe
from tests.models.accumulators import ReadBeforeUpdate, TwoBuffers

ERRORS = {
    name: getattr(module, name)
    for module in (pass_manager.errors, passes.errors, passes.delegation.errors)
    for name in module.__all__
}


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        self.acc.add_(x)
        return self.acc * 2


class WritesConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.ones(4)  # a plain attribute: torch.export lifts it as a constant

    def forward(self, x):
        self.c.add_(x)
        return self.c * 2


class TwoAccumulators(nn.Module):
    """Two buffers always equal: by value, a frozen read of one is one of the other."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("a", torch.zeros(1, 4))
        self.register_buffer("b", torch.zeros(1, 4))

    def forward(self, x):
        y = self.proj(x)
        out = (y + self.a) + (y * self.b)
        self.a.add_(y)
        self.b.add_(y)
        return out


X = torch.ones(4)


def _exported(model: nn.Module) -> torch.export.ExportedProgram:
    return torch.export.export(model, (X,) if not isinstance(model, TwoAccumulators) else (
        torch.ones(1, 4),))


def _functional(model: nn.Module) -> torch.export.ExportedProgram:
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        _exported(model)).program


def _marked(model: nn.Module) -> torch.export.ExportedProgram:
    return PassManager([MarkMutableBuffers()]).run(_exported(model)).program


def _sharing_storage() -> torch.export.ExportedProgram:
    lowered = to_delegate(_functional(TwoBuffers()), AllNodePartitioner())
    lowered.state_dict["b"] = lowered.state_dict["a"]
    return lowered


@functools.cache
def _converted_without_provenance() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torchao_recipe(_exported(TwoAccumulators().eval()), xnnpack_quantizer(),
                          [[(torch.randn(1, 4),) for _ in range(3)]], decompose=False).left


# The programs the passes meet, each built fresh (passes rewrite what they are given).
PROGRAMS = {
    "an eager module": Counter,
    "unmarked writes": lambda: _exported(Counter()),
    "a functional ExportedProgram": lambda: _functional(Counter()),
    "a functional GraphModule": lambda: _functional(Counter()).module(),
    "the lifted graph of an ExportedProgram": lambda: _exported(Counter()).graph_module,
    "a marked write to a constant": lambda: _marked(WritesConstant()),
    "frozen reads of two equal buffers": lambda: copy.deepcopy(_converted_without_provenance()),
    "a buffer read outside its delegate": lambda: to_delegate(
        _functional(ReadBeforeUpdate()), OpSupportPartitioner([torch.ops.aten.add.Tensor])),
    "a buffer sharing storage": _sharing_storage,
}

# Per pass, the program that triggers each error type it documents.
TRIGGERS = {
    "MarkMutableBuffers": (MarkMutableBuffers(), {
        "ProgramFormError": "an eager module"}),
    "InplaceToFunctional": (InplaceToFunctional(), {
        "PreconditionError": "unmarked writes",
        "ProgramFormError": "an eager module",
        "PassFailedError": "a marked write to a constant",
        "UnsupportedMutationError": "a marked write to a constant"}),
    "SkipAnnotateDataMovementOps": (SkipAnnotateDataMovementOps(), {
        "PreconditionError": "unmarked writes",
        "ProgramFormError": "an eager module"}),
    "UnfreezeMutableBuffer": (UnfreezeMutableBuffer(), {
        "ProgramFormError": "a functional ExportedProgram",
        "PassFailedError": "frozen reads of two equal buffers",
        "AmbiguousFrozenBufferError": "frozen reads of two equal buffers"}),
    "ConsumeBufferMutationsInDelegate": (ConsumeBufferMutationsInDelegate(strict=True), {
        "PreconditionError": "unmarked writes",
        "ProgramFormError": "a functional GraphModule",
        "PassFailedError": "a buffer read outside its delegate",
        "BufferConsumptionError": "a buffer read outside its delegate",
        "BufferAliasingError": "a buffer sharing storage"}),
}


def documented(cls: type) -> list[str]:
    """The error types named in the ``Raises:`` section of ``cls``'s docstring."""
    doc = inspect.getdoc(cls) or ""
    assert "\nRaises:\n" in doc, f"{cls.__name__} has no Raises section"
    names = []
    for line in doc.split("\nRaises:\n", 1)[1].splitlines():
        if line and not line.startswith(" "):
            break
        if match := re.match(r"    (\w+): ", line):
            names.append(match.group(1))
    return names


def raised(pass_, program) -> list[str]:
    """What the pass raises on ``program``: called as ``pass_(program)``, and, when that is
    a PassFailedError, what ``call`` raises (the cause)."""
    try:
        pass_(program())
    except PassFailedError as e:
        cause = type(e.__cause__)
        with pytest.raises(cause):
            pass_.call(program())
        return ["PassFailedError", cause.__name__]
    except PassManagerError as e:
        return [type(e).__name__]
    return []


@pytest.mark.parametrize("name", list(TRIGGERS))
def test_each_documented_error_is_raised_on_a_program_that_triggers_it(name):
    pass_, triggers = TRIGGERS[name]
    names = documented(type(pass_))
    assert len(names) == len(set(names)) and set(names) <= set(ERRORS), names
    assert set(names) == set(triggers), "a documented error without a trigger, or one more"
    for error, program in triggers.items():
        assert error in raised(pass_, PROGRAMS[program]), (error, program)


@pytest.mark.parametrize("name", list(TRIGGERS))
def test_each_error_a_pass_raises_is_documented(name):
    pass_, _ = TRIGGERS[name]
    names = set(documented(type(pass_)))
    for program, build in PROGRAMS.items():
        undocumented = set(raised(pass_, build)) - names
        assert not undocumented, f"{name} on {program}: {undocumented}"
