"""The command line follows the conventions: help on every flag, the exit statuses and the
default model in --help, --version, the report alone on stdout with progress on stderr,
--quiet, and a usage error (status 2) for a number of decode calls that is not positive."""

import importlib.metadata

import pytest

import passes
from passes.flow import cli
from passes.flow import run as flow

from .main_job_cli import run_main

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
    [("0", "must be at least 1"), ("-3", "must be at least 1"), ("two", "expected a whole number")],
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
