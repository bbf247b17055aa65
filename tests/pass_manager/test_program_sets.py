"""Several programs run by one pipeline (``PassManager.run({name: program})``)."""

import pytest

from pass_manager import PassManager, ProgramFormError

from .conftest import ReluToAbs


@pytest.mark.parametrize(("programs", "got"), [
    ({}, "got a mapping of no methods"),
    ({0: None}, "got a mapping named by [0]"),
])
def test_a_mapping_that_names_no_methods_is_a_program_form_error(programs, got):
    """It was a bare ValueError / TypeError from the manager."""
    with pytest.raises(ProgramFormError) as info:
        PassManager([ReluToAbs()]).run(programs)
    assert f"{got}; this pass accepts GraphModule or ExportedProgram or" in str(info.value)


def test_each_method_runs_and_keeps_its_form(exported, traced):
    result = PassManager([ReluToAbs()]).run({"a": exported, "b": traced})
    assert result.programs == {"a": exported, "b": traced} and result.modified


def test_a_joint_condition_amends_the_results_with_what_its_join_returned(exported, traced):
    """``join`` changes a program after the passes recorded it alone; ``amend`` gets each
    program's run result and that join's notes, last, to make the results say so. Before,
    there was no such hook: only callers that knew the condition could fix the records."""
    from pass_manager import program_sets

    seen = []

    class Marks(program_sets.JointCondition):
        name = "test: marks"

        def check(self, programs, when):
            pass

        def join(self, programs):
            return {"marked": ["b"]}

        def amend(self, results, joined):
            seen.append((sorted(results), dict(joined)))
            for name in joined["marked"]:
                results[name].report.records[-1].notes.append("marked by the join")

    program_sets.register_joint_condition(Marks())
    try:
        result = PassManager([ReluToAbs()]).run({"a": exported, "b": traced})
    finally:
        del program_sets._JOINT[Marks.name]
    assert seen == [(["a", "b"], {"marked": ["b"]})]
    assert result.notes["marked"] == ["b"]
    assert "marked by the join" in result["b"].report.records[-1].notes
    assert "marked by the join" not in result["a"].report.records[-1].notes
