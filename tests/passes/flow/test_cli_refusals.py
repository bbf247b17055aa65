"""What the main job leaves behind when it refuses a model or stops before its flow: the
``--json`` report says so (``ok`` false, the stage and why) instead of a previous run's
report staying in the file, and the commands it prints can be pasted into a shell."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from passes.flow import cli
from passes.flow.examples import prefill_decode_job
from passes.flow.result import Failure, FlowResult

from .main_job_cli import ROOT

MODEL = "tests.models.main_job:one_layer_decoder"
FAST = ("--steps", "2", "--skip-quantization", "--skip-delegation", "--runtime", "python",
        "--quiet")


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize(("model", "stage", "said"), [
    ("tests.models.main_job:one_layer_decodr", "loading", "has no attribute"),
    ("tests.models.main_job:not_exportable", "exporting", "is not exportable"),
    ("tests.models.main_job:wrong_return", "loading", "must return"),
])
def test_a_refused_model_overwrites_the_previous_runs_json(tmp_path, capsys, model, stage,
                                                           said):
    """A CI job reading report.json after a run that refused its model read the previous
    run's report, "ok": true: the file was left as it was."""
    report, dag = tmp_path / "report.json", tmp_path / "plan.dot"
    outputs = ("--json", str(report), "--dot", str(dag))
    assert cli.main(["run", MODEL, *FAST, *outputs]) == 0
    assert _report(report)["ok"] is True and "MarkMutableBuffers" in dag.read_text()

    assert cli.main(["run", model, *FAST, *outputs]) == cli.LOAD_FAILED
    err = capsys.readouterr().err
    data = _report(report)
    assert data["ok"] is False and data["checks"] == []
    assert data["failure"]["stage"] == stage
    assert said in data["failure"]["reason"] and said in err
    # Not the previous run's DAG either: an empty one saying why.
    assert "MarkMutableBuffers" not in dag.read_text() and said in dag.read_text()


def test_a_folder_given_as_the_model_file_is_named_a_folder(tmp_path):
    """It read "no such file '/the/folder'", which is there."""
    with pytest.raises(cli.ModelError, match="is a folder: MODEL names a file in it"):
        cli.load_model(f"{tmp_path}:factory", 2)


def methods_past_the_cache() -> dict:
    """Prefill 4 and 12 decodes fill the 16 positions of the caches; one more decode writes
    position 16."""
    made = prefill_decode_job(n_layers=1, decode_steps=12)
    x, _ = made["steps"][-1][1]
    made["steps"].append(("decode", (x, torch.tensor([16]))))
    return made


@pytest.mark.parametrize("model", [
    "tests.models.static_cache:past_the_cache",
    # Several methods: the stage read "exporting" (their checks ran under it).
    "tests.passes.flow.test_cli_refusals:methods_past_the_cache",
])
def test_steps_past_the_cache_end_are_a_refusal_in_the_json(tmp_path, capsys, model):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"ok": True}))
    status = cli.main(["run", model, "--steps", "20", *FAST[2:], "--json", str(report)])
    assert status == cli.LOAD_FAILED, capsys.readouterr()
    failure = _report(report)["failure"]
    assert failure["stage"] == "checking the steps"
    assert failure["reason"].startswith("StatePastEndError: ")


def test_ctrl_c_while_loading_is_said_in_the_json(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"ok": True}))
    monkeypatch.setattr(cli, "load_model", interrupted)
    assert cli.main(["run", MODEL, *FAST, "--json", str(report)]) == cli.INTERRUPTED
    data = _report(report)
    assert data["ok"] is False and data["interrupted"] == f"loading {MODEL}"


def test_executorch_missing_is_said_in_the_json(tmp_path, monkeypatch, capsys):
    import passes.executorch

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"ok": True}))
    monkeypatch.setattr(passes.executorch, "available", lambda: False)
    status = cli.main(["run", MODEL, "--runtime", "executorch", "--json", str(report)])
    assert status == cli.FLOW_FAILED
    failure = _report(report)["failure"]
    assert failure["stage"] == "runtime" and "needs the executorch extra" in failure["reason"]
    # The way on without it, beside the install commands (which need the checkout).
    assert failure["reason"].endswith("or decode in Python only: --runtime python (or auto, "
                                      "the default, which uses ExecuTorch when it is installed)")


def test_ctrl_c_while_looking_for_executorch_is_one_line_and_said_in_the_json(
        tmp_path, monkeypatch, capsys):
    """Importing ExecuTorch to see whether it is installed takes seconds: Ctrl-C then was a
    traceback, status 1, and the previous run's report left in --json."""
    import passes.executorch

    def interrupted():
        raise KeyboardInterrupt

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"ok": True}))
    monkeypatch.setattr(passes.executorch, "available", interrupted)
    try:
        status = cli.main(["run", MODEL, "--quiet", "--json", str(report)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while looking for ExecuTorch escaped the job (a traceback)")
    assert status == cli.INTERRUPTED
    assert capsys.readouterr().err == "interrupted (Ctrl-C) while looking for ExecuTorch\n"
    data = _report(report)
    assert data["ok"] is False and data["interrupted"] == "looking for ExecuTorch"


@pytest.mark.parametrize(("options", "refused", "said"), [
    (("--quantize-state", "--skip-quantization"), None, "cannot go with --skip-quantization"),
    (("--dot", "{tmp}/no/folder.dot"), "--dot", "no folder"),
    (("--json", "{tmp}/no/folder.json"), "--json", "no folder"),
    (("--dot", "{tmp}/report.json"), "--dot", "--json and --dot both name"),
])
def test_refused_options_leave_no_previous_runs_report_or_dag(tmp_path, capsys, options,
                                                              refused, said):
    """A status-2 refusal of the options themselves left a previous run's "ok": true report
    (and its DAG) in the files, read as this run's; --json and --dot naming one file wrote
    the report over the DAG, each said written."""
    report, dag = tmp_path / "report.json", tmp_path / "plan.dot"
    previous = {report: json.dumps({"ok": True}), dag: "digraph passes { a -> b }"}
    for path, text in previous.items():
        path.write_text(text)
    argv = [option.format(tmp=tmp_path) for option in options]
    given = {"--json": str(report), "--dot": str(dag)}
    for option, path in given.items():
        if option not in argv:
            argv += [option, path]
    assert cli.main(["run", MODEL, *FAST, *argv]) == cli.LOAD_FAILED
    assert said in capsys.readouterr().err
    if refused != "--json":
        data = _report(report)
        assert data["ok"] is False and data["failure"]["stage"] == "options"
        assert said in data["failure"]["reason"]
    if refused != "--dot":
        assert dag.read_text().startswith("digraph") and said in dag.read_text()


def test_the_printed_replay_command_runs_as_pasted_from_a_folder_with_a_space(tmp_path):
    """`--reproducer-dir "my repros"` printed `replay my repros/1-... --trust`: pasted into a
    shell, that is two arguments and the replay stops with a usage error."""
    done = subprocess.run(
        [sys.executable, "-m", "passes", "run", "tests.models.failing:writes_constant",
         *FAST, "--reproducer-dir", str(tmp_path / "my repros")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == cli.FLOW_FAILED, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("reproducer: "))
    command = line.split("(rerun it: ", 1)[1].removesuffix(")")
    assert shlex.split(command)[:4] == ["python", "-m", "pass_manager", "replay"]
    replayed = subprocess.run(command.replace("python", shlex.quote(sys.executable), 1),
                              shell=True, cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr  # the pass fails again
    assert "reproduced: the recorded error" in replayed.stdout


_FACTORIES = '''
import torch


def make_decoder():
    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)


def four_things():
    return torch.nn.Linear(4, 4), (torch.randn(2, 4),), [], 5


def inputs_bare():
    return torch.nn.Linear(4, 4), torch.randn(2, 4)
'''


@pytest.mark.parametrize(("factory", "said"), [
    ("make_decodr", "has no attribute 'make_decodr' (did you mean 'make_decoder'?)"),
    ("four_things", "got a tuple of 4: (Linear, tuple, list, int)"),
    ("inputs_bare", "a tuple of example inputs, got a tuple of 2: (Linear, Tensor)"),
])
def test_a_wrong_factory_is_named_with_what_it_gave(tmp_path, capsys, factory, said):
    """'has no attribute' without the close name, and 'got tuple' without saying which
    tuple: the user could not see what to change."""
    (tmp_path / "factories.py").write_text(_FACTORIES)
    model = f"{tmp_path / 'factories.py'}:{factory}"
    assert cli.main(["run", model, *FAST]) == cli.LOAD_FAILED
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and line.endswith(said), line


_DOCS = (ROOT / "docs" / "main-job.md").read_text()


def _options(capsys, *argv: str) -> set[str]:
    """The options --help lists (its option column, not the prose)."""
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--help"], prog="python -m passes")
    assert exited.value.code == 0
    columns = [re.split(r"\s{2,}", line.strip())[0]
               for line in capsys.readouterr().out.splitlines() if re.match(r"  -", line)]
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", "\n".join(columns)))


def test_every_option_in_help_is_in_the_docs_and_back(capsys):
    """--print-after-change and --print-after-failure were in --help, not in the main job's
    page; an option the page names that --help does not have would be a usage error."""
    run_help = _options(capsys, "run")
    top_help = _options(capsys)
    documented = set(re.findall(r"`(--?[a-z][a-z-]*)", _DOCS))
    replay_only = {"--trust", "--pdb"}  # python -m pass_manager replay's, named in passing
    assert run_help - {"-h", "--help"} <= documented
    assert documented - replay_only <= run_help | top_help


def test_the_json_keys_are_documented(tmp_path, capsys):
    report = tmp_path / "report.json"
    assert cli.main(["run", MODEL, *FAST, "--json", str(report)]) == 0
    section = _DOCS.split("**The `--json` report**")[1].split("\n\n")[0]
    documented = set(re.findall(r"`(\w+)`", section))
    data = _report(report)
    assert set(data) <= documented, set(data) - documented
    failure = dict.fromkeys(FlowResult().to_dict()) | {"failure": Failure("s", "r").__dict__}
    assert set(failure["failure"]) <= set(re.findall(r"\b(\w+)\b", section))


def test_a_float64_model_is_refused_before_export_with_the_node_it_would_quantize(tmp_path,
                                                                                    capsys):
    """It exported, ran the fp32 and functional stages, then failed at "quantize with the
    passes" (status 3, no node field); a float64 cache failed there as an AssertionError."""
    report = tmp_path / "report.json"
    model = "tests.models.main_job:float64_running_sum"
    assert cli.main(["run", model, "--steps", "2", "--runtime", "python", "--quiet",
                     "--json", str(report)]) == cli.LOAD_FAILED
    err = capsys.readouterr().err
    assert "float64" in err and "--skip-quantization" in err and "'linear_weight'" in err
    failure = _report(report)["failure"]
    assert (failure["stage"], failure["node"]) == ("checking the model", "linear_weight")
    assert cli.main(["run", model, *FAST]) == 0  # fp32 flow: float64 is no problem there


def test_replay_asked_of_this_command_says_where_replay_lives(capsys):
    """It read "invalid choice: 'replay' (choose from 'run')"."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["replay", "some/folder"], prog="python -m passes")
    assert exited.value.code == 2
    assert "python -m pass_manager replay FOLDER" in capsys.readouterr().err


class _Accumulator(torch.nn.Module):
    """A float32 layer and a running sum: the smallest model with state."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(1, 4))

    def forward(self, x):
        self.total.add_(x)
        return self.linear(x)


class _Raises(_Accumulator):
    def forward(self, x):
        raise RuntimeError("no cache allocated yet")


class _HoldsALock(_Accumulator):
    def __init__(self):
        super().__init__()
        import threading

        self.lock = threading.Lock()


@pytest.mark.parametrize(("made", "said"), [
    # Exported fine, then failed "fp32 eager decode (call 1 of 2)", status 3, torch's
    # "mat1 and mat2 must have the same dtype" alone.
    (lambda: (_Accumulator(), (torch.ones(1, 4, dtype=torch.float64),)),
     "_Accumulator.forward raises on its example in eager, before export: RuntimeError: mat1 "
     "and mat2 must have the same dtype, but got Double and Float (input 'x' is float64; the "
     "model's parameters are float32: give the example in that dtype)"),
    # "is not exportable: strict: Unsupported: Observed exception; non-strict: RuntimeError".
    (lambda: (_Raises(), (torch.ones(1, 4),)),
     "_Raises.forward raises on its example in eager, before export: RuntimeError: no cache "
     "allocated yet"),
    # A TypeError out of copy.deepcopy: a traceback and status 1, read as "a check failed".
    (lambda: (_HoldsALock(), (torch.ones(1, 4),)),
     "cannot copy _HoldsALock with copy.deepcopy (TypeError: cannot pickle '_thread.lock' "
     "object): the job runs every program on its own copy of the model"),
], ids=["float64_example", "forward_raises", "holds_a_lock"])
def test_a_model_failing_on_its_own_example_is_refused_before_its_flow(tmp_path, monkeypatch,
                                                                        capsys, made, said):
    import types

    def flow_must_not_run(*args, **kwargs):
        raise AssertionError("a model failing on its example reached the flow")

    from passes.flow import run as flow

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    module = types.ModuleType("own_example_fails")
    module.factory = made
    monkeypatch.setitem(sys.modules, "own_example_fails", module)
    report = tmp_path / "report.json"
    status = cli.main(["run", "own_example_fails:factory", *FAST, "--json", str(report)])
    err = capsys.readouterr().err
    assert status == cli.LOAD_FAILED, err
    assert err.startswith(f"error: own_example_fails:factory: {said}") and "Traceback" not in err
    failure = _report(report)["failure"]
    assert failure["stage"] == "exporting" and said in failure["reason"]


@pytest.mark.parametrize(("model", "said"), [
    # "No module named 'config'": the file was read as the module config.json.
    ("config.json:factory", "MODEL 'config.json:factory' names a .json file, not Python"),
    ("config.json", "MODEL 'config.json' names a .json file, not Python"),
    ("model.pte", "MODEL 'model.pte' names a .pte file, not Python"),
    # "MODEL must be package.module:factory ... or path/to/file.py:factory, got 'mine.py'".
    ("mine.py", "MODEL 'mine.py' names the file but not its factory: mine.py:NAME"),
])
def test_a_model_file_that_holds_no_factory_is_named_for_what_it_is(tmp_path, monkeypatch,
                                                                    model, said):
    monkeypatch.chdir(tmp_path)
    for name in ("config.json", "model.pte", "mine.py"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(cli.ModelError) as refused:
        cli.load_model(model, 2)
    assert str(refused.value).startswith(said)
    assert ("AutoConfig" in str(refused.value)) == model.startswith("config.json")


def test_a_path_that_is_not_utf8_is_escaped_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A model file in a folder whose name is not UTF-8 (its bytes reach Python as
    surrogates): on a stream or file encoding UTF-8 strictly, printing the model line or
    writing --dot raised UnicodeEncodeError out of the job."""
    folder = tmp_path / os.fsdecode(b"mod\xe8les")
    folder.mkdir()
    (folder / "mine.py").write_text(
        "import torch\n\nclass Raises(torch.nn.Module):\n    def forward(self, x):\n"
        "        raise RuntimeError('no cache allocated yet')\n\n"
        "def factory():\n    return Raises(), (torch.ones(2),)\n")
    dag = tmp_path / "plan.dot"
    monkeypatch.syspath_prepend(str(folder))  # sys.path as it was after, where the job adds it
    assert sys.stdout.errors == sys.stderr.errors == "strict"  # as a UTF-8 locale's stdout
    status = cli.main(["run", f"{folder}/mine.py:factory", *FAST, "--dot", str(dag)])
    assert status == cli.LOAD_FAILED
    assert "mod\\udce8les/mine.py:factory: Raises.forward raises" in dag.read_text()

    monkeypatch.setattr(cli, "_finish", lambda *args: 0)  # the model line alone
    model = folder / os.fsdecode(b"caf\xe9.py")
    model.write_text("from tests.models.main_job import one_layer_decoder as factory\n")
    assert cli.main(["run", f"{model}:factory", *FAST]) == 0
    shown = str(model).encode("utf-8", "backslashreplace").decode()
    assert capsys.readouterr().out.startswith(f"model: {shown}:factory (")


def test_a_rerun_into_the_same_print_to_folder_leaves_no_previous_dump(tmp_path, capsys):
    """PrintIR numbers each run's dumps from 001: a previous run's 003-... stayed beside
    this run's 001 and 002, read as this run's."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    stale = folder / "003-1-InplaceToFunctional-after.txt"
    stale.write_text("// -----// IR Dump After InplaceToFunctional (#1) //----- //\ngraph\n")
    mine = [folder / "notes.txt", folder / "001-0-Mine-after.txt"]  # the user's own files
    for path in mine:
        path.write_text("my notes\n")
    status = cli.main(["run", "tests.models.main_job:one_layer_decodr", "--runtime", "python",
                       "--print-to", str(folder), "--print-after", "MarkMutableBuffers"])
    assert status == cli.LOAD_FAILED  # refused, and still no dump of another run left
    assert not stale.exists() and all(path.exists() for path in mine)
    assert f"--print-to {folder}: removed 1 dump(s) a previous run left there" in \
        capsys.readouterr().err


def test_a_pipeline_in_a_file_is_read_from_it(tmp_path, monkeypatch, capsys):
    """It read "--pipeline: 'pipeline.txt' is not a pass name with optional {options}"."""
    from passes.flow import run as flow

    given = {}

    def flow_recording_its_pipeline(*args, **kwargs):
        given["pipeline"] = kwargs["pipeline"]
        return FlowResult(plan="0. SomePass")

    monkeypatch.setattr(flow, "run_flow", flow_recording_its_pipeline)
    text = tmp_path / "pipeline.txt"
    text.write_text("MarkMutableBuffers,\nInplaceToFunctional\n")
    assert cli.main(["run", MODEL, *FAST, "--pipeline", str(text)]) == 0
    assert given["pipeline"].name == "PassManager[MarkMutableBuffers, InplaceToFunctional]"
    text.write_text("MarkMutableBuffers,InplaceToFuncional")
    assert cli.main(["run", MODEL, *FAST, "--pipeline", str(text)]) == cli.LOAD_FAILED
    assert f"--pipeline {text} (read as a file): no registered pass is named " \
        "'InplaceToFuncional' (did you mean 'InplaceToFunctional'?)" in capsys.readouterr().err


def test_an_unforeseen_error_while_loading_is_one_line_naming_the_stage(tmp_path, monkeypatch,
                                                                       capsys):
    """Whatever escaped the loading stages was a traceback and status 1, "a check failed"."""
    def analysis_bug(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(cli, "check_steps_within_state", analysis_bug)
    report = tmp_path / "report.json"
    assert cli.main(["run", MODEL, *FAST, "--json", str(report)]) == cli.LOAD_FAILED
    err = capsys.readouterr().err
    assert err == (f"error: checking the steps {MODEL} failed: IndexError: list index out of "
                   "range (--traceback shows the full trace)\n")
    assert _report(report)["failure"]["stage"] == "checking the steps"


def test_ctrl_c_while_the_job_imports_its_modules_is_one_line(monkeypatch, capsys):
    """``python -m passes``: a KeyboardInterrupt traceback out of ``from .flow.cli import
    main``."""
    import runpy

    class Interrupting:
        def find_spec(self, name, path=None, target=None):
            if name == "passes.flow.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "passes.flow.cli")
    monkeypatch.delitem(sys.modules, "passes.__main__", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    try:
        with pytest.raises(SystemExit) as exited:
            runpy.run_module("passes", run_name="__main__")
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while importing escaped python -m passes (a traceback)")
    assert exited.value.code == cli.INTERRUPTED
    assert capsys.readouterr().err == "interrupted (Ctrl-C) while starting\n"


# What Python does for ``python -m passes``, with Ctrl-C pressed as the package imports torch.
_CTRL_C_WHILE_TORCH_LOADS = """
import builtins, os, signal, sys
sys.argv[:1] = ["-m"]  # as Python sets it while it locates the module
real_import = builtins.__import__
def importing(name, *args, **kwargs):
    if name == "torch":
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = importing
import passes
"""


def test_ctrl_c_while_the_package_loads_torch_is_one_line():
    """``python -m passes`` imports the package, and torch with it (seconds), before its
    ``__main__``: on cc54dca Ctrl-C then was a KeyboardInterrupt traceback, status 1."""
    done = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_TORCH_LOADS], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == cli.INTERRUPTED, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C) while starting"


class _ClosedAfter:
    """A stdout whose reader left (``| head -1``): writing ``closing_at`` raises
    BrokenPipeError; a real file stands behind its descriptor (the job points it at
    /dev/null)."""

    errors = "backslashreplace"

    def __init__(self, behind, closing_at: str):
        self.behind, self.closing_at = behind, closing_at

    def write(self, text):
        if self.closing_at in text:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self):
        pass

    def fileno(self):
        return self.behind.fileno()


@pytest.mark.parametrize(("closing_at", "written"), [
    # In the report, after the flow: its result (it passed).
    ("\n== ", lambda data: data["plan"] == "0. SomePass" and data["ok"] is True),
    # Before it: the job stopped, and the report says so.
    ("model: ", lambda data: data["failure"]["stage"] == "output" and data["ok"] is False),
])
def test_a_closed_stdout_leaves_no_previous_runs_json(tmp_path, monkeypatch, closing_at,
                                                      written):
    """``--json report.json | head -1``: the job stopped at its first write after head left
    (status 141) and never wrote --json: a CI step read the previous run's report."""
    from passes.flow import run as flow

    monkeypatch.setattr(flow, "run_flow", lambda *args, **kwargs: FlowResult(plan="0. SomePass"))
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"ok": True, "plan": "the previous run's"}))
    with open(tmp_path / "stdout", "w") as behind:
        monkeypatch.setattr(sys, "stdout", _ClosedAfter(behind, closing_at))
        status = cli.main(["run", MODEL, *FAST, "--json", str(report)])
    assert status == cli.OUTPUT_CLOSED
    assert written(_report(report))


class _OptionalMask(_Accumulator):
    def forward(self, x, mask=None):
        self.total.add_(x)
        return self.linear(x) if mask is None else self.linear(x) * mask


def test_a_step_giving_a_tensor_where_the_example_gave_none_is_a_load_error(monkeypatch,
                                                                            capsys):
    """The program keeps the example's None and ignored the step's mask: "FAIL exported
    program matches fp32 eager: max abs diff 0.68", status 1, read as the export's fault."""
    import types

    from passes.flow import run as flow

    def flow_must_not_run(*args, **kwargs):
        raise AssertionError("a step the program ignores part of reached the flow")

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    x = torch.ones(1, 4)
    module = types.ModuleType("mask_not_exported")
    module.factory = lambda: (_OptionalMask(), (x, None), [(x, None), (x, 2 * x)])
    monkeypatch.setitem(sys.modules, "mask_not_exported", module)
    assert cli.main(["run", "mask_not_exported:factory", *FAST]) == cli.LOAD_FAILED
    assert capsys.readouterr().err == (
        "error: mask_not_exported:factory(): steps[1] does not fit the exported program's "
        "inputs (x, mask): input 'mask' is a tensor, the program was exported with None there, "
        "a constant it keeps and ignores a tensor for (give the export example a tensor there) "
        "(a program takes the inputs its export example gave)\n")
