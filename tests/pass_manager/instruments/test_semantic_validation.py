"""Semantic validation against example inputs (the SemanticValidation instrument): the
first pass that changes what the program computes is named, with the difference, and
rolled back."""

import pytest
import torch

from pass_manager import (
    PassManager,
    PassResult,
    SemanticsError,
    SemanticValidation,
    ValidationInputError,
    function_pass,
    graph_of,
)

from ..conftest import ReluToAbs, targets


def test_semantic_validation_names_the_first_diverging_pass_and_difference(traced):
    @function_pass()
    def harmless(program):
        return PassResult(program, False)

    @function_pass()
    def wrong_constant(program):
        for node in graph_of(program).nodes:
            if node.op == "call_function" and node.args[-1:] == (1,):
                node.args = (*node.args[:-1], 2)
        return PassResult(program, True)

    traced.acc.fill_(7.0)
    untouched = traced.acc.clone()
    pm = PassManager(
        [harmless, ReluToAbs(), wrong_constant],
        instruments=[SemanticValidation((torch.ones(4),), calls=3, atol=1e-6)],
    )
    with pytest.raises(SemanticsError) as info:
        pm.run(traced)
    error = info.value
    # The seeded linear layer gives negative outputs on acc = 8, where relu and abs differ:
    # ReluToAbs is the first pass that changes what the program computes.
    assert error.pass_name == "ReluToAbs" and error.index == 1
    assert error.difference.startswith("call 0: output 0:")
    assert error.rolled_back and "abs" in error.diff
    assert "relu" in traced.code and "abs" not in traced.code  # rolled back
    torch.testing.assert_close(traced.acc, untouched)  # validation ran on copies


def test_semantic_validation_accepts_an_equivalent_rewrite(exported):
    @function_pass()
    def mul_by_two_to_add_self(program):
        for node in targets(program, "mul"):
            if node.args[1] == 2:
                node.target = torch.ops.aten.add.Tensor
                node.args = (node.args[0], node.args[0])

    inputs = [(torch.full((4,), float(i)),) for i in range(4)]
    result = PassManager([mul_by_two_to_add_self],
                         instruments=[SemanticValidation(inputs)]).run(exported)
    assert result.modified and not targets(result.program, "mul")


def test_semantic_validation_catches_a_wrong_buffer_update(exported):
    @function_pass()
    def drop_accumulation(program):
        graph = graph_of(program)
        for node in targets(program, "add_"):
            node.target = torch.ops.aten.add.Tensor
        graph.owning_module.recompile()

    with pytest.raises(SemanticsError) as info:
        PassManager([drop_accumulation],
                    instruments=[SemanticValidation((torch.ones(4),), calls=2)]).run(exported)
    assert "buffer 'acc'" in info.value.difference or "call 1" in info.value.difference


def test_validation_reads_state_through_a_custom_reader(exported):
    def summed_state(module):
        return {f"sum of {name}": buf.sum().reshape(1) for name, buf in module.named_buffers()}

    @function_pass()
    def drop_accumulation(program):
        for node in targets(program, "add_"):
            node.target = torch.ops.aten.add.Tensor

    pm = PassManager(
        [drop_accumulation],
        instruments=[SemanticValidation([(torch.ones(4),)] * 2, state=summed_state)],
    )
    with pytest.raises(SemanticsError) as info:
        pm.run(exported)
    assert "buffer 'sum of acc'" in info.value.difference


class _TwoInputs(torch.nn.Module):
    """A program of two inputs, one a keyword-only option, with state."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x, pos, *, scale):
        self.total.add_(x * scale + pos)
        return self.total * 2


_X, _POS = torch.ones(4), torch.arange(4.0)
_ARGS, _KWARGS = (_X, _POS), {"scale": torch.tensor(2.0)}


def _programs():
    ep = torch.export.export(_TwoInputs(), _ARGS, _KWARGS)
    return {"exported": ep, "ep.module()": ep.module(),
            "module": torch.fx.symbolic_trace(_TwoInputs())}


def _pipeline(validate):
    ran = []

    @function_pass()
    def records_that_it_ran(program):
        ran.append(program)
        return PassResult(program, False)

    return PassManager([records_that_it_ran], instruments=[SemanticValidation(validate)]), ran


@pytest.mark.parametrize("form", ["exported", "ep.module()", "module"])
def test_validation_inputs_that_do_not_fit_are_named_before_any_pass_runs(form):
    program = _programs()[form]
    good = (_ARGS, _KWARGS)
    pm, ran = _pipeline([good, ((_X,), _KWARGS), good])
    with pytest.raises(ValidationInputError) as info:
        pm.run(program)
    error = info.value
    assert isinstance(error, TypeError) and not ran
    assert error.option == "SemanticValidation(inputs=...)" and error.call == "inputs[1]"
    assert error.expected.startswith("(x, pos") and "Tensor[4] float32" in error.given
    assert "inputs[1] does not fit the program" in str(error)
    # Found by comparing with the inputs the program takes, not by a failing call.
    assert "before any pass" not in error.reason and error.__cause__ is None
    # The same inputs, all good, validate and run the pass.
    pm, ran = _pipeline([good, good])
    pm.run(program)
    assert len(ran) == 1


def test_a_missing_keyword_of_an_exported_program_is_named():
    pm, ran = _pipeline((_ARGS, {}))
    with pytest.raises(ValidationInputError) as info:
        pm.run(_programs()["exported"])
    assert info.value.call == "inputs" and "'scale' are missing" in info.value.reason
    assert info.value.expected == "(x, pos, *, scale)" and not ran


def test_a_nested_input_of_another_structure_is_named():
    class Pair(torch.nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    ep = torch.export.export(Pair(), ((_X, _X),))
    with pytest.raises(ValidationInputError) as info:
        _pipeline(((_X, _X, _X),))[0].run(ep)
    assert info.value.reason == (
        "input 'pair' is a tuple of 3 entries, the program was exported with a tuple of 2 "
        "entries")


def test_inputs_the_given_program_fails_on_are_named_with_the_cause():
    program = _programs()["exported"]
    pm, ran = _pipeline([(_ARGS, _KWARGS), ((torch.ones(5), _POS), _KWARGS)])
    with pytest.raises(ValidationInputError) as info:
        pm.run(program)
    assert info.value.call == "inputs[1]" and not ran
    assert "before any pass, raised" in info.value.reason
    assert info.value.__cause__ is not None


def test_validate_given_a_tensor_or_a_list_of_arguments_says_how_to_write_it():
    with pytest.raises(ValidationInputError,
                       match=r"got a Tensor: write SemanticValidation\(\(x,\)\)"):
        SemanticValidation(_X)
    pm, _ = _pipeline([_X, _POS])
    with pytest.raises(ValidationInputError, match=r"one call's arguments are a tuple"):
        pm.run(_programs()["exported"])


def test_more_validation_calls_than_inputs_is_named_before_any_pass_runs():
    calls: list[str] = []
    with pytest.raises(ValidationInputError, match=r"calls=3 asks for more calls "
                                                   r"than the 2 given"):
        PassManager([lambda p: calls.append("ran") or p],
                    instruments=[SemanticValidation([(_X, _POS), (_X, _POS)], calls=3)])
    assert calls == []


@pytest.mark.parametrize("inputs, calls", [((_X, _POS), 0), ((_X, _POS), -1), ([], None),
                                           ((_X, _POS), 2.5), ((_X, _POS), True)],
                         ids=["zero calls", "negative calls", "no calls", "float", "bool"])
def test_a_validation_of_no_calls_is_refused(inputs, calls):
    """It validated nothing (``calls=-1``, ``[]``) or 3 calls (``calls=0``) without a word:
    a pass that breaks the program then ran unchecked."""
    with pytest.raises(ValidationInputError) as info:
        SemanticValidation(inputs, calls=calls)
    assert info.value.call is None and "SemanticValidation" in str(info.value)


@pytest.mark.parametrize("tolerances", [{"atol": -1e-6}, {"rtol": float("nan")}, {"atol": "0"}])
def test_a_tolerance_that_is_no_number_at_least_zero_is_refused_before_any_pass(tolerances):
    """torch.allclose refused it after the first changing pass: the pass was reported as
    failing (PassFailedError) and rolled back."""
    with pytest.raises(ValidationInputError, match="the tolerances are numbers, at least 0"):
        SemanticValidation((_X, _POS), **tolerances)
