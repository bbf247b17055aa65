"""Running passes: condition checks and their cache, change detection, reports, hooks."""

import copy
import functools
import gc
import pickle
import threading
import time

import pytest
import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from pass_manager import (
    ALL_CONDITIONS,
    Condition,
    Effects,
    EffectsError,
    Instrumentation,
    Pass,
    PassFailedError,
    PassManager,
    PassResult,
    PipelineElementError,
    PipelineError,
    PostconditionError,
    PreconditionError,
    PrintDiff,
    PrintIR,
    ProgramFormError,
    SemanticsError,
    SemanticValidation,
    Timing,
    assert_same_behaviour,
    function_pass,
    graph_of,
)
from tests.models.accumulators import Accumulate

from .conftest import NoRelu, ReluToAbs, targets


class CountingCondition(Condition):
    """A condition that counts how often its checker runs."""

    def __init__(self, name, check):
        self.calls = 0

        def counted(program):
            self.calls += 1
            return check(program)

        super().__init__(name, counted)


def relu_to_abs(program):
    for node in targets(program, "relu"):
        node.target = torch.ops.aten.abs.default if node.op == "call_function" else node.target


def test_run_returns_same_form_with_report(exported, traced):
    for program in (exported, traced):
        result = PassManager([ReluToAbs()]).run(program)
        assert type(result.program) is type(program)
        assert result.modified
        assert result.graph_module is graph_of(result.program).owning_module
        record = result.report.records[0]
        assert record.name == "ReluToAbs" and record.modified
        assert record.nodes_before == record.nodes_after
        assert record.checked == ["NoRelu"]
        assert "ReluToAbs" in result.report.table()


def test_rewrite_runs_and_recompiles(traced):
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    result = PassManager([ReluToAbs()]).run(traced)
    assert "abs" in result.graph_module.code
    expected = torch.abs(traced.linear(x)) * 2 + 1  # buffer starts at zero: acc == x
    torch.testing.assert_close(result.graph_module(x), expected)


def test_missing_requirement_is_checked_on_input_and_names_providers(exported):
    @function_pass(requires={NoRelu})
    def needs_no_relu(program):
        return None

    with pytest.raises(PreconditionError) as info:
        PassManager([needs_no_relu]).run(exported)
    error = info.value
    assert error.condition == "NoRelu" and error.pass_name == "needs_no_relu" and error.index == 0
    assert any("relu" in v for v in error.violations)
    assert "ReluToAbs" in str(error)  # a known pass that provides it


class NeedsNoRelu(Pass):
    requires = frozenset({NoRelu})

    def call(self, program):
        return PassResult(program, False)


def test_a_pass_called_alone_is_told_what_to_run_before_it(traced):
    with pytest.raises(PreconditionError) as info:
        NeedsNoRelu()(traced)
    hint = str(info.value).splitlines()[-1]
    assert hint == (
        "This pass was called alone, so nothing in its run provides NoRelu: run ReluToAbs "
        "on the program first, or both in one pipeline: "
        "PassManager([ReluToAbs(), NeedsNoRelu()]).run(program)."
    )
    with pytest.raises(PreconditionError) as info:  # a pipeline is told of its own passes
        PassManager([NeedsNoRelu()]).run(traced)
    assert "called alone" not in str(info.value)
    assert "No pass in this pipeline provides it; add one of: ReluToAbs." in str(info.value)
    NeedsNoRelu()(ReluToAbs()(traced).graph_module)  # the advice works


def test_a_requirement_a_later_pass_broke_names_that_pass(traced):
    """The pipeline provides NoRelu, so the error said only that it does not hold: not that
    it held until a pass that does not preserve it changed the program."""

    def abs_back_to_relu(program):
        for node in targets(program, "abs"):
            node.target = torch.relu

    with pytest.raises(PreconditionError) as info:
        PassManager([ReluToAbs(), function_pass(abs_back_to_relu), NeedsNoRelu()]).run(traced)
    assert str(info.value).splitlines()[-1] == (
        "It held until pass #1 abs_back_to_relu, which changed the program and does not list "
        "it in preserves: that pass broke it, or NeedsNoRelu must run before it.")
    assert targets(traced, "relu") and not targets(traced, "abs")  # as #1 left it


def test_a_dead_pass_class_is_not_offered_as_a_provider(traced):
    """A class of a finished function (another test's, a notebook cell's) is dead, but a
    reference cycle keeps it until the garbage collector runs: the hint must not name it."""
    def define():
        class DeadProvider(Pass):
            provides = frozenset({NoRelu})

    gc.disable()
    try:
        define()
        with pytest.raises(PreconditionError) as info:
            NeedsNoRelu()(traced)
    finally:
        gc.enable()
    assert "DeadProvider" not in str(info.value)
    assert "run ReluToAbs on the program first" in str(info.value)


def test_requirement_provided_earlier_is_not_rechecked():
    checker = CountingCondition("Holds", lambda p: [])

    @function_pass(provides={checker})
    def provide(program):
        return None

    @function_pass(requires={checker}, preserves={checker})
    def use_once(program):
        return None

    @function_pass(requires={checker})
    def use_twice(program):
        return None

    result = PassManager([provide, use_once, use_twice]).run(
        torch.fx.symbolic_trace(torch.nn.ReLU())
    )
    assert checker.calls == 1
    assert result.report.records[1].cached == ["Holds"]
    assert result.report.records[2].cached == ["Holds"]


def test_changing_pass_invalidates_what_it_does_not_preserve(traced):
    kept = CountingCondition("Kept", lambda p: [])
    dropped = CountingCondition("Dropped", lambda p: [])

    @function_pass(provides={kept, dropped})
    def provide(program):
        return None

    class Rewrite(ReluToAbs):
        provides = frozenset()
        preserves = frozenset({kept})

    @function_pass(requires={kept, dropped})
    def consume(program):
        return None

    PassManager([provide, Rewrite(), consume]).run(traced)
    assert kept.calls == 1  # preserved across the rewrite: cached
    assert dropped.calls == 2  # invalidated by the rewrite: checked again


def test_unchanged_program_keeps_every_cached_result(traced):
    checker = CountingCondition("Anything", lambda p: [])

    @function_pass(provides={checker})
    def provide(program):
        return None

    @function_pass()
    def look_only(program):
        return PassResult(program, False)

    @function_pass(requires={checker})
    def consume(program):
        return None

    PassManager([provide, look_only, consume]).run(traced)
    assert checker.calls == 1


def test_preserves_all_keeps_every_result(traced):
    checker = CountingCondition("Anything", lambda p: [])

    @function_pass(provides={checker})
    def provide(program):
        return None

    @function_pass(preserves=ALL_CONDITIONS)
    def annotate(program):
        for node in graph_of(program).nodes:
            node.meta["seen"] = True

    @function_pass(requires={checker})
    def consume(program):
        return None

    result = PassManager([provide, annotate, consume]).run(traced)
    assert result.report.records[1].modified  # meta changed: measured as a change
    assert checker.calls == 1


def test_pass_lying_about_modified_is_reported_and_strict_mode_rejects_it(traced):
    class Liar(ReluToAbs):
        def call(self, program):
            super().call(program)
            return PassResult(program, False)

    result = PassManager([Liar()]).run(torch.fx.symbolic_trace(traced))
    assert result.report.records[0].modified is True
    assert any("reported 'unmodified' but changed" in w for w in result.report.warnings)

    before = traced.code
    with pytest.raises(PassFailedError, match="reported 'unmodified'"):
        PassManager([Liar()], strict=True).run(traced)
    assert traced.code == before


def test_program_form_is_enforced(exported):
    class GraphModuleOnly(ReluToAbs):
        accepts = ("GraphModule",)

    with pytest.raises(ProgramFormError) as info:
        PassManager([GraphModuleOnly()]).run(exported)
    assert "ExportedProgram" in str(info.value) and info.value.pass_name == "GraphModuleOnly"
    assert info.value.violations == [
        "got an ExportedProgram; this pass accepts GraphModule: pass its .module()"]
    with pytest.raises(ProgramFormError) as info:
        GraphModuleOnly()(torch.nn.ReLU())
    assert info.value.got == "ReLU" and info.value.advice == (
        "export it first (torch.export.export(module, example_args)) and pass the "
        "ExportedProgram or its .module()")


def test_hooks_wrap_every_pass_and_after_hooks_run_in_reverse(traced):
    events = []

    class Recorder(Instrumentation):
        def __init__(self, tag):
            self.tag = tag

        def before_pass(self, pass_, program, record):
            events.append(f"before {self.tag} {pass_.name}")

        def after_pass(self, pass_, program, record):
            events.append(f"after {self.tag} {pass_.name} modified={record.modified}")

    PassManager([ReluToAbs()], instruments=[Recorder("outer"), Recorder("inner")]).run(traced)
    assert events == [
        "before outer ReluToAbs",
        "before inner ReluToAbs",
        "after inner ReluToAbs modified=True",
        "after outer ReluToAbs modified=True",
    ]


def test_print_diff_shows_the_change(traced, capsys):
    PassManager([ReluToAbs()], instruments=[PrintDiff()]).run(traced)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["--- before ReluToAbs", "+++ after ReluToAbs"]
    removed = [line for line in lines[2:] if line.startswith("-")]
    added = [line for line in lines[2:] if line.startswith("+")]
    assert len(removed) == len(added) == 1
    # The node keeps its name (%relu); its target changes.
    assert "target=torch.relu" in removed[0] and "%relu" in removed[0]
    assert "target=torch.abs" in added[0] and "%relu" in added[0]


def test_print_diff_to_a_file_path_appends_every_diff_and_blames_no_pass(traced, tmp_path):
    """PrintDiff("diff.txt") raised AttributeError in the first changing pass's hook, reported
    as that pass failing (PassFailedError naming ReluToAbs)."""
    path = tmp_path / "diff.txt"
    PassManager([ReluToAbs()], instruments=[PrintDiff(str(path))]).run(traced)
    lines = path.read_text().splitlines()
    assert lines[:2] == ["--- before ReluToAbs", "+++ after ReluToAbs"]
    with pytest.raises(ValueError, match="a folder; PrintDiff takes a file path"):
        PrintDiff(tmp_path)
    with pytest.raises(TypeError, match="a text stream or a file path, got int"):
        PrintDiff(3)


def test_print_diff_is_silent_when_nothing_changed(traced, capsys):
    PassManager([function_pass(lambda p: None, name="look")], instruments=[PrintDiff()]).run(
        traced)
    assert capsys.readouterr().out == ""


def test_a_timing_instrument_given_by_the_user_reports_each_pass_once(traced):
    """Timing is public; given as an instrument beside the one every run has, each pass was
    reported as taking the process's clock reading (hundreds of seconds)."""
    started = time.perf_counter()
    result = PassManager([ReluToAbs()], instruments=[Timing()]).run(traced)
    elapsed = time.perf_counter() - started
    assert 0 < result.report.records[0].wall_time <= elapsed
    nested = PassManager([PassManager([ReluToAbs()], instruments=[Timing()])],
                         instruments=[Timing()])
    record = nested.run(torch.fx.symbolic_trace(Accumulate())).report.records[0]
    assert 0 < record.wall_time <= time.perf_counter() - started


def test_the_instruments_of_a_pipeline_see_the_passes_of_a_group_in_it(exported):
    """A PassManager used as a pass ran its passes under its own instruments only: the
    outer PrintIR(before=[...]) printed nothing, and the outer SemanticValidation blamed
    the group, not the pass in it that changed the result (MLIR's nested pass managers
    share their parent's instrumentation)."""
    import io

    eager, x = Accumulate(), torch.ones(4)
    printed = io.StringIO()
    printing = PrintIR(before=["ReluToAbs"], to=printed)  # given to both: printed once
    group = PassManager([function_pass(lambda p: None, name="look"), ReluToAbs()],
                        instruments=[printing], name="group")
    outer = PassManager([group], instruments=[printing, SemanticValidation((x,))])
    with pytest.raises(SemanticsError, match=r"pass #1 ReluToAbs changed what the program "
                       "computes") as failure:
        outer.run(exported)
    assert failure.value.rolled_back and printed.getvalue().count("IR Dump Before ReluToAbs") == 1
    assert targets(exported, "relu") and not failure.value.report.warnings
    module = exported.module()
    for _ in range(3):  # rolled back: the program computes what eager does, state included
        assert torch.equal(module(x), eager(x)) and torch.equal(module.acc, eager.acc)


def test_report_separates_check_time_and_serializes(traced):
    result = PassManager([ReluToAbs()]).run(traced)
    record = result.report.records[0]
    assert record.wall_time >= record.check_time > 0
    data = result.report.to_dict()
    assert data["records"][0]["name"] == "ReluToAbs"
    assert '"ReluToAbs"' in result.report.to_json()


@pytest.mark.parametrize("declared", ["requires", "provides"])
def test_a_condition_whose_check_raises_is_named_not_blamed_on_the_pass(traced, declared):
    """It was reported as the pass failing with the check's bare KeyError."""
    buggy = Condition("Buggy", lambda program: {}["missing"])
    before = [n.target for n in graph_of(traced).nodes]
    replaced = function_pass(relu_to_abs, **{declared: {buggy}})
    with pytest.raises(PassFailedError) as info:
        PassManager([replaced]).run(traced)
    assert info.value.pass_name == "relu_to_abs"
    assert "the check of condition 'Buggy' raised KeyError" in info.value.reason
    assert isinstance(info.value.__cause__, KeyError)
    assert [n.target for n in graph_of(traced).nodes] == before  # rolled back


@pytest.mark.parametrize("answer", [False, True, "a relu is left", None])
def test_a_check_answering_yes_or_no_or_one_string_is_named_not_read_as_violations(
        traced, answer):
    """False ("does not hold") passed as holding; a string was one violation per letter;
    None (a check that forgot its return) passed as holding."""
    answers = Condition("Answers", lambda program: answer)
    before = [n.target for n in graph_of(traced).nodes]
    with pytest.raises(PassFailedError) as info:
        PassManager([function_pass(relu_to_abs, requires={answers})]).run(traced)
    assert (f"the check of condition 'Answers' raised TypeError: check returned {answer!r}, not "
            "the violations: a list of strings") in info.value.reason
    assert [n.target for n in graph_of(traced).nodes] == before


@pytest.mark.parametrize("mistake", [
    lambda: PassManager(ReluToAbs()),
    lambda: PassManager([ReluToAbs()], instruments=PrintDiff()),
    lambda: PassManager([ReluToAbs()], instruments=[PrintDiff]),
    lambda: PassManager([ReluToAbs()], instruments=[object()]),
], ids=["a pass", "an instrument", "an instrument class", "not an instrument"])
def test_passes_and_instruments_not_given_as_lists_of_them_are_named(mistake):
    """They failed as "'ReluToAbs' object is not iterable", or at the first hook with
    "before_run() missing 1 required positional argument" / an AttributeError."""
    with pytest.raises(TypeError, match=r"PassManager takes its passes and instruments as lists|"
                                        r"is not an Instrumentation instance"):
        mistake()


class _HookTakingTooLittle(Instrumentation):
    def before_pass(self, record):  # the core loop calls before_pass(pass_, program, record)
        pass


class _NoCall(Pass):  # forgot call(program)
    pass


@pytest.mark.parametrize(("passes", "instruments", "role", "says"), [
    ([ReluToAbs()], [object()], "instrument",
     r"instrument <object object at .*> is not an Instrumentation instance: give an instance "
     r"of pass_manager\.Instrumentation"),
    ([ReluToAbs()], [_HookTakingTooLittle()], "instrument",
     r"its hook before_pass cannot be called as before_pass\(pass_, program, record\)"),
    ([_NoCall()], [], "pass", r"_NoCall must implement call\(program\)"),
    ([ReluToAbs(), 3], [], "pass", r"pipeline element 3 is not a pass: give a Pass instance"),
], ids=["object()", "a hook's parameters", "a pass without call", "a number"])
def test_what_is_no_pass_or_instrument_is_a_typed_error_when_the_manager_is_built(
        passes, instruments, role, says):
    """``instruments=[object()]`` was a bare TypeError, a hook of other parameters an
    InstrumentError at the first pass, a Pass without ``call`` a PassFailedError at its turn
    (after the passes before it had run)."""
    with pytest.raises(PipelineElementError, match=says) as caught:
        PassManager(passes, instruments=instruments)
    assert isinstance(caught.value, PipelineError) and isinstance(caught.value, TypeError)
    assert caught.value.role == role and caught.value.needs


@pytest.mark.parametrize("preserves", [frozenset({NoRelu}), ALL_CONDITIONS],
                         ids=["named", "everything"])
def test_strict_checks_what_a_changing_pass_claims_to_preserve(traced, preserves):
    """The claim was trusted even under strict=True: the next pass requiring the condition
    ran on a program that broke it, and the pass that broke it was never named."""
    class AbsToRelu(Pass):
        def call(self, program):
            for node in targets(program, "abs"):
                node.target = torch.relu
            return PassResult(program, True)

    AbsToRelu.preserves = preserves
    needs = function_pass(lambda program: None, requires={NoRelu}, name="needs_no_relu")
    lax = PassManager([ReluToAbs(), AbsToRelu(), needs]).run(copy.deepcopy(traced))
    assert [r.name for r in lax.report.records] == ["ReluToAbs", "AbsToRelu", "needs_no_relu"]
    before = [n.target for n in graph_of(traced).nodes]
    with pytest.raises(PostconditionError) as info:
        PassManager([ReluToAbs(), AbsToRelu(), needs], strict=True).run(traced)
    assert (info.value.pass_name, info.value.condition) == ("AbsToRelu", "NoRelu")
    assert info.value.hint == "AbsToRelu declares it preserves it."
    assert [n.target for n in graph_of(traced).nodes] != before  # ReluToAbs' rewrite stays
    assert not targets(traced, "relu")  # and AbsToRelu's is rolled back


def test_a_pass_returning_the_other_form_shows_no_change_it_did_not_make(exported):
    """The rollback diff compared the program's text with the returned graph module's, so
    it listed the signature's lines as removed: changes the pass had not made."""
    to_module = function_pass(lambda program: program.module(), name="to_module")
    with pytest.raises(PassFailedError) as info:
        PassManager([to_module]).run(exported)
    assert info.value.reason == ("returned a GraphModule for the ExportedProgram it was given: "
                                 "a pass returns its form")
    assert info.value.diff == ""
    assert str(info.value).endswith("The pass was rolled back; the graph as printed had not "
                                    "changed (node meta and tensor data are not printed).")


def test_strict_rejecting_a_meta_edit_claimed_unmodified_does_not_deny_the_change(traced):
    """The change is in node meta, which the printed graph does not show: the message said
    "changed the program" then "it had not changed the graph"."""
    @function_pass
    def tags(program):
        for node in graph_of(program).nodes:
            node.meta["tag"] = 1
        return PassResult(program, False)

    with pytest.raises(PassFailedError) as info:
        PassManager([tags], strict=True).run(traced)
    message = str(info.value)
    assert message.startswith("pass #0 tags failed: reported 'unmodified' but changed the program")
    assert "had not changed the graph" not in message
    assert message.endswith("the graph as printed had not changed (node meta and tensor data "
                            "are not printed).")
    assert all("tag" not in node.meta for node in graph_of(traced).nodes)  # rolled back


@pytest.mark.parametrize("returned", [{"notes": "one remark"}, {"statistics": {"ops": "3"}},
                                      {"statistics": {"ops": torch.tensor(3)}}],
                         ids=["a string of notes", "a string count", "a tensor count"])
def test_notes_or_statistics_the_report_cannot_read_are_named_at_the_pass(traced, returned):
    """A string of notes became one note per letter; a count that is no number passed, then
    printing the report raised 'Unknown format code'."""
    def remarks(program):
        relu_to_abs(program)
        return PassResult(program, True, **returned)

    before = [n.target for n in graph_of(traced).nodes]
    with pytest.raises(PassFailedError, match="notes are a list of strings, statistics "
                                              r"\{description: number\}"):
        PassManager([function_pass(remarks)]).run(traced)
    assert [n.target for n in graph_of(traced).nodes] == before


def _drop_buffer_from_state(program):
    del program.state_dict["acc"]  # the signature and the graph still read it


def _add_input_to_graph_alone(program):
    graph = graph_of(program)
    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
        graph.placeholder("extra")


def _rename(program, node):
    """Renames an input (``x``), a buffer's placeholder (``b_acc``) or the output (``add``)
    in the graph alone: the run succeeded, and ``ep.validate()``, ``torch.export.save`` and
    ExecuTorch's ``to_edge`` later raised SpecViolationError, naming no pass."""
    found = next(n for n in graph_of(program).nodes if n.name == node)
    if found.op == "placeholder":
        found.target = "renamed"
    found.name = "renamed"


@pytest.mark.parametrize(("edit", "reason"), [
    (_drop_buffer_from_state, "Buffer acc is not in the state dict"),
    (_add_input_to_graph_alone, "Placeholders missing input_specs: {'extra'}"),
    *[(functools.partial(_rename, node=node),
       f"its signature names {node!r} where the graph has node 'renamed'")
      for node in ("x", "b_acc", "add")],
], ids=["dropped buffer", "input alone", "renamed input", "renamed buffer", "renamed output"])
def test_a_pass_leaving_the_signature_out_of_step_is_named_and_rolled_back(exported, edit,
                                                                            reason):
    calls = [(torch.ones(4),), (torch.full((4,), -3.0),), (torch.arange(4.0),)]
    before = copy.deepcopy(exported)
    edits = function_pass(edit, name="edit_state", accepts=("ExportedProgram",))
    with pytest.raises(PassFailedError, match="edit_state") as raised:
        PassManager([edits]).run(exported)
    assert reason in str(raised.value) and raised.value.rolled_back
    assert_same_behaviour(before, exported, calls)


def _add_output(program, with_out_spec):
    """Return the input doubled as a second user output; ``with_out_spec``: also in the call
    spec ``ep.module()`` builds its result with."""
    graph = graph_of(program)
    output = graph.output_node()
    x = graph.find_nodes(op="placeholder")[-1]
    with graph.inserting_before(output):
        doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    doubled.meta["val"] = x.meta["val"]
    output.args = ((*output.args[0], doubled),)
    program.graph_signature.output_specs.append(OutputSpec(
        OutputKind.USER_OUTPUT, TensorArgument(doubled.name), None))
    if with_out_spec:
        signature = program.module_call_graph[0].signature
        signature.out_spec = pytree.tree_structure((0, 0))


def test_a_pass_adding_an_output_without_its_call_spec_is_named_and_rolled_back(exported):
    calls = [(torch.ones(4),), (torch.full((4,), -3.0),), (torch.arange(4.0),)]
    before = copy.deepcopy(exported)
    edit = function_pass(lambda p: _add_output(p, with_out_spec=False), name="add_output",
                         accepts=("ExportedProgram",))
    with pytest.raises(PassFailedError, match="add_output") as raised:
        PassManager([edit]).run(exported)
    # Not the pytree length error of the program's first call, after the run.
    assert "lists 2 user output(s) but its call spec (out_spec" in str(raised.value)
    assert raised.value.rolled_back
    assert_same_behaviour(before, exported, calls)


def test_a_pass_adding_an_output_with_its_call_spec_runs(exported):
    eager = copy.deepcopy(exported).module()
    edit = function_pass(lambda p: _add_output(p, with_out_spec=True), name="add_output",
                         accepts=("ExportedProgram",))
    program = PassManager([edit]).run(exported).program.module()
    for x in (torch.ones(4), torch.full((4,), -3.0), torch.arange(4.0)):
        out, doubled = program(x)
        assert torch.equal(out, eager(x)) and torch.equal(doubled, x * 2)
        assert torch.equal(program.acc, eager.acc)


@pytest.mark.parametrize("returned", [
    lambda program: PassResult(None, True),
    lambda program: TorchPassResult(None, True),
    lambda program: (torch.export.export(Accumulate(), (torch.ones(4),))
                     if isinstance(program, torch.fx.GraphModule) else program.module()),
], ids=["PassResult(None)", "torch PassResult(None)", "the other form"])
@pytest.mark.parametrize("form", ["GraphModule", "ExportedProgram"])
def test_a_pass_rewriting_then_returning_no_program_of_its_form_is_named_and_rolled_back(
        form, returned):
    """A GraphModule pass that rewrote relu into abs and returned PassResult(None): the
    failure's diff rendered None as a program, so an AttributeError ('NoneType' object has no
    attribute '_modules') escaped before the rollback and the rewrite stayed (the program's
    outputs off the original's from the first call). An ExportedProgram's torch PassResult
    holding None was an AttributeError from torch."""
    def rewrite_then_return(program):
        relu_to_abs(program)
        return returned(program)

    def made():
        ep = torch.export.export(Accumulate(), (torch.ones(4),))
        return ep.module() if form == "GraphModule" else ep

    program, original = made(), made()
    broken = function_pass(rewrite_then_return, name="rewrite_then_return")
    for _ in range(3):  # each failure leaves the program exactly as it was
        with pytest.raises(PassFailedError) as info:
            PassManager([broken]).run(program)
        assert info.value.pass_name == "rewrite_then_return" and info.value.rolled_back
        assert "relu" in info.value.diff and "abs" in info.value.diff
        assert targets(program, "relu") and not targets(program, "abs")
    assert str(graph_of(program)) == str(graph_of(original))
    inputs = [(torch.full((4,), float(i)),) for i in range(1, 4)]
    assert_same_behaviour(original, program, inputs)  # outputs and buffers, bit for bit


@pytest.mark.parametrize("claim", [0, False])
def test_a_claim_of_unmodified_written_as_a_count_of_zero_is_checked(traced, claim):
    """``PassResult(program, changed_count)`` with a count of 0 after a change: the claim
    check read only ``False`` as "unmodified" (``0 is not False``), so the lie was neither
    warned about nor, under strict=True, refused."""
    lying = function_pass(lambda program: (relu_to_abs(program), PassResult(program, claim))[1],
                          name="lying")
    result = PassManager([lying]).run(traced)
    assert result.report.records[0].claimed_modified is False
    assert result.report.warnings == ["pass #0 lying reported 'unmodified' but changed the "
                                      "program"]


@pytest.mark.parametrize("returned", [{"modified": "no"}, {"modified": torch.tensor(True)},
                                      {"notes": None}, {"statistics": None}],
                         ids=["a string claim", "a tensor claim", "notes None", "statistics None"])
def test_a_claim_notes_or_statistics_of_the_wrong_type_are_named_at_the_pass(traced, returned):
    """``modified="no"`` was taken as a claim of a change (the report's claim a string);
    ``notes=None`` was "TypeError: 'NoneType' object is not iterable", naming nothing."""
    def remarks(program):
        relu_to_abs(program)
        return PassResult(program, **{"modified": True, **returned})

    before = [n.target for n in graph_of(traced).nodes]
    with pytest.raises(PassFailedError, match=r"modified is a bool or None; notes are a list "
                                              r"of strings, statistics \{description: number\}"):
        PassManager([function_pass(remarks)]).run(traced)
    assert [n.target for n in graph_of(traced).nodes] == before


def _slow_mark_claiming_unmodified(program):
    """Tags a node's meta (a change SemanticValidation runs the program for), sleeps so that
    a second thread's run overlaps this one, and claims "unmodified"."""
    next(iter(graph_of(program).nodes)).meta["seen"] = True
    time.sleep(0.5)
    return PassResult(program, False)


def test_one_manager_run_from_two_threads_keeps_each_run_to_its_program():
    """Two threads ran one manager on two models: SemanticValidation compared the first
    program with the second's reference (a SemanticsError, "max abs diff 8", blamed on a pass
    that changed no value), and ClaimCheck put the first run's warning in the second's
    report (two warnings there, none in the first)."""
    models = [Accumulate(), Accumulate()]
    with torch.no_grad():
        models[1].linear.weight.add_(1.0)
    programs = [torch.export.export(m, (torch.ones(4),)) for m in models]
    x = torch.ones(4)
    manager = PassManager([function_pass(_slow_mark_claiming_unmodified, name="mark")],
                          instruments=[SemanticValidation((x,))])
    results, errors = {}, {}

    def run(i):
        try:
            results[i] = manager.run(programs[i])
        except Exception as e:  # noqa: BLE001 - compared below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == {}
    for i, model in enumerate(models):
        assert results[i].program is programs[i]
        assert results[i].report.warnings == ["pass #0 mark reported 'unmodified' but "
                                              "changed the program"]
        assert_same_behaviour(copy.deepcopy(model), programs[i], (x,), calls=3)


def test_a_pass_running_its_own_manager_again_is_a_typed_error(exported):
    """A pass ran its manager on another program (same thread, so the lock let it in): the
    inner run replaced SemanticValidation's reference, and the outer pass, which changed no
    value, failed "max abs diff 100" against the other program's outputs."""
    class Other(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) + 100

    def runs_a_manager_on_another_program(program):
        if inner:
            inner.pop().run(torch.export.export(Other(), (torch.ones(4),)))
        next(iter(graph_of(program).nodes)).meta["seen"] = True  # a change: validated

    manager = PassManager([function_pass(runs_a_manager_on_another_program, name="nested")],
                          instruments=[SemanticValidation((torch.ones(4),))])
    inner = [manager]
    with pytest.raises(PassFailedError, match=r"PipelineError: PassManager\[nested\] is already "
                                               r"running in this thread") as info:
        manager.run(exported)
    assert info.value.pass_name == "nested" and info.value.rolled_back
    inner = [copy.deepcopy(manager)]  # the way out the error names
    assert manager.run(exported).modified and not inner


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "pickle"])
def test_a_copied_or_unpickled_manager_runs_on_its_own(exported, duplicate):
    """A process pool pickles the manager: it runs as the original does, with its own lock."""
    manager = PassManager([ReluToAbs()], instruments=[SemanticValidation((torch.ones(4),))])
    copied = duplicate(manager)
    assert copied.pipeline_text() == manager.pipeline_text()
    with pytest.raises(SemanticsError) as info:  # abs is not relu: its validation still runs
        copied.run(exported)
    assert info.value.pass_name == "ReluToAbs" and info.value.rolled_back
    assert targets(exported, "relu") and not targets(exported, "abs")
    assert_same_behaviour(Accumulate(), exported, (torch.ones(4),), calls=3)


def _use_before_definition(program):
    nodes = [n for n in graph_of(program).nodes if n.op == "call_function"]
    nodes[0].args = (nodes[-1], *nodes[0].args[1:])


def _argument_of_another_graph(program):
    stranger = torch.fx.Graph().placeholder("stranger")
    relu = targets(program, "relu")[0]
    relu.args = (stranger,)


def _missing_attribute(program):
    graph = graph_of(program)
    with graph.inserting_before(targets(program, "relu")[0]):
        missing = graph.get_attr("missing")
    targets(program, "relu")[0].args = (missing,)


@pytest.mark.parametrize("form", ["GraphModule", "ExportedProgram"])
@pytest.mark.parametrize(("edit", "reason"), [
    (_use_before_definition, "was used before it has been defined"),
    (_argument_of_another_graph, "does not belong to this Graph"),
    (_missing_attribute, "references nonexistent attribute missing"),
], ids=["used before defined", "of another graph", "missing attribute"])
def test_a_pass_leaving_an_ill_formed_graph_is_named_and_rolled_back(form, edit, reason):
    """A node used before it is defined, an argument from another graph, a get_attr of no
    attribute: the run succeeded and the program's first call failed (UnboundLocalError,
    KeyError or AttributeError from generated code), naming no pass."""
    def made():
        ep = torch.export.export(Accumulate(), (torch.ones(4),))
        return ep.module() if form == "GraphModule" else ep

    program, original = made(), made()
    for _ in range(2):
        with pytest.raises(PassFailedError, match=f"left an ill-formed graph: .*{reason}") as info:
            PassManager([function_pass(edit, name="breaks")]).run(program)
        assert info.value.pass_name == "breaks" and info.value.rolled_back
    assert str(graph_of(program)) == str(graph_of(original))
    inputs = [(torch.full((4,), float(i)),) for i in range(1, 4)]
    assert_same_behaviour(original, program, inputs)


@pytest.mark.parametrize("form", ["GraphModule", "ExportedProgram"])
def test_a_pass_interrupted_mid_rewrite_is_rolled_back_and_the_interrupt_kept(form):
    """Ctrl-C (KeyboardInterrupt, not an Exception) in the middle of a pass left its half
    rewrite in the graph (relu already abs) with the code not recompiled: graph and code
    disagreed."""
    def interrupted(program):
        ReluToAbs().call(program)
        raise KeyboardInterrupt

    ep = torch.export.export(Accumulate(), (torch.ones(4),))
    program = ep.module() if form == "GraphModule" else ep
    with pytest.raises(KeyboardInterrupt):
        PassManager([function_pass(interrupted)]).run(program)
    assert targets(program, "relu") and not targets(program, "abs")
    inputs = [(torch.full((4,), float(i)),) for i in range(-1, 2)]
    assert_same_behaviour(Accumulate(), program, inputs)


@pytest.mark.parametrize("attribute", ["acc", "linear"])
def test_a_pass_deleting_an_attribute_the_graph_reads_is_named_and_rolled_back(attribute):
    """``del gm.acc`` (a buffer a get_attr reads) or ``del gm.linear`` (the submodule holding
    the weights) left the nodes alone, so the graph was not checked: the run succeeded and
    the program's first call raised AttributeError, naming no pass."""
    program = torch.export.export(Accumulate(), (torch.ones(4),)).module()
    with pytest.raises(PassFailedError, match=f"left an ill-formed graph: .*{attribute}") as info:
        PassManager([function_pass(lambda gm: delattr(gm, attribute), name="drops")]).run(
            program)
    assert info.value.pass_name == "drops" and info.value.rolled_back
    inputs = [(torch.full((4,), float(i)),) for i in range(1, 4)]
    assert_same_behaviour(Accumulate(), program, inputs)


def _output_added_alone(program):
    output = graph_of(program).output_node()
    output.args = ((*output.args[0], output.args[0][0]),)


def _input_added_alone(program):
    graph = graph_of(program)
    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
        graph.placeholder("extra")


@pytest.mark.parametrize(("edit", "what"), [(_output_added_alone, "2 output values"),
                                            (_input_added_alone, "2 placeholders")],
                         ids=["an output", "an input"])
def test_a_pass_adding_to_a_graph_module_what_its_code_specs_do_not_list_fails(edit, what):
    """``ep.module()``'s code flattens a call into its placeholders and builds the result by
    pytree specs: an output or input added to the graph alone passed, and the first call
    failed ("treespec.unflatten(leaves): `leaves` has length 2", "not enough values to
    unpack")."""
    original = torch.export.export(Accumulate(), (torch.ones(4),)).module()
    program = copy.deepcopy(original)
    with pytest.raises(PassFailedError, match=f"left an ill-formed graph: it has {what}") as e:
        PassManager([function_pass(edit, name="adds")]).run(program)
    assert e.value.pass_name == "adds" and e.value.rolled_back
    inputs = [(torch.full((4,), float(i)),) for i in range(1, 4)]
    assert_same_behaviour(original, program, inputs)


class _TagsB(Pass):
    """Declares it sets node meta "a"; sets "b"."""

    effects = Effects.only_meta("a")

    def call(self, program):
        for node in graph_of(program).nodes:
            node.meta["b"] = True


def test_a_group_in_a_strict_pipeline_names_its_pass_that_broke_its_effects(exported):
    """Under the outer strict=True, a pass in a group setting a meta key it does not declare
    passed: the outer run checked the group's effects, the union of its passes', which
    allow every key (ReluToAbs declares no keys); with only such passes, it was an
    EffectsError naming the group, not the pass."""
    group = PassManager([ReluToAbs(), _TagsB()], name="group")
    with pytest.raises(EffectsError) as info:
        PassManager([group], strict=True).run(exported)
    assert (info.value.pass_name, info.value.index, info.value.kind) == ("_TagsB", 1,
                                                                         "meta_keys")
    assert info.value.rolled_back and not any("b" in n.meta for n in graph_of(exported).nodes)


def test_a_pass_failing_in_a_pipeline_another_pass_runs_names_both(exported):
    """A pass running its own PassManager whose pass raised: the error named the inner pass
    alone ("pass #0 Boom", while #0 of the outer pipeline is another pass); now its
    ``within`` and message name the outer pass too, the inner cause kept."""

    def boom(program):
        raise ValueError("inner boom")

    def runs_a_pipeline(program):
        return PassManager([function_pass(boom, name="boom")]).run(program).program

    group = PassManager([ReluToAbs(), function_pass(runs_a_pipeline, name="outer")],
                        name="group")
    with pytest.raises(PassFailedError, match=r"pass #0 boom failed: ValueError: inner boom\n"
                       r"It failed inside pass #1 outer, inside pass #0 group") as info:
        PassManager([group]).run(exported)
    error = info.value
    assert (error.pass_name, error.index, error.within) == ("boom", 0, [("outer", 1),
                                                                         ("group", 0)])
    assert isinstance(error.__cause__, ValueError) and error.rolled_back
    assert [r.name for r in error.report.records] == ["group"]
    assert pickle.loads(pickle.dumps(error)).within == error.within


def _retarget_relu(program):
    for node in targets(program, "relu"):
        node.target = torch.ops.aten.abs.default
    return []


def _add_node(program):
    graph = graph_of(program)
    with graph.inserting_before(graph.output_node()):
        graph.call_function(torch.ops.aten.zeros.default, ([1],))
    return []


def _rewire_relu(program):
    for node in targets(program, "relu"):
        node.args = (node.args[0].args[0], *node.args[1:])  # its input's input
    return []


def _retarget_then_raise(program):
    _retarget_relu(program)
    raise KeyError("half-way")


def _retarget_then_interrupt(program):
    _retarget_relu(program)
    raise KeyboardInterrupt


@pytest.mark.parametrize("role", ["requires", "provides"])
def test_an_interrupt_in_a_condition_check_comes_through_with_the_program_as_it_was(
        exported, role):
    """Ctrl-C in a required condition's check (before the pass's rollback record applied)
    left the check's half-done edit in the program."""
    interrupted = Condition("Interrupted", _retarget_then_interrupt)

    class Checked(Pass):
        def call(self, program):
            return PassResult(program, False)

    setattr(Checked, role, frozenset({interrupted}))
    before = str(graph_of(exported))
    with pytest.raises(KeyboardInterrupt):
        PassManager([Checked()]).run(exported)
    assert str(graph_of(exported)) == before


@pytest.mark.parametrize(("check", "strict"), [
    (_add_node, False), (_retarget_relu, True), (_retarget_relu, False), (_rewire_relu, False),
    (_retarget_then_raise, False)],
    ids=["adds a node", "retargets a node (strict)", "retargets a node", "rewires a node",
         "retargets, then raises"])
@pytest.mark.parametrize("role", ["requires", "provides"])
def test_a_condition_check_that_changes_the_program_is_a_typed_error_and_undone(
        exported, check, strict, role):
    """Before, the change stayed: counted as the pass's own (required), or kept with the
    program's code stale (provided: no recompile after the checks). Outside strict, only
    nodes added, removed or reordered were seen: a check retargeting or rewiring a node
    (or doing so, then raising) left it so, the pass reported as unchanged."""
    changes = Condition("ChangesTheProgram", check)

    class Checked(Pass):
        def call(self, program):
            return PassResult(program, False)

    setattr(Checked, role, frozenset({changes}))
    before = str(graph_of(exported))
    with pytest.raises(PassFailedError, match="the check of condition 'ChangesTheProgram' "
                       r"(changed the program's nodes|raised KeyError: 'half-way' \(its "
                       "change was undone)") as info:
        PassManager([Checked()], strict=strict).run(exported)
    assert info.value.rolled_back and str(graph_of(exported)) == before
