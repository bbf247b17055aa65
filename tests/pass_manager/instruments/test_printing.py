"""PrintIR(before, after, after_change, after_failure, to): to a stream or folder."""

import io

import pytest

from pass_manager import PassManager, PassManagerError, PrintIR

from .failing_passes import AddToSub, FailAfterRewrite, Nothing


def _run(program, passes, **options):
    stream = io.StringIO()
    try:
        PassManager(passes, instruments=[PrintIR(to=stream, **options)]).run(program)
    except PassManagerError:
        pass
    return stream.getvalue()


def test_print_before_and_after_named_passes(exported):
    out = _run(exported, [Nothing(), AddToSub()], before=["AddToSub"],
               after=["AddToSub"])
    assert out.count("IR Dump") == 2
    before, after = out.split("// -----// IR Dump After AddToSub (#1) //----- //")
    assert "// -----// IR Dump Before AddToSub (#1) //----- //" in before
    assert "aten.add.Tensor" in before and "aten.add.Tensor" not in after
    assert "aten.sub.Tensor" in after and "Nothing" not in out


def test_print_after_change_prints_only_passes_that_changed_something(exported):
    out = _run(exported.module(), [Nothing(), AddToSub()], after_change=True)
    assert "IR Dump After AddToSub (#1)" in out
    assert "Nothing" not in out


def test_print_after_all(exported):
    out = _run(exported, [Nothing(), AddToSub()], after=True)
    assert "IR Dump After Nothing (#0)" in out and "IR Dump After AddToSub (#1)" in out


def test_print_after_failure_shows_what_the_pass_changed_and_the_rolled_back_program(exported):
    out = _run(exported, [FailAfterRewrite(message="boom")], after_failure=True)
    assert "IR Dump After Failure of FailAfterRewrite (#0)" in out
    assert "PassFailedError: pass #0 FailAfterRewrite failed: RuntimeError: boom" in out
    diff, rolled_back = out.split("// the program, rolled back:")
    assert "+" in diff and "aten.sub.Tensor" in diff  # the change, before the rollback
    assert "aten.sub.Tensor" not in rolled_back and "aten.add.Tensor" in rolled_back


def test_nothing_is_printed_without_the_options(exported, capsys):
    PassManager([AddToSub()]).run(exported)
    assert capsys.readouterr().out == ""


def test_print_to_a_folder_writes_one_file_per_dump(exported, tmp_path):
    with pytest.raises(PassManagerError):
        PassManager([AddToSub(), FailAfterRewrite()], instruments=[
            PrintIR(before=True, after_failure=True, to=tmp_path / "ir")]).run(exported)
    names = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert names == [
        "001-0-AddToSub-before.txt",
        "002-1-FailAfterRewrite-before.txt",
        "003-1-FailAfterRewrite-after-failure.txt",
    ]
    assert "aten.sub.Tensor" in (tmp_path / "ir" / names[1]).read_text()


def test_print_ir_is_an_instrument_a_user_can_add(exported):
    stream = io.StringIO()
    PassManager([AddToSub()], instruments=[PrintIR(after="AddToSub", to=stream)]).run(exported)
    assert "IR Dump After AddToSub (#0)" in stream.getvalue()
    assert "aten.sub.Tensor" in stream.getvalue()


def test_print_to_a_file_is_refused_where_it_is_given(exported, tmp_path):
    """Each dump made a folder of it: FileExistsError escaped the manager after the pass."""
    (tmp_path / "dump.txt").write_text("")
    with pytest.raises(ValueError, match="a file, not a folder; to= takes a folder"):
        PrintIR(after=True, to=tmp_path / "dump.txt")


def test_a_name_to_print_no_pass_of_the_run_has_is_a_report_warning(exported):
    printer = PrintIR(before=["NoSuchPass"], after=["AddToSub", "Other"], to=io.StringIO())
    report = PassManager([AddToSub()], instruments=[printer]).run(exported).report
    assert report.warnings == [
        "PrintIR: no pass of this run is named 'NoSuchPass': nothing printed for it",
        "PrintIR: no pass of this run is named 'Other': nothing printed for it"]
    assert printer.unmatched() == ["NoSuchPass", "Other"]
    quiet = PrintIR(after=["Other"], warn=False, to=io.StringIO())
    assert PassManager([AddToSub()], instruments=[quiet]).run(exported).report.warnings == []
