"""Semantic validation against example inputs (``PassManager(validate=...)``, the
SemanticValidation instrument): the first pass that changes what the program computes is
named, with the difference, and rolled back."""

import pytest
import torch

from pass_manager import PassManager, PassResult, SemanticsError, function_pass, graph_of

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
        validate=(torch.ones(4),),
        validation_calls=3,
        atol=1e-6,
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
    result = PassManager([mul_by_two_to_add_self], validate=inputs).run(exported)
    assert result.modified and not targets(result.program, "mul")


def test_semantic_validation_catches_a_wrong_buffer_update(exported):
    @function_pass()
    def drop_accumulation(program):
        graph = graph_of(program)
        for node in targets(program, "add_"):
            node.target = torch.ops.aten.add.Tensor
        graph.owning_module.recompile()

    with pytest.raises(SemanticsError) as info:
        PassManager([drop_accumulation], validate=(torch.ones(4),), validation_calls=2).run(
            exported
        )
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
        validate=[(torch.ones(4),)] * 2,
        validation_state=summed_state,
    )
    with pytest.raises(SemanticsError) as info:
        pm.run(exported)
    assert "buffer 'sum of acc'" in info.value.difference
