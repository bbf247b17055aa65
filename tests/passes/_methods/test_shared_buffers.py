"""PassManager.run on several methods of one model: {name: program} sharing buffers by name,
the joint condition ``passes`` registers with the manager (passes/_methods/shared_buffers.py).

The methods are tests/models/accumulators.py's ``Accumulate`` exported twice from one
module, with a 4-element and a 1-element (broadcast) input: one running sum ``acc`` for
both. The shared-buffer condition (shape, dtype, initial value, registered facets) is
checked before the first pass and after the last, the pipeline runs on each method, and
buffers the methods shared stay one tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch

import passes._methods.shared_buffers as methods
from pass_manager import (
    Condition,
    MethodsRunResult,
    Pass,
    PassFailedError,
    PassManager,
    PassResult,
    RunResult,
    function_pass,
    graph_module_of,
    graph_of,
)
from passes import SharedBufferError, shared_buffer_differences
from tests.models.accumulators import Accumulate

NoRelu = Condition("NoRelu", lambda p: [n.name for n in graph_of(p).nodes if "relu" in str(
    n.target)], doc="no relu node")


class ReluToAbs(Pass):
    """Replaces relu with abs: a real rewrite that changes each method's outputs."""

    provides = frozenset({NoRelu})

    def call(self, program):
        changed = False
        for node in graph_of(program).nodes:
            if node.target in (torch.relu, torch.ops.aten.relu.default):
                node.target = torch.abs if node.target is torch.relu else torch.ops.aten.abs.default
                changed = True
        return PassResult(program, changed)

CALLS = [("four", (torch.arange(4.0),)), ("one", (torch.tensor([2.0]),)),
         ("one", (torch.tensor([-1.0]),)), ("four", (torch.ones(4),))]


def exported(module=None):
    module = module or Accumulate()
    return {name: torch.export.export(module, args)
            for name, args in (("four", (torch.ones(4),)), ("one", (torch.ones(1),)))}


def in_sequence(programs, calls):
    """Outputs of ``calls`` in order, each on its method's module (built once)."""
    modules = {name: program.module() if hasattr(program, "module") and not isinstance(
        program, torch.nn.Module) else program for name, program in programs.items()}
    return [modules[name](*copy.deepcopy(args)) for name, args in calls]


def test_the_pipeline_runs_on_each_method_and_reports_per_method():
    module = Accumulate()
    eager = copy.deepcopy(module)
    result = PassManager([ReluToAbs()]).run(exported(module))
    assert isinstance(result, MethodsRunResult) and list(result) == ["four", "one"]
    assert all(isinstance(result[name], RunResult) for name in result)
    assert result.modified and not NoRelu.check(result.programs["one"])
    assert [r.name for r in result.reports["one"].records] == ["ReluToAbs"]
    assert "method 'four':" in str(result) and "method 'one':" in str(result)
    programs = result.programs
    assert programs["four"].state_dict["acc"] is programs["one"].state_dict["acc"]
    # One running sum for both methods, as eager keeps one: relu -> abs changes the outputs,
    # the state is what eager's is after the same calls.
    in_sequence(programs, CALLS)
    for _, args in CALLS:
        eager(*args)
    assert torch.equal(programs["one"].state_dict["acc"], eager.acc)


def test_methods_of_differently_configured_models_are_refused_before_any_pass():
    class Wider(Accumulate):
        def __init__(self):
            super().__init__()
            self.acc = torch.zeros(8)
            self.linear = torch.nn.Linear(8, 4)

    ran = []
    record = function_pass(lambda program: ran.append(program), name="Record")
    programs = {"four": exported()["four"], "eight": torch.export.export(Wider(), (
        torch.ones(8),))}
    with pytest.raises(SharedBufferError) as caught:
        PassManager([record]).run(programs)
    error = caught.value
    assert (error.buffer, error.methods, error.aspect) == ("acc", ["four", "eight"], "shape")
    assert error.difference == "(4,) in 'four', (8,) in 'eight'"
    assert "before the pipeline" in str(error) and "export them from one model" in str(error)
    assert ran == []


@pytest.mark.parametrize("change, aspect, says", [
    (lambda m: setattr(m, "acc", m.acc.double()), "dtype", "torch.float32 in 'a', "
     "torch.float64 in 'b'"),
    (lambda m: m.acc.fill_(1.0), "initial value", "4 of 4 elements differ, the first at [0]: "
     "0.0 vs 1.0"),
])
def test_a_buffer_of_another_dtype_or_initial_value_is_named(change, aspect, says):
    other = Accumulate()
    change(other)
    programs = {"a": torch.export.export(Accumulate(), (torch.ones(4),)),
                "b": torch.export.export(other, (torch.ones(4),))}
    (difference,) = shared_buffer_differences(programs)
    assert (difference.buffer, difference.methods, difference.aspect) == ("acc", ("a", "b"),
                                                                          aspect)
    assert difference.difference.startswith(says)
    with pytest.raises(SharedBufferError, match=f"differ in {aspect}"):
        PassManager([ReluToAbs()]).run(programs)


def test_graph_modules_are_checked_too():
    traced = {"a": torch.fx.symbolic_trace(Accumulate())}
    wider = Accumulate()
    wider.acc = torch.zeros(2)
    traced["b"] = torch.fx.symbolic_trace(wider)
    with pytest.raises(SharedBufferError, match=r"'acc'.*differ in shape"):
        PassManager([ReluToAbs()]).run(traced)


def test_a_pass_that_breaks_the_condition_is_caught_after_the_pipeline():
    @function_pass(name="ResizeStateToInput")
    def resize(program):  # a (wrong) pass sizing the state like the method's input
        size = next(n for n in graph_of(program).nodes if n.op == "placeholder"
                    and n.name == "x").meta["val"].shape[0]
        program.state_dict["acc"] = torch.zeros(size)
        return program

    with pytest.raises(SharedBufferError) as caught:
        PassManager([resize]).run(exported())
    assert caught.value.aspect == "shape"
    assert "after PassManager[ResizeStateToInput]" in str(caught.value)


def test_buffers_a_pass_replaced_in_every_method_are_one_tensor_again():
    @function_pass(name="FreshState")
    def fresh(program):  # e.g. integer storage: a new tensor per method, equal values
        program.state_dict["acc"] = program.state_dict["acc"].clone()
        return program

    programs = exported()
    result = PassManager([fresh]).run(programs)
    assert result.notes["reshared"] == ["acc"]
    after = result.programs
    assert after["four"].state_dict["acc"] is after["one"].state_dict["acc"]


def test_a_registered_facet_is_part_of_the_condition(monkeypatch):
    def layout(program):  # e.g. what a backend records about each buffer in meta
        return {"acc": graph_module_of(program).meta.get("acc_layout")}

    monkeypatch.setitem(methods._FACETS, "layout", layout)
    programs = exported()
    programs["four"].graph_module.meta["acc_layout"] = "rows"
    assert shared_buffer_differences(programs) == []  # 'one' says nothing: not compared
    programs["one"].graph_module.meta["acc_layout"] = "columns"
    with pytest.raises(SharedBufferError) as caught:
        PassManager([ReluToAbs()]).run(programs)
    assert caught.value.aspect == "layout"
    assert caught.value.difference == "rows in 'four', columns in 'one'"


def test_an_error_in_one_method_says_which():
    @function_pass(name="FailOnOne")
    def fail(program):
        if any(n.op == "placeholder" and n.meta["val"].shape[0] == 1
               for n in graph_of(program).nodes):
            raise RuntimeError("cannot handle a one-element input")

    with pytest.raises(PassFailedError) as caught:
        PassManager([fail]).run(exported())
    assert caught.value.method == "one"
    assert str(caught.value).startswith("method 'one' (methods already run: four): ")
    assert "cannot handle a one-element input" in str(caught.value)


class ScaledAccumulate(Accumulate):
    """Accumulate with a read-only buffer beside its state."""

    def __init__(self, scale: float):
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x):
        return super().forward(x) * self.scale


def test_only_buffers_some_method_writes_are_shared_state():
    # The read-only buffer of one name holds another value in each method (as torchao's
    # folded constants _tensor_constant_N do): each method's own constant, not refused. The
    # state both write is compared, in the exported and the traced form.
    programs = {"a": torch.export.export(ScaledAccumulate(1.0), (torch.ones(4),)),
                "b": torch.export.export(ScaledAccumulate(4.0), (torch.ones(4),))}
    assert shared_buffer_differences(programs) == []
    traced = {name: torch.fx.symbolic_trace(ScaledAccumulate(s)) for name, s in (("a", 1.0),
                                                                                ("b", 4.0))}
    assert shared_buffer_differences(traced) == []
    other = ScaledAccumulate(4.0)
    other.acc.fill_(1.0)
    programs["b"] = torch.export.export(other, (torch.ones(4),))
    assert [(d.buffer, d.aspect) for d in shared_buffer_differences(programs)] == [
        ("acc", "initial value")]


def test_the_manager_checks_only_the_joint_conditions_registered_with_it(monkeypatch):
    # The manager itself knows nothing of buffers: without the condition ``passes``
    # registers, methods that disagree about their state run as any programs do.
    import pass_manager.program_sets as program_sets

    monkeypatch.setattr(program_sets, "_JOINT", {})
    wider = Accumulate()
    wider.acc = torch.zeros(8)
    wider.linear = torch.nn.Linear(8, 4)
    programs = {"four": exported()["four"],
                "eight": torch.export.export(wider, (torch.ones(8),))}
    result = PassManager([ReluToAbs()]).run(programs)
    assert list(result) == ["four", "eight"] and result.notes == {}
