"""Ordering passes by their conditions: dependency order, stable otherwise, cycles named."""

import pytest

from pass_manager import Condition, Pass, PassManager, PipelineError, function_pass

A = Condition("A", lambda p: [])
B = Condition("B", lambda p: [])
C = Condition("C", lambda p: [])


def make(name, requires=(), provides=()):
    return function_pass(lambda p: None, requires=requires, provides=provides, name=name)


def names(pm):
    return [p.name for p in pm.plan()]


def test_pass_requiring_a_later_provider_moves_after_it():
    pm = PassManager([make("needs_a", requires={A}), make("free"), make("gives_a", provides={A})])
    assert names(pm) == ["free", "gives_a", "needs_a"]


def test_list_order_is_kept_where_no_dependency_decides():
    listed = [make(f"p{i}") for i in range(6)]
    assert names(PassManager(listed)) == [f"p{i}" for i in range(6)]


def test_chain_of_dependencies_is_resolved_transitively():
    pm = PassManager(
        [
            make("third", requires={B}),
            make("second", requires={A}, provides={B}),
            make("first", provides={A}),
        ]
    )
    assert names(pm) == ["first", "second", "third"]


def test_cycle_is_a_pipeline_error_naming_the_cycle():
    with pytest.raises(PipelineError) as info:
        PassManager([make("x", requires={A}, provides={B}), make("y", requires={B}, provides={A})])
    message = str(info.value)
    assert "cycle" in message
    assert set(info.value.cycle) >= {"x", "y", "A", "B"}
    assert "x" in message and "y" in message


def test_explain_gives_a_reason_for_each_placement():
    pm = PassManager([make("needs_a", requires={A, C}), make("gives_a", provides={A})])
    text = pm.explain()
    assert "0. gives_a [listed #1]" in text
    assert "after gives_a (provides A)" in text
    assert "requires C: no pass here provides it, checked on the input" in text


def test_to_dot_is_the_pass_condition_dag():
    pm = PassManager([make("needs_a", requires={A}), make("gives_a", provides={A})])
    dot = pm.to_dot()
    assert dot.startswith("digraph")
    assert '"pass:1:gives_a" -> "condition:A"' in dot
    assert '"condition:A" -> "pass:0:needs_a"' in dot


def test_pass_that_requires_and_provides_the_same_condition_is_not_a_cycle():
    pm = PassManager([make("keeps_a", requires={A}, provides={A}), make("gives_a", provides={A})])
    assert names(pm) == ["gives_a", "keeps_a"]


def test_pipeline_rejects_a_pass_class_instead_of_an_instance():
    class Something(Pass):
        pass

    with pytest.raises(TypeError, match=r"Something\(\)"):
        PassManager([Something])


def test_a_declaration_of_names_instead_of_conditions_is_named_with_its_pass():
    class DeclaresAName(Pass):
        requires = frozenset({"Functional"})  # the condition's name, not the condition

        def call(self, program):
            return None

    with pytest.raises(TypeError, match=r"^DeclaresAName\.requires: expected Condition objects, "
                                        r"got 'Functional'"):
        PassManager([DeclaresAName()])
