"""One declaration of what a pass may touch (``Effects``): the presets, the record the core
loop picks from it, a rewrite that names the meta keys it touches (its rollback is exact,
``strict`` checks the claim), groups, and passes written against the old attributes."""


import pytest
import torch

from pass_manager import (
    Effects,
    EffectsError,
    Pass,
    PassFailedError,
    PassManager,
    PassResult,
    assert_same_behaviour,
    function_pass,
    graph_of,
)
from pass_manager.program import program_text
from tests.models.accumulators import Accumulate

from .conftest import targets


def fresh(form):
    if form == "exported":
        return torch.export.export(Accumulate(), (torch.ones(4),))
    return torch.fx.symbolic_trace(Accumulate())


def meta_of(program):
    return [(n.name, dict(n.meta)) for n in graph_of(program).nodes]


def test_the_presets_say_what_a_pass_may_touch():
    marking = Effects.only_meta("tag", "note")
    assert (marking.rewrites, marking.meta_keys, marking.edits_meta_in_place) == (
        False, frozenset({"tag", "note"}), False)
    assert marking.meta_only and repr(marking) == "Effects.only_meta('note', 'tag')"
    rewrite = Effects.rewrite(meta_keys=())
    assert rewrite.rewrites and rewrite.meta_keys == frozenset() and not rewrite.meta_only
    assert Effects.rewrite(in_place=False).in_place is False
    anything = Effects.anything()
    assert anything.writes_state and anything.in_place is None and anything.edits_meta_in_place
    assert Effects() == Pass.effects  # the cautious default of a user's own pass
    with pytest.raises(TypeError, match="collection of keys"):
        Effects(meta_keys="tag")
    with pytest.raises(TypeError, match="collection of keys"):  # not the keys t, a, g
        Effects.rewrite(meta_keys="tag")
    assert Effects.rewrite(meta_keys=["tag"]).meta_keys == frozenset({"tag"})
    with pytest.raises(TypeError, match="in_place"):
        Effects(in_place="yes")


def test_a_pass_exposes_at_most_six_declarations():
    public = [name for name in dir(Pass)
              if not name.startswith("_") and not callable(getattr(Pass, name))]
    assert sorted(public) == ["accepts", "effects", "name", "preserves", "provides", "requires"]


def _neg_after_relu(program):
    """Adds a neg after the relu (new node, new meta); existing nodes' meta untouched."""
    graph = graph_of(program)
    relu = targets(program, "relu")[0]
    with graph.inserting_after(relu):
        neg = graph.call_function(torch.ops.aten.neg.default, (relu,))
    neg.meta["tag"] = "new"
    relu.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)


@pytest.mark.parametrize("form", ["exported", "traced"])
@pytest.mark.parametrize("strict", [False, True])
def test_a_rewrite_naming_no_meta_keys_runs_and_its_failure_is_undone(form, strict):
    program = fresh(form)
    reference = Accumulate()
    adds = function_pass(_neg_after_relu, effects=Effects.rewrite(meta_keys=()), name="adds")
    result = PassManager([adds], strict=strict).run(program)
    assert result.modified and "neg" in program_text(program)
    run = result.program.module() if form == "exported" else result.program
    x = torch.ones(4)
    for step in range(1, 4):
        expected = -torch.relu(reference.linear(x * step)) * 2 + 1
        assert torch.equal(run(x), expected)
        assert torch.equal(run.acc, x * step)

    program = fresh(form)
    before, text = meta_of(program), program_text(program)

    def adds_then_fails(program):
        _neg_after_relu(program)
        raise RuntimeError("gives up after adding a node")

    failing = function_pass(adds_then_fails, effects=Effects.rewrite(meta_keys=()))
    with pytest.raises(PassFailedError) as info:
        PassManager([failing], strict=strict).run(program)
    assert info.value.rolled_back and "neg" in info.value.diff
    assert program_text(program) == text and meta_of(program) == before
    assert_same_behaviour(Accumulate(), program, [(torch.ones(4),)] * 3)


@pytest.mark.parametrize("strict", [False, True])
def test_a_rewrite_naming_its_meta_keys_gets_them_back_on_failure(traced, strict):
    for node in graph_of(traced).nodes:
        node.meta["tag"] = "old"
    before, text = meta_of(traced), program_text(traced)

    def retags_and_fails(program):
        for node in graph_of(program).nodes:
            node.meta["tag"] = "new"
        targets(program, "mul")[0].meta.pop("tag")
        _neg_after_relu(program)
        raise RuntimeError("boom")

    failing = function_pass(retags_and_fails, effects=Effects.rewrite(meta_keys={"tag"}))
    with pytest.raises(PassFailedError):
        PassManager([failing], strict=strict).run(traced)
    assert program_text(traced) == text and meta_of(traced) == before


def test_strict_checks_the_meta_keys_a_rewrite_names(traced):
    before, text = meta_of(traced), program_text(traced)

    def touches_an_existing_node(program):
        _neg_after_relu(program)
        targets(program, "relu")[0].meta["undeclared"] = 1

    declared = function_pass(touches_an_existing_node, effects=Effects.rewrite(meta_keys=()),
                             name="touches")
    with pytest.raises(EffectsError, match="relu: meta keys other than") as info:
        PassManager([declared], strict=True).run(traced)
    assert info.value.pass_name == "touches" and info.value.rolled_back
    assert program_text(traced) == text and meta_of(traced) == before


def test_a_group_declares_what_its_passes_may_touch():
    tag = function_pass(lambda p: None, effects=Effects.only_meta("tag"), name="tag")
    note = function_pass(lambda p: None, effects=Effects.only_meta("note"), name="note")
    rewrite = function_pass(lambda p: None, effects=Effects.rewrite(), name="rewrite")
    assert PassManager([tag, note]).effects == Effects.only_meta("tag", "note")
    group = PassManager([tag, rewrite]).effects
    assert group.rewrites and group.meta_keys is None and group.in_place is True
    writes = function_pass(lambda p: None, effects=Effects(writes_state=True, in_place=None))
    assert PassManager([tag, writes]).effects.writes_state
    assert PassManager([tag, writes]).effects.in_place is None


class _Reset(Pass):
    effects = Effects(writes_state=True)

    def call(self, program):
        for buffer in program.buffers():
            buffer.zero_()
        raise RuntimeError("fails after writing")


class _Undeclared(Pass):
    def call(self, program):
        for buffer in program.buffers():
            buffer.add_(1)
        return PassResult(program, True)


def test_a_declared_state_write_is_restored_and_an_undeclared_one_is_an_error(traced):
    traced(torch.ones(4))
    acc = traced.acc.clone()
    with pytest.raises(PassFailedError) as info:
        PassManager([_Reset()]).run(traced)
    assert info.value.unrestored == [] and torch.equal(traced.acc, acc)  # data restored
    with pytest.raises(EffectsError, match="writes_state = True"):
        PassManager([_Undeclared()]).run(traced)


def test_effects_declared_as_a_string_is_refused_where_the_pass_is_given(exported):
    class Tags(Pass):
        effects = "only_meta"

        def call(self, program):
            return PassResult(program, False)

    with pytest.raises(TypeError, match=r"Tags\.effects is 'only_meta': declare an Effects, "
                                        r"e.g. effects = Effects.rewrite\(\)"):
        PassManager([Tags()])
    with pytest.raises(TypeError, match=r"Tags\.effects is 'only_meta'"):
        Tags()(exported)
