"""Passes whose effects are only some node meta keys: the manager records only those
meta entries, rolls them back exactly when the pass fails, notices nodes added or removed
in any mode and puts the graph back, and under ``strict=True`` checks that nothing else changed
(EffectsError, kind "meta_keys")."""

import copy

import pytest
import torch

from pass_manager import (
    Condition,
    Effects,
    EffectsError,
    PassManager,
    assert_same_behaviour,
    function_pass,
    graph_of,
)
from pass_manager.program import program_text
from tests.models.accumulators import Accumulate
from tests.models.higher_order_ops import HIGHER_ORDER_CASES, BranchOnSign

from ..conftest import targets

Tagged = Condition(
    "Tagged",
    lambda p: [n.name for n in graph_of(p).nodes if n.op == "call_function"
               and "tag" not in n.meta],
    doc="every call_function node has meta['tag']",
)


def meta_of(program, *keys):
    return [(n.name, {k: n.meta.get(k) for k in keys}) for n in graph_of(program).nodes]


@function_pass(provides={Tagged},
               effects=Effects(rewrites=False, meta_keys={"tag", "note"}, in_place=None))
def tag_ops(program):
    for node in graph_of(program).nodes:
        if node.op == "call_function":
            node.meta["tag"] = str(node.target)
        node.meta.pop("note", None)


@function_pass(effects=Effects(rewrites=False, meta_keys={"tag"}, in_place=None))
def tag_then_fail(program):
    for node in graph_of(program).nodes:
        node.meta["tag"] = "partial"
    raise RuntimeError("the pass gives up half way")


@function_pass(effects=Effects(rewrites=False, meta_keys={"tag"}, in_place=None))
def tag_and_add_a_node(program):
    graph = graph_of(program)
    relu = targets(program, "relu")[0]
    relu.meta["tag"] = "relu"
    with graph.inserting_after(relu):
        neg = graph.call_function(torch.ops.aten.neg.default, (relu,))
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)


@function_pass(effects=Effects(rewrites=False, meta_keys={"tag"}, in_place=None))
def tag_and_remove_a_node(program):
    relu = targets(program, "relu")[0]
    relu.meta["tag"] = "relu"
    relu.replace_all_uses_with(relu.args[0])  # the relu's users now read its input
    graph_of(program).erase_node(relu)


@function_pass(effects=Effects(rewrites=False, meta_keys={"tag"}, in_place=None))
def tag_and_change_an_argument(program):
    mul = targets(program, "mul")[0]
    mul.meta["tag"] = "mul"
    mul.args = (mul.args[0], 3.0)


@function_pass(effects=Effects(rewrites=False, meta_keys={"tag"}, in_place=None))
def tag_and_set_another_key(program):
    for node in graph_of(program).nodes:
        node.meta["tag"] = 1
        node.meta["undeclared"] = 2


@function_pass(effects=Effects(rewrites=False, meta_keys={"tag"}, in_place=None))
def replace_meta_dicts_and_fail(program):
    for node in graph_of(program).nodes:
        node.meta = {"tag": "new"}
    raise RuntimeError("fails after replacing every meta dict")


@pytest.mark.parametrize("form", ["exported", "traced"])
def test_a_meta_only_pass_runs_checked_and_the_program_still_computes_the_same(form, request):
    program = request.getfixturevalue(form)
    for node in graph_of(program).nodes:
        node.meta["note"] = "old"
    reference = Accumulate()
    result = PassManager([tag_ops]).run(program)
    assert result.modified and result.program is program
    assert Tagged.holds(program)
    assert all("note" not in n.meta for n in graph_of(program).nodes)
    assert_same_behaviour(reference, program, [(torch.ones(4),)] * 4)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("form", ["exported", "traced"])
def test_a_failing_meta_only_pass_is_rolled_back_exactly(form, strict, request):
    program = request.getfixturevalue(form)
    first = next(iter(graph_of(program).nodes))
    first.meta["tag"] = "kept"
    before = meta_of(program, "tag")
    with pytest.raises(Exception, match="gives up half way") as caught:
        PassManager([tag_then_fail], strict=strict).run(program)
    assert caught.value.rolled_back
    assert meta_of(program, "tag") == before  # the first node's "kept", no other tag


@pytest.mark.parametrize("form", ["exported", "traced"])
def test_replaced_meta_dicts_are_put_back(form, request):
    program = request.getfixturevalue(form)
    dicts = [n.meta for n in graph_of(program).nodes]
    with pytest.raises(Exception, match="replacing every meta dict"):
        PassManager([replace_meta_dicts_and_fail]).run(program)
    assert all(n.meta is d for n, d in zip(graph_of(program).nodes, dicts, strict=True))
    assert all("tag" not in d for d in dicts)


@pytest.mark.parametrize("form", ["exported", "traced"])
@pytest.mark.parametrize(("broken", "message", "changed_line"), [
    (tag_and_add_a_node, "added neg", "+"),
    (tag_and_remove_a_node, "removed relu", "-"),
])
def test_nodes_a_meta_only_pass_adds_or_removes_are_an_error_and_put_back(
        form, broken, message, changed_line, request):
    program = request.getfixturevalue(form)
    text, tags = program_text(program), meta_of(program, "tag")
    reference = Accumulate()
    with pytest.raises(EffectsError, match=message) as caught:
        PassManager([broken]).run(program)
    # The meta-only record keeps the nodes' fields: the graph is rebuilt as it was.
    assert caught.value.rolled_back and not caught.value.unrestored
    node = message.split()[1]
    assert any(line.startswith(changed_line) and node in line
               for line in caught.value.diff.splitlines())
    assert program_text(program) == text
    assert meta_of(program, "tag") == tags
    assert_same_behaviour(reference, program, [(torch.randn(4),) for _ in range(4)])


@pytest.mark.parametrize("form", ["exported", "traced"])
def test_strict_mode_finds_and_undoes_any_undeclared_edit(form, request):
    program = request.getfixturevalue(form)
    text, tags = program_text(program), meta_of(program, "tag", "undeclared")
    reference = Accumulate()
    with pytest.raises(EffectsError, match="arguments") as caught:
        PassManager([tag_and_change_an_argument], strict=True).run(program)
    assert caught.value.rolled_back and not caught.value.unrestored
    with pytest.raises(EffectsError, match="meta keys other than"):
        PassManager([tag_and_set_another_key], strict=True).run(program)
    with pytest.raises(EffectsError, match="nodes or their arguments") as caught:
        PassManager([tag_and_add_a_node], strict=True).run(program)
    assert not caught.value.unrestored  # the full snapshot took the node back out
    assert program_text(program) == text
    assert meta_of(program, "tag", "undeclared") == tags
    assert_same_behaviour(reference, program, [(torch.ones(4),)] * 4)


def test_undeclared_meta_keys_go_unnoticed_without_strict_but_are_kept():
    # Documents the trade: without strict, only the declared keys are recorded, so an
    # undeclared key set by a *successful* pass stays (it is not an error).
    program = torch.export.export(Accumulate(), (torch.ones(4),))
    PassManager([tag_and_set_another_key]).run(program)
    assert all(n.meta.get("undeclared") == 2 for n in graph_of(program).nodes)


@function_pass(effects=Effects(rewrites=False, meta_keys={"tag"}, in_place=None))
def tag_and_add_a_node_in_a_branch(program):
    top = graph_of(program).owning_module
    for module in top.modules():
        if isinstance(module, torch.fx.GraphModule) and module is not top:
            for node in module.graph.nodes:
                node.meta["tag"] = "branch"
            result = module.graph.output_node().args[0][0]
            with module.graph.inserting_after(result):
                module.graph.call_function(torch.ops.aten.neg.default, (result,))


@pytest.mark.parametrize("strict", [False, True])
def test_a_node_a_meta_only_pass_adds_in_a_cond_branch_is_an_error_and_put_back(strict):
    _, _, calls = HIGHER_ORDER_CASES["cond"]
    program = torch.export.export(BranchOnSign(), calls[0])
    before = copy.deepcopy(program)
    branches = [m for m in program.graph_module.modules() if m is not program.graph_module]
    with pytest.raises(EffectsError, match=r"added neg|the graph's nodes"):
        PassManager([tag_and_add_a_node_in_a_branch], strict=strict).run(program)
    for branch in branches:
        assert not branch.graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default)
        assert all("tag" not in node.meta for node in branch.graph.nodes)
    assert_same_behaviour(before, program, calls)
