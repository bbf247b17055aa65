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
import pickle
import re

import pytest
import torch
from torch import nn
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

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
from passes._methods.shared_buffers import BufferDifference
from passes.delegation import AllNodePartitioner, OpSupportPartitioner, to_delegate
from passes.flow.examples import xnnpack_quantizer
from passes.flow.quantization import torchao_recipe
from passes.quantization import PassQuantizer
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


class StateByConstantIndex(nn.Module):
    """A state's row picked by a constant index: torchao folds the value, which no read
    replays (the index is no state)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("state", torch.zeros(2, 4))

    def forward(self, x):
        y = self.proj(x)
        out = y + self.state.index_select(0, torch.tensor([1]))[0]
        self.state.add_(y * 0.5)
        return out


class StepCounter(nn.Module):
    """A counter updated from itself alone: torchao's constant folding runs its ``add_``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step.add_(1)
        return self.proj(x) + self.step


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
def _converted_with_a_constant_index() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    quantizer = PassQuantizer(xnnpack_quantizer(), transform=[MarkMutableBuffers()])
    prepared = prepare_pt2e(
        torch.export.export(StateByConstantIndex().eval(), (X,)).module(), quantizer)
    with torch.no_grad():
        prepared(torch.randn(4))
    return convert_pt2e(prepared, fold_quantize=True)


@functools.cache
def _converted_without_provenance() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torchao_recipe(_exported(TwoAccumulators().eval()), xnnpack_quantizer(),
                          [[(torch.randn(1, 4),) for _ in range(3)]], decompose=False).left


@functools.cache
def _converted_unmarked_counter() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    prepared = prepare_pt2e(torch.export.export(StepCounter().eval(), (X,)).module(),
                            xnnpack_quantizer())
    return convert_pt2e(prepared, fold_quantize=True)


# The programs the passes meet, each built fresh (passes rewrite what they are given).
PROGRAMS = {
    "an eager module": Counter,
    "unmarked writes": lambda: _exported(Counter()),
    "a functional ExportedProgram": lambda: _functional(Counter()),
    "a functional GraphModule": lambda: _functional(Counter()).module(),
    "the lifted graph of an ExportedProgram": lambda: _exported(Counter()).graph_module,
    "a marked write to a constant": lambda: _marked(WritesConstant()),
    "frozen reads of two equal buffers": lambda: copy.deepcopy(_converted_without_provenance()),
    "a folded read by a constant index": lambda: copy.deepcopy(_converted_with_a_constant_index()),
    "an unmarked counter folding advanced": lambda: copy.deepcopy(_converted_unmarked_counter()),
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
        "AmbiguousFrozenBufferError": "frozen reads of two equal buffers",
        "UnreplayableFrozenReadError": "a folded read by a constant index",
        "FoldedStateWriteError": "an unmarked counter folding advanced"}),
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
        survives_pickling(e)
        survives_pickling(e.__cause__)
        cause = type(e.__cause__)
        with pytest.raises(cause):
            pass_.call(program())
        return ["PassFailedError", cause.__name__]
    except PassManagerError as e:
        survives_pickling(e)
        return [type(e).__name__]
    return []


def survives_pickling(error: BaseException) -> None:
    """A raised error crosses a process pool (pickle) and ``copy`` with its message and
    attributes: Python rebuilds an exception by calling its class with its message."""
    for rebuilt in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(rebuilt) is type(error)
        assert str(rebuilt) == str(error)
        assert rebuilt.args == error.args
        assert set(vars(rebuilt)) == set(vars(error))
        for name, value in vars(error).items():
            if isinstance(value, (str, int, list, tuple, dict, type(None))):
                assert getattr(rebuilt, name) == value, name


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


def _every_error_and_warning_class() -> list[type]:
    import passes.executorch

    modules = (pass_manager.errors, passes.errors, passes.delegation.errors, passes.executorch)
    return sorted({
        value for module in modules for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, (PassManagerError, Warning))
        and value.__module__.startswith(("pass_manager", "passes"))
    }, key=lambda cls: cls.__qualname__)


def _argument(parameter: inspect.Parameter, node: torch.fx.Node):
    """A value of the parameter's annotated type (names, lists of names, a node)."""
    annotation = str(parameter.annotation)
    if "Node" in annotation:
        return node
    if annotation.startswith(("list", "Sequence")):
        return [f"{parameter.name}_0", f"{parameter.name}_1"]
    if annotation.startswith("int"):
        return 3
    return f"the {parameter.name}"


# Arguments a name-built value would not do (checked against a set of kinds, read as
# objects).
_ARGUMENTS = {
    "EffectsError": {"kind": "writes_state"},
    "SharedBufferError": {"differences": [
        BufferDifference("cache", ("prefill", "decode"), "shape",
                         "(4,) in prefill, (8,) in decode"),
        BufferDifference("pos", ("prefill", "decode"), "dtype",
                         "int64 in prefill, int32 in decode"),
    ]},
}


@pytest.mark.parametrize("cls", _every_error_and_warning_class(), ids=lambda c: c.__name__)
def test_every_error_and_warning_survives_pickling(cls):
    """Not only those the passes raise: the helpers' errors and the warnings too (a warning
    shown by ``warnings`` or pytest is copied, which once spelled its input names letter
    by letter)."""
    node = next(iter(torch.fx.symbolic_trace(torch.nn.ReLU()).graph.nodes))
    parameters = list(inspect.signature(cls).parameters.values())
    arguments = {p.name: _argument(p, node) for p in parameters
                 if p.default is inspect.Parameter.empty
                 and p.kind is not inspect.Parameter.VAR_KEYWORD}
    arguments.update(_ARGUMENTS.get(cls.__name__, {}))
    error = cls(**arguments)
    survives_pickling(error)
    if issubclass(cls, Warning):  # pytest-xdist sends a warning over as cls(*args)
        assert str(cls(*error.args)) == str(error)
