"""A failing pass leaves the program exactly as it was: graph, meta, state, signature."""

import copy

import pytest
import torch

from pass_manager import (
    Effects,
    PassFailedError,
    PassManager,
    PassResult,
    PostconditionError,
    SemanticsError,
    SemanticValidation,
    assert_same_behaviour,
    graph_of,
)
from pass_manager.program import program_text
from tests.models.higher_order_ops import HIGHER_ORDER_CASES, BranchOnSign

from ..conftest import NoRelu, targets


def state_of(program):
    """Everything rollback must restore, as comparable values."""
    gm = graph_of(program).owning_module
    nodes = [
        (n.name, n.op, str(n.target), str(n.args), sorted(n.meta)) for n in graph_of(program).nodes
    ]
    tensors = {k: v.clone() for k, v in gm.state_dict(keep_vars=True).items()}
    extra = {}
    if isinstance(program, torch.export.ExportedProgram):
        extra = {
            "signature": str(program.graph_signature),
            "state": {k: v.clone() for k, v in program.state_dict.items()},
        }
    return program_text(program), gm.code, nodes, tensors, extra


def assert_same_state(before, after):
    assert before[0] == after[0]
    assert before[1] == after[1]
    assert before[2] == after[2]
    assert before[3].keys() == after[3].keys()
    for key in before[3]:
        torch.testing.assert_close(before[3][key], after[3][key], rtol=0, atol=0)
    assert before[4].get("signature") == after[4].get("signature")
    for key, value in before[4].get("state", {}).items():
        torch.testing.assert_close(value, after[4]["state"][key], rtol=0, atol=0)


class HalfRewriteThenCrash:
    """Rewrites part of the graph, edits meta, state and signature, then raises."""

    name = "half_rewrite"

    def __call__(self, gm):
        graph = gm.graph
        first = next(n for n in graph.nodes if n.op == "call_function")
        with graph.inserting_after(first):
            extra = graph.call_function(torch.ops.aten.neg.default, (first,))
        first.replace_all_uses_with(extra, delete_user_cb=lambda user: user is not extra)
        for node in graph.nodes:
            node.meta["touched"] = True
            node.meta.pop("stack_trace", None)
        for buffer in gm.buffers():
            buffer.fill_(42.0)
        gm.register_buffer("new_state", torch.ones(2))
        gm.recompile()
        raise RuntimeError("injected fault after a partial rewrite")


def test_exception_rolls_back_graph_module_exactly(traced):
    traced.acc.fill_(3.0)
    reference = copy.deepcopy(traced)
    before = state_of(traced)
    with pytest.raises(PassFailedError) as info:
        PassManager([HalfRewriteThenCrash()]).run(traced)
    error = info.value
    assert error.pass_name == "HalfRewriteThenCrash" and error.index == 0
    assert isinstance(error.__cause__, RuntimeError)
    assert "injected fault" in str(error)
    assert "+" in error.diff and "neg" in error.diff  # the diff names what was changed
    assert not hasattr(traced, "new_state")
    assert_same_state(before, state_of(traced))
    assert all("touched" not in n.meta for n in traced.graph.nodes)
    torch.testing.assert_close(traced(torch.ones(4)), reference(torch.ones(4)))


def test_exception_rolls_back_exported_program_exactly(exported):
    with torch.no_grad():
        exported.state_dict["acc"].fill_(5.0)
    before = state_of(exported)
    meta_before = {n.name: dict(n.meta) for n in exported.graph.nodes}

    def rewrite_signature_then_crash(gm):
        spec = exported.graph_signature.output_specs[0]
        spec.arg.name = "renamed"
        HalfRewriteThenCrash()(gm)

    with pytest.raises(PassFailedError):
        PassManager([rewrite_signature_then_crash]).run(exported)
    assert_same_state(before, state_of(exported))
    for node in exported.graph.nodes:
        assert node.meta.keys() == meta_before[node.name].keys()
        assert node.meta.get("stack_trace") == meta_before[node.name].get("stack_trace")
    out = exported.module()(torch.ones(4))
    assert out.shape == (4,)


@pytest.mark.parametrize("form", ["exported", "traced"])
def test_postcondition_failure_rolls_back(form, request):
    program = request.getfixturevalue(form)

    class ClaimsNoRelu:
        """Says it removes relu; only renames a node's meta and adds a useless node."""

        def call(self, program):
            graph = graph_of(program)
            node = targets(program, "relu")[0]
            with graph.inserting_before(node):
                graph.call_function(torch.ops.aten.zeros.default, ([1],))
            return PassResult(program, True)

    from pass_manager import Pass

    Fake = type("ClaimsNoRelu", (Pass,), {"provides": {NoRelu}, "call": ClaimsNoRelu.call})
    before = state_of(program)
    with pytest.raises(PostconditionError) as info:
        PassManager([Fake()]).run(program)
    error = info.value
    assert error.condition == "NoRelu" and error.pass_name == "ClaimsNoRelu" and error.index == 0
    assert any("relu" in v for v in error.violations)
    assert "zeros" in error.diff
    assert_same_state(before, state_of(program))


def test_rollback_of_second_pass_keeps_the_first_passs_work(traced):
    def neg_first(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.relu)
        node.target = torch.abs

    before_second = None

    def crash(gm):
        nonlocal before_second
        before_second = gm.code
        gm.graph.erase_node(next(n for n in gm.graph.nodes if n.op == "output"))
        raise ValueError("boom")

    with pytest.raises(PassFailedError) as info:
        PassManager([neg_first, crash]).run(traced)
    assert info.value.index == 1 and info.value.pass_name == "crash"
    assert traced.code == before_second and "abs" in traced.code


def test_parameter_written_in_place_is_named_as_not_restorable(traced):
    def scale_weights_then_crash(gm):
        with torch.no_grad():
            gm.linear.weight.mul_(2)
        raise RuntimeError("crash after touching a parameter")

    with pytest.raises(PassFailedError) as info:
        PassManager([scale_weights_then_crash]).run(traced)
    error = info.value
    assert error.unrestored == ["linear.weight"]
    assert "Not restored" in str(error) and "linear.weight" in str(error)
    assert "linear.weight" not in error.args[0]  # an attribute rendered, not spliced text


def test_failing_pass_that_built_a_new_exported_program_leaves_the_input_intact(exported):
    from pass_manager import Pass

    class RebuildsThenFails(Pass):
        provides = frozenset({NoRelu})
        effects = Effects(in_place=False)  # returns a new ExportedProgram

        def call(self, program):
            for node in graph_of(program).nodes:
                node.meta["rebuilt"] = True
            signature = copy.deepcopy(program.graph_signature)
            return PassResult(program._update(program.graph_module, signature), True)

    before = state_of(exported)
    with pytest.raises(PostconditionError):
        PassManager([RebuildsThenFails()]).run(exported)
    assert_same_state(before, state_of(exported))
    assert all("rebuilt" not in n.meta for n in exported.graph.nodes)
    assert exported.graph_module.graph.owning_module is exported.graph_module
    assert exported.module()(torch.ones(4)).shape == (4,)


def test_rollback_restores_the_signature_and_module_call_graph_edited_in_place(exported):
    before = state_of(exported)
    call_graph = repr(exported.module_call_graph)
    signature_object = exported.graph_signature

    def edits_then_fails(gm):
        signature = exported.graph_signature
        signature.input_specs[0].arg.name = "renamed"
        signature.output_specs.append(copy.copy(signature.output_specs[-1]))
        entry = exported.module_call_graph[0]
        entry.fqn = "elsewhere"
        entry.signature.inputs.clear()
        entry.signature.forward_arg_names = ["nothing"]
        exported._module_call_graph = []
        raise RuntimeError("boom")

    with pytest.raises(PassFailedError):
        PassManager([edits_then_fails]).run(exported)
    assert_same_state(before, state_of(exported))
    assert repr(exported.module_call_graph) == call_graph
    assert exported.graph_signature is signature_object
    assert exported.module()(torch.ones(4)).shape == (4,)


def test_rollback_restores_the_example_inputs_and_a_change_to_them_is_measured(exported):
    """A pass storing an input as integers sets ``ep.example_inputs`` too (as
    QuantizeMutableBuffers does): failing after that, it left int8 examples for the float
    program it was rolled back to; succeeding, it was measured unmodified."""
    examples = exported.example_inputs

    def quantizes_the_examples(gm):
        exported.example_inputs = ((torch.ones(4, dtype=torch.int8),), {})
        if fails:
            raise RuntimeError("boom")

    fails = True
    with pytest.raises(PassFailedError):
        PassManager([quantizes_the_examples]).run(exported)
    assert exported.example_inputs is examples
    fails = False
    assert PassManager([quantizes_the_examples]).run(exported).modified


class ReservedNames(torch.nn.Module):
    """Inputs named as Python builtins: torch.export keeps the names, an fx graph's
    namespace would rename them (``list`` -> ``list_1``)."""

    def forward(self, input, list):
        return input * 2 + list


def test_a_rebuilt_graph_keeps_names_python_reserves():
    args = (torch.ones(3), torch.arange(3.0))
    exported = torch.export.export(ReservedNames(), args)

    def rewire_then_crash(program):
        graph = graph_of(program)
        first = next(n for n in graph.nodes if n.op == "call_function")
        with graph.inserting_after(first):
            graph.call_function(torch.ops.aten.neg.default, (first,))
        raise RuntimeError("crash after adding a node")

    with pytest.raises(PassFailedError):
        PassManager([rewire_then_crash]).run(exported)
    assert [n.name for n in exported.graph.find_nodes(op="placeholder")] == ["input", "list"]
    module = exported.module()
    for step in range(3):
        x, y = torch.full((3,), float(step)), torch.arange(3.0) - step
        assert torch.equal(module(x, y), ReservedNames()(x, y))


def _rewrite_branches(program):
    """aten.add -> aten.sub inside torch.cond's branches (graph modules below the top one)."""
    top = graph_of(program).owning_module
    rewritten = 0
    for module in top.modules():
        if isinstance(module, torch.fx.GraphModule) and module is not top:
            for node in module.graph.find_nodes(op="call_function",
                                                target=torch.ops.aten.add.Tensor):
                node.target = torch.ops.aten.sub.Tensor
                rewritten += 1
            module.recompile()
    return rewritten


@pytest.mark.parametrize("form", ["exported", "module"])
def test_rollback_restores_a_rewritten_cond_branch(form):
    _, _, calls = HIGHER_ORDER_CASES["cond"]
    exported = torch.export.export(BranchOnSign(), calls[0])
    program = exported if form == "exported" else exported.module()
    before = copy.deepcopy(program)

    def rewrite_branch_then_crash(program):
        assert _rewrite_branches(program) == 1
        raise RuntimeError("crash after rewriting a branch")

    with pytest.raises(PassFailedError) as raised:
        PassManager([rewrite_branch_then_crash]).run(program)
    assert raised.value.rolled_back
    assert "+    %add : [num_users=1] = call_function[target=torch.ops.aten.sub.Tensor]" in (
        raised.value.diff)  # the diff shows the branch as it was changed
    assert_same_behaviour(before, program, calls)  # both branches, outputs and buffers


def test_a_rewritten_cond_branch_is_a_change_validation_sees():
    _, _, calls = HIGHER_ORDER_CASES["cond"]
    exported = torch.export.export(BranchOnSign(), calls[0])
    before = copy.deepcopy(exported)

    def rewrite_branch(program):  # returns None: the manager measures the change
        _rewrite_branches(program)

    with pytest.raises(SemanticsError, match="rewrite_branch"):
        PassManager([rewrite_branch], instruments=[SemanticValidation(calls)]).run(exported)
    assert_same_behaviour(before, exported, calls)
    result = PassManager([rewrite_branch]).run(exported)  # its own recompile not needed
    assert result.report.records[0].modified


def _keeps_acc_out_of_the_state_dict(program):
    graph_of(program).owning_module._non_persistent_buffers_set.add("acc")


def _freezes_the_parameters(program):
    tensors = (program.state_dict if isinstance(program, torch.export.ExportedProgram)
               else dict(graph_of(program).owning_module.named_parameters())).values()
    for tensor in tensors:
        tensor.requires_grad_(False)


@pytest.mark.parametrize("edit", [_keeps_acc_out_of_the_state_dict, _freezes_the_parameters])
@pytest.mark.parametrize("form", ["exported", "traced"])
def test_a_buffer_made_non_persistent_or_a_parameter_frozen_is_undone_and_measured(
        form, edit, request):
    """The module's set of non-persistent buffers and a parameter's requires_grad are edited
    in place: failing after that, the pass left ``acc`` out of the state_dict (the set put
    back was the very set it had edited) or the parameters frozen; succeeding, it was
    measured unmodified."""
    program = request.getfixturevalue(form)
    gm = graph_of(program).owning_module
    exported = program.state_dict if form == "exported" else {}
    state = {k: (v.clone(), v.requires_grad) for k, v in gm.state_dict(keep_vars=True).items()}
    exported_state = {k: v.requires_grad for k, v in exported.items()}

    def fails(_):
        edit(program)
        raise RuntimeError("boom")

    with pytest.raises(PassFailedError):
        PassManager([fails]).run(program)
    now = gm.state_dict(keep_vars=True)
    assert now.keys() == state.keys()
    assert all(torch.equal(now[k], v) and now[k].requires_grad == grad
               for k, (v, grad) in state.items())
    assert {k: v.requires_grad for k, v in exported.items()} == exported_state
    assert PassManager([lambda _: edit(program)]).run(program).modified
