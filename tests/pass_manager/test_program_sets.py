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
