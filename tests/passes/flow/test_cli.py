"""The command line follows the conventions: help on every flag, the exit statuses and the
default model in --help, --version, the report alone on stdout with progress on stderr,
--quiet, and a usage error (status 2) for a number of decode calls that is not positive."""

import errno
import importlib.metadata
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import passes
from passes.flow import cli
from passes.flow import run as flow
from passes.flow.examples import decoder_job

from .main_job_cli import ROOT, run_main

MODEL = "tests.models.main_job:one_layer_decoder"
FAST = ("--steps", "2", "--skip-quantization", "--skip-delegation")


def _actions(parser):
    """Every argument of the parser and of its subcommands, with the parser it belongs to."""
    for action in parser._actions:
        if action.choices and hasattr(action, "_name_parser_map"):
            for choice in action._choices_actions:
                yield parser.prog, choice
            for sub in action.choices.values():
                yield from _actions(sub)
        else:
            yield parser.prog, action


def _help(capsys, *argv):
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--help"], prog="python -m passes")
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_flag_and_command_has_help():
    undocumented = [
        (prog, action.option_strings or action.dest)
        for prog, action in _actions(cli.build_parser("python -m passes"))
        if not action.help or action.help == "==SUPPRESS=="
    ]
    assert undocumented == []


@pytest.mark.parametrize("command", [(), ("run",)])
def test_help_gives_the_exit_statuses_in_plain_text(capsys, command):
    text = _help(capsys, *command)
    assert text.startswith("usage: python -m passes")
    statuses = text.split("exit status:")[1].splitlines()[1:5]
    assert [line.split()[0] for line in statuses] == ["0", "1", "2", "3"]
    assert "bad usage" in statuses[2] and "could not be loaded" in statuses[2]
    for markup in ("``", ":mod:", ":func:", ":class:"):  # reST from docstrings
        assert markup not in text


def test_run_help_names_the_default_model(capsys):
    text = " ".join(_help(capsys, "run").split())  # argparse wraps the help lines
    assert "MODEL package.module:factory" in text
    assert f"default: {cli.DEFAULT_MODEL}, a seeded 2-layer" in text


def test_version_names_the_package_and_its_libraries(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    line = capsys.readouterr().out.strip()
    torch_version = importlib.metadata.version("torch")
    torchao_version = importlib.metadata.version("torchao")
    assert line.startswith(f"mutable-buffer-passes {passes.__version__} (torch {torch_version}, "
                           f"torchao {torchao_version}, executorch ")


@pytest.mark.parametrize(
    ("steps", "reason"),
    [("0", "must be at least 1"), ("-3", "must be at least 1"), ("two", "expected a whole number"),
     # 10**9 built a billion calls and checked each against forward, silently, for hours.
     ("100001", "must be at most 100,000 (every program decodes that many calls")],
)
def test_steps_that_are_not_positive_are_a_usage_error(monkeypatch, capsys, steps, reason):
    def flow_must_not_run(*args, **kwargs):
        raise AssertionError(f"--steps {steps} reached the flow")

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "--runtime", "python", MODEL, "--steps", steps], prog="python -m passes")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m passes run")
    assert f"error: argument --steps: {reason}" in err


def test_the_report_alone_goes_to_stdout_and_progress_to_stderr(tmp_path):
    report = tmp_path / "report.json"
    done = run_main(MODEL, *FAST, "--json", str(report), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert out[0].startswith(f"model: {MODEL}") and "2 decode steps" in out[0]
    assert [line for line in out if line.lstrip().startswith("[") or "wrote" in line] == []
    assert "== checks" in done.stdout and "FAIL" not in done.stdout
    # One progress bar per stage: a line each, redrawn in place (\r) as its calls go by.
    err = [line.split("\r")[-1] for line in done.stderr.splitlines()]
    assert "decode the functional program [00:00], call 2/2" in done.stderr
    assert any(line.startswith("functionalize [") for line in err)
    assert err[-1] == f"wrote the report to {report}"


def test_quiet_keeps_the_report_and_drops_progress(capsys, tmp_path):
    report = tmp_path / "report.json"
    status = cli.main(["run", "--runtime", "python",
                       MODEL, *FAST, "--quiet", "--json", str(report)])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert captured.err == ""
    assert captured.out.startswith(f"model: {MODEL}")
    assert "== checks" in captured.out and "PASS  functional program" in captured.out
    assert report.exists()


# What a newcomer gets wrong on the command line: each is a named failure, so a short
# message and a documented exit status, never a traceback.

SLOW_FACTORY = """
import pathlib, time
import torch

def factory():
    pathlib.Path("loading").write_text("")  # tells the test the factory is running
    time.sleep(120)
    return torch.nn.ReLU(), (torch.ones(2),)
"""


def test_ctrl_c_while_loading_is_one_line_and_status_130(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_FACTORY)
    started = subprocess.Popen(
        [sys.executable, "-m", "passes", "run", "slow:factory", "--runtime", "python"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), "."])},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "loading").exists() and started.poll() is None:
        assert time.monotonic() < deadline, "the factory never ran"
        time.sleep(0.1)
    started.send_signal(signal.SIGINT)
    out, err = started.communicate(timeout=60)
    assert started.returncode == cli.INTERRUPTED == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip() == "interrupted (Ctrl-C) while loading slow:factory"


def test_ctrl_c_in_a_stage_prints_and_writes_the_report_so_far_and_the_stage(
        monkeypatch, capsys, tmp_path):
    real_run_program = flow.run_program

    def interrupted_in_functional_decode(program, steps, **options):
        if isinstance(program, torch.export.ExportedProgram) and any(
                n.target == torch.ops.aten.index_copy.default for n in program.graph.nodes):
            raise KeyboardInterrupt  # as Ctrl-C arrives in the middle of a decode
        return real_run_program(program, steps, **options)

    monkeypatch.setattr(flow, "run_program", interrupted_in_functional_decode)
    try:
        status = cli.main(["run", "--runtime", "python", MODEL, *FAST, "--quiet",
                           "--json", str(tmp_path / "report.json")])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left the job as a KeyboardInterrupt (a traceback for the user)")
    captured = capsys.readouterr()
    assert status == 130, captured.out + captured.err
    assert "PASS  exported program (strict) matches fp32 eager" in captured.out
    assert captured.out.rstrip().endswith(
        "== interrupted (Ctrl-C)\nstage:  decode the functional program (call 1 of 2)")
    assert captured.err.strip() == "interrupted (Ctrl-C)"
    # --json holds the same partial report, as a failed (status 3) run's does.
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["interrupted"] == "decode the functional program (call 1 of 2)"
    assert written["ok"] is False and written["failure"] is None
    assert [c["name"].startswith("exported program (strict) matches fp32 eager")
            for c in written["checks"]] == [True]
    assert "functional" not in written["step_errors"]


def test_a_closed_stdout_ends_the_job_quietly(tmp_path):
    """``python -m passes run | head -1``: the reader leaves before the report is written."""
    started = subprocess.Popen(
        [sys.executable, "-m", "passes", "run", "--runtime", "python", MODEL, *FAST],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert started.stdout.readline().startswith(f"model: {MODEL}")
    started.stdout.close()  # what head does after its first line
    err = started.stderr.read()
    assert started.wait(timeout=300) == cli.OUTPUT_CLOSED == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


@pytest.mark.parametrize(
    ("option", "path", "message"),
    [
        ("--json", "missing/report.json", "--json missing/report.json: no folder 'missing'"),
        ("--json", "a_folder", "--json a_folder: a folder, not a file"),
        # It wrote a file named '-' in the current folder.
        ("--json", "-", "--json -: not stdout: the report goes there; give a file name"),
        ("--dot", "-", "--dot -: not stdout: the report goes there; give a file name"),
        ("--dot", "a_file/plan.dot", "--dot a_file/plan.dot: 'a_file' is a file, not a folder"),
        ("--print-to", "a_file", "--print-to a_file: a file, not a folder"),
        ("--reproducer-dir", "a_file", "--reproducer-dir a_file: a file, not a folder"),
        ("--reproducer-dir", "a_file/repro",
         "--reproducer-dir a_file/repro: 'a_file' is a file, not a folder"),
    ],
)
def test_an_output_path_that_cannot_be_written_is_a_usage_error_before_the_run(
        monkeypatch, capsys, tmp_path, option, path, message):
    def flow_must_not_run(*args, **kwargs):
        raise AssertionError(f"{option} {path} reached the flow")

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "a_file").write_text("")
    status = cli.main(["run", "--runtime", "python", MODEL, "--steps", "2", option, path])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip() == f"error: {message}"


@pytest.mark.parametrize(("option", "path"), [
    ("--json", "/proc/report.json"), ("--print-to", "/proc/dumps/run")])
def test_a_path_the_permission_bits_allow_but_the_system_refuses_is_found_before_the_run(
        monkeypatch, capsys, option, path):
    """/proc's bits let root write in it, and the file was refused only after the run."""
    def flow_must_not_run(*args, **kwargs):
        raise AssertionError(f"{option} {path} reached the flow")

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    status = cli.main(["run", "--runtime", "python", MODEL, "--steps", "2", option, path])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"error: {option} {path}: ") and err.count("\n") == 1, err


def test_a_report_that_cannot_be_written_after_the_run_is_one_line(monkeypatch, capsys,
                                                                     tmp_path):
    """The folder was there when the job started and went away while it ran."""
    report = tmp_path / "gone" / "report.json"
    report.parent.mkdir()

    def flow_removing_the_folder(*args, **kwargs):
        report.parent.rmdir()
        return flow.FlowResult(plan="0. SomePass")

    monkeypatch.setattr(flow, "run_flow", flow_removing_the_folder)
    status = cli.main(["run", "--runtime", "python", MODEL, "--steps", "2", "--quiet",
                       "--json", str(report)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"error: --json {report}: cannot write it: FileNotFoundError")
    assert len(err.strip().splitlines()) == 1


def test_a_report_cut_short_by_a_full_disk_is_not_left_half_written(monkeypatch, capsys,
                                                                    tmp_path):
    """The first bytes stayed in the file (status 2 said it could not be written), and a
    reader of the file found a truncated report."""
    report = tmp_path / "report.json"
    report.write_text('{"ok": true}')  # a previous run's
    write_text = Path.write_text

    def disk_full_halfway(path, text, *args, **kwargs):
        write_text(path, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(flow, "run_flow", lambda *args, **kwargs: flow.FlowResult(plan="0. P"))
    monkeypatch.setattr(Path, "write_text", disk_full_halfway)
    status = cli.main(["run", "--runtime", "python", MODEL, "--steps", "2", "--quiet",
                       "--json", str(report)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip() == (f"error: --json {report}: cannot write it: OSError: No space left "
                           "on device (removed what was left in it)")
    assert not report.exists()


@pytest.mark.parametrize("option", ["--print-before", "--print-after"])
def test_a_misspelt_pass_name_to_print_is_a_usage_error(monkeypatch, capsys, option):
    def flow_must_not_run(*args, **kwargs):
        raise AssertionError("a pass name nothing runs reached the flow")

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    status = cli.main(["run", "--runtime", "python", MODEL, option, "InplaceToFunctionl"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"error: {option}: no pass is named 'InplaceToFunctionl' (did you "
                          "mean 'InplaceToFunctional'?); known: ")
    assert "InplaceToFunctional" in err and len(err.strip().splitlines()) == 1


def test_state_too_large_for_memory_is_warned_before_the_run(monkeypatch, capsys):
    """The job keeps every program's buffers after every call to compare them; a model whose
    copies will not fit would otherwise be killed by the system minutes in, without a word."""
    monkeypatch.setattr(flow, "run_flow", lambda *args, **kwargs: flow.FlowResult(plan="0. P"))
    monkeypatch.setattr(cli, "available_memory", lambda: 1 << 10)  # 1 KiB free: less than one copy
    status = cli.main(["run", "--runtime", "python", MODEL, "--steps", "2", "--quiet"])
    err = capsys.readouterr().err
    assert status == 0
    state = sum(b.nbytes for b in decoder_job(n_layers=1)[0].buffers())
    estimate = state * cli.state_copies(2)
    assert err.strip() == (
        f"warning: {MODEL} holds {state:,} bytes of buffers; the job keeps a copy of them for "
        f"every program it compares, after every call: about {estimate:,} bytes at --steps 2, "
        f"more than the {1 << 10:,} bytes of memory available (fewer --steps need less)")


def test_state_that_fits_in_memory_is_not_warned(monkeypatch, capsys):
    monkeypatch.setattr(flow, "run_flow", lambda *args, **kwargs: flow.FlowResult(plan="0. P"))
    status = cli.main(["run", "--runtime", "python", MODEL, "--steps", "2", "--quiet"])
    assert status == 0 and capsys.readouterr().err == ""


def test_a_bfloat16_model_on_executorchs_runtime_is_a_usage_error(monkeypatch, capsys):
    """ExecuTorch's dequantize aborted the whole job (status 134, no report) on it."""
    def flow_must_not_run(*args, **kwargs):
        raise AssertionError("a bfloat16 model reached the flow")

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    status = cli.main(["run", "tests.models.main_job:bfloat16_running_sum", "--steps", "2",
                       "--runtime", "executorch"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip() == (
        "error: --runtime executorch: tests.models.main_job:bfloat16_running_sum computes in "
        "torch.bfloat16 (linear.weight), and the ExecuTorch runtime stage takes float32 "
        "programs (ExecuTorch's dequantize aborts on a bfloat16 output; the check allows "
        "float32's 1e-5): convert the model with .float() in the factory, or run with "
        "--runtime python")


def test_a_bfloat16_model_by_default_decodes_in_python_with_a_notice(monkeypatch, capsys):
    import passes.executorch as executorch

    monkeypatch.setattr(executorch, "available", lambda: True)
    status = cli.main(["run", "tests.models.main_job:bfloat16_running_sum", *FAST])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert "decoding in Python only: tests.models.main_job:bfloat16_running_sum computes in " \
           "torch.bfloat16" in captured.err
    assert "runtime python" in captured.out.splitlines()[0]


@pytest.mark.parametrize(("factory", "where"), [
    ("a_step_with_a_keyword_the_example_did_not_give", "steps[1]"),
    ("a_method_call_with_a_keyword_its_example_did_not_give", "steps[1] (decode)"),
])
def test_a_call_that_fits_forward_but_not_the_exported_program_is_a_load_error(
        monkeypatch, capsys, factory, where):
    """It failed the first decode making it (status 3) after the decodes before it; for
    several methods, after each method's export."""
    def flow_must_not_run(*args, **kwargs):
        raise AssertionError("a call that does not fit reached the flow")

    monkeypatch.setattr(flow, "run_flow", flow_must_not_run)
    import passes.flow.run_methods as methods_flow

    monkeypatch.setattr(methods_flow, "run_methods_flow", flow_must_not_run)
    model = f"tests.models.main_job:{factory}"
    status = cli.main(["run", "--runtime", "python", model, "--steps", "2"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip() == (
        f"error: {model}(): {where} does not fit the exported program's inputs (x): the program "
        "takes no keyword argument(s) 'scale' (a program takes the inputs its export example "
        "gave)")


def test_a_pass_to_print_that_this_run_never_runs_is_warned(capsys):
    """QuantizeMutableBuffers is a known pass, but runs only with --quantize-state."""
    status = cli.main(["run", "--runtime", "python", MODEL, *FAST, "--quiet",
                       "--print-after", "QuantizeMutableBuffers",
                       "--print-before", "MarkMutableBuffers"])
    captured = capsys.readouterr()
    assert status == 0 and "IR Dump Before MarkMutableBuffers" in captured.out
    assert captured.err.strip() == (
        "warning: --print-before/--print-after QuantizeMutableBuffers: no pipeline of this run "
        "ran that pass; nothing was printed for it")


def test_a_pipeline_that_changes_the_inputs_fails_naming_it_not_at_the_first_decode(capsys):
    """BuffersToInputs makes the caches keyword inputs no step gives: status 3 (found after
    loading, once the pipeline ran), naming the pipeline and the inputs before and after."""
    status = cli.main(["run", "--runtime", "python", MODEL, *FAST, "--quiet", "--pipeline",
                       "MarkMutableBuffers,InplaceToFunctional,BuffersToInputs"])
    failed = capsys.readouterr().out.split("== failed")[1]
    assert status == 3
    assert "stage:  check the steps fit the pipeline's program" in failed
    assert ("reason: PipelineError: the pipeline PassManager[MarkMutableBuffers, "
            "InplaceToFunctional, BuffersToInputs] changed the program's inputs from "
            "(x, input_pos) to (x, input_pos, *, layers_0_attn_k_cache, layers_0_attn_v_cache): "
            "steps[0] no longer fits") in failed
    assert "kwarg keyword mismatch" not in failed


def test_steps_past_the_cache_are_one_line_and_status_two_before_the_run(capsys):
    """Eager failed at the fifth call with torch's IndexError (status 3, after the eager
    decode); on ExecuTorch's runtime it was an untyped RuntimeError 0x12."""
    status = cli.main(["run", "tests.models.static_cache:past_the_cache", "--quiet",
                       "--runtime", "python", "--skip-quantization", "--skip-delegation"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err == (
        "error: tests.models.static_cache:past_the_cache(): steps[4] writes position 4 of "
        "'cache' along dimension 1, which holds 4 (positions 0 to 3): the calls go past the "
        "state's end; give fewer calls, positions within it, or a longer state (--steps 4 "
        "stops before it)\n")


def test_a_ring_buffer_wrapping_around_its_cache_runs(capsys):
    status = cli.main(["run", "tests.models.static_cache:ring_buffer", "--quiet",
                       "--runtime", "python", "--skip-delegation"])
    assert status == 0, capsys.readouterr().out


def test_more_steps_than_the_factory_gives_says_how_many_it_decodes(capsys):
    """--steps 20 on a factory giving 8 decoded 8, the help saying 'decode calls'."""
    status = cli.main(["run", "tests.models.static_cache:ring_buffer", "--steps", "20",
                       "--runtime", "python", "--skip-quantization", "--skip-delegation"])
    captured = capsys.readouterr()
    assert status == 0
    assert ("--steps 20: tests.models.static_cache:ring_buffer gives 8 step(s); decoding "
            "those\n") in captured.err
    assert "8 decode steps" in captured.out


_OWN_PASS_MODEL = '''
from dataclasses import dataclass

import torch

from pass_manager import Pass, PassResult, graph_of


@dataclass(frozen=True, repr=False)
class CountsCallsOfTheUser(Pass):
    """A pass of the user's own: counts the call_function nodes, changes nothing."""

    def call(self, program):
        count = sum(n.op == "call_function" for n in graph_of(program).nodes)
        return PassResult(program, False, statistics={"calls seen": count})


class Sums(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


def factory():
    return Sums(), (torch.ones(3),)
'''


def test_a_pass_the_models_module_defines_runs_in_the_pipeline(monkeypatch, capsys, tmp_path):
    """--pipeline was read before MODEL's module was imported, so a pass of the user's own
    was never registered: status 2, 'no registered pass is named ... (import the module that
    defines it)', which a command line cannot do."""
    (tmp_path / "own_pass_model.py").write_text(_OWN_PASS_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    status = cli.main(["run", "--runtime", "python", "own_pass_model:factory", *FAST, "--quiet",
                       "--pipeline", "MarkMutableBuffers,InplaceToFunctional,CountsCallsOfTheUser",
                       "--print-after", "CountsCallsOfTheUser"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "// -----// IR Dump After CountsCallsOfTheUser (#2) //----- //" in out
    assert "calls seen" in out
    status = cli.main(["run", "--runtime", "python", "own_pass_model:factory", *FAST,
                       "--pipeline", "MarkMutableBuffers,CountsCallsOfTheUsr"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --pipeline: no registered pass is named 'CountsCallsOfTheUsr'")
    assert err.strip().endswith("(a pass of your own: define or import it in MODEL's module)")


def test_a_reproducer_of_a_pass_a_model_file_defines_replays(capsys, tmp_path):
    """A MODEL given as a file was imported under a made-up module name, so the reproducer
    of a pass it defines named a module no replay could import: the command the failure
    printed ended in 'ModuleNotFoundError: No module named
    '_mutable_buffer_passes_model_...''."""
    (tmp_path / "own_failing_pass.py").write_text(_OWN_PASS_MODEL.replace(
        'return PassResult(program, False, statistics={"calls seen": count})',
        'raise ValueError(f"{count} calls: too many")').replace("CountsCallsOfTheUser",
                                                              "FailsForTheUser"))
    status = cli.main(["run", "--runtime", "python", str(tmp_path / "own_failing_pass.py:factory"),
                       *FAST, "--quiet", "--reproducer-dir", str(tmp_path / "repro"),
                       "--pipeline", "MarkMutableBuffers,FailsForTheUser"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("reproducer: "))
    assert status == 3
    replayed = subprocess.run([sys.executable, "-m", "pass_manager", "replay", line.split()[1],
                               "--trust"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 1, replayed.stderr
    assert "calls: too many" in replayed.stdout
    assert "reproduced: the recorded error" in replayed.stdout


def test_json_report_writes_errors_that_are_not_finite_as_strings_json_can_hold(tmp_path):
    # A buffer holding -inf (an attention mask) that quantization made finite is off by
    # inf; json.dumps wrote it as Infinity, which strict JSON parsers refuse.
    from passes.flow.result import FlowResult

    result = FlowResult()
    result.step_errors = {"quantized, with passes": [0.5, math.inf]}
    result.buffer_errors = {"quantized, with passes": {"mask": math.inf, "nan": math.nan}}
    report = tmp_path / "report.json"
    args = cli.build_parser().parse_args(["run", "--quiet", "--json", str(report)])
    assert cli._write_outputs(args, result)

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    written = json.loads(report.read_text(), parse_constant=refuse)
    assert written["step_errors"]["quantized, with passes"] == [0.5, "inf"]
    assert written["buffer_errors"]["quantized, with passes"] == {"mask": "inf", "nan": "nan"}
