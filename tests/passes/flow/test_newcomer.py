"""What a newcomer meets in their second hour (issue 33), through the installed console
command where it is the command line: their own model from their own folder or a file,
a default run that shows what the passes bought, quiet progress, and a report that says
which column is what and where the time went."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pass_manager import Report
from pass_manager.report import PassRecord
from pass_manager.validation import Trace
from passes.flow import cli
from passes.flow import run_methods as methods_flow
from passes.flow.examples import decoder_job, prefill_decode_job
from passes.flow.result import FlowResult
from tests.models.accumulators import DividesByItsState

from .main_job_cli import ROOT

COMMAND = Path(sys.executable).with_name("mutable-buffer-passes")
FAST = ("--steps", "2", "--skip-quantization", "--skip-delegation", "--runtime", "python")

# A user's own decoder, outside the repository: an int64 position counter and a cache.
HANDWRITTEN = textwrap.dedent('''
    import torch

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(4, 3))
            self.register_buffer("pos", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            self.cache.index_copy_(0, self.pos.view(1), x)
            self.pos += 1
            return self.cache.sum(0) * 2

    def factory():
        steps = [(torch.full((1, 3), float(i)),) for i in range(3)]
        return Counter(), steps[0], steps

    def keyword_factory():  # the Hugging Face form: every input by keyword
        steps = [((), {"x": torch.full((1, 3), float(i))}) for i in range(3)]
        return {"module": Counter(), "example_kwargs": steps[0][1], "steps": steps}
''')


def _command(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    # PYTHONPATH names the checkout only so a development worktree tests its own code; an
    # installed package needs nothing (the editable install points at the checkout too).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(COMMAND), "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text("")
    (tmp_path / "mymodels" / "handwritten.py").write_text(HANDWRITTEN)
    return tmp_path


@pytest.mark.parametrize("model", ["mymodels.handwritten:factory",
                                   "mymodels/handwritten.py:factory"])
def test_a_model_in_the_users_own_folder_runs(user_folder, model):
    done = _command(model, *FAST, "--quiet", cwd=user_folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"model: {model}") and "FAIL" not in done.stdout


def test_keyword_inputs_run_on_executorchs_runtime(user_folder):
    """Issue 33, item 1: keyword steps (the HF form) reached the runtime after 140 s of
    lowering and were refused there; they are flattened by the program's call spec."""
    pytest.importorskip("executorch")
    done = _command("mymodels.handwritten:keyword_factory", "--steps", "3", "--runtime",
                    "executorch", "--skip-quantization", "--skip-delegation", "--quiet",
                    cwd=user_folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS  ExecuTorch runtime decodes the fp32 program like Python" in done.stdout


def test_a_model_that_cannot_be_found_says_where_it_looked(user_folder):
    done = _command("mymodels.missing:factory", *FAST, cwd=user_folder)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert str(user_folder) in line and "PYTHONPATH" in line and "file.py:factory" in line
    done = _command("mymodels/missing.py:factory", *FAST, cwd=user_folder)
    assert done.returncode == 2 and "no such file 'mymodels/missing.py'" in done.stderr


def test_the_default_run_shows_what_the_passes_bought_with_one_bar_per_stage(tmp_path):
    done = _command("--runtime", "python", "--steps", "3", "--show-warnings", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    bought = done.stdout.split("== what the passes bought")[1].split("\n==")[0]
    first = re.search(r"first decode step off by ([\d.e-]+) without the passes, ([\d.e-]+) with",
                      bought)
    assert first is not None, bought
    without, with_ = float(first[1]), float(first[2])
    assert without > 5 * with_, bought  # calibration's state left in the buffers, undone
    assert "columns:" in done.stdout and "quantized, no passes: torchao's recipe" in done.stdout
    assert "== slowest stages" in done.stdout
    progress, _, held = done.stderr.partition("== warnings held back as known harmless")
    assert held, done.stderr
    # One line per stage (a tqdm bar redraws its line in place), nothing else.
    lines = [line for line in progress.splitlines() if line.strip()]
    stages = len(re.findall(r"^\S.*\[\d\d:\d\d\]", progress, re.M))
    assert len(lines) <= stages + 1, progress
    for noise in ("Warning", "Failed to load", "LeafSpec", "Traceback"):
        assert noise not in progress
    assert len(held.strip().splitlines()) >= 2  # the count line, then what was held


def test_quiet_prints_nothing_on_stderr(tmp_path, user_folder):
    done = _command("mymodels.handwritten:factory", "--steps", "2", "--runtime", "python",
                    "--quiet", cwd=user_folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""


def test_auto_runtime_falls_back_to_python_with_a_notice(monkeypatch, capsys):
    import passes.executorch as executorch

    monkeypatch.setattr(executorch, "available", lambda: False)
    status = cli.main(["run", "tests.models.main_job:one_layer_decoder", "--steps", "2",
                       "--skip-quantization", "--skip-delegation"])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert "ExecuTorch is not installed: decoding in Python only" in captured.err
    assert "runtime python" in captured.out.splitlines()[0]


def test_the_pass_table_numbers_passes_once_across_stages():
    def report(*names: str) -> Report:
        r = Report()
        r.records = [PassRecord(name=n, index=i) for i, n in enumerate(names)]
        return r

    result = FlowResult(reports=[("a", report("P", "Q")), ("b", report("R"))])
    rows = result.pass_table().splitlines()[2:5]
    assert [row.split()[0] for row in rows] == ["0", "1", "2"]


def test_the_methods_runtime_column_is_its_error_against_eager(monkeypatch):
    """The decode table's header says "vs fp32 eager": the runtime's column must hold that,
    not the runtime's difference from the same methods in Python (which is the check's)."""
    import passes.executorch.methods as methods
    import passes.executorch.runtime as runtime

    eager = Trace([[torch.tensor([1.0])], [torch.tensor([2.0])]])
    python = Trace([[torch.tensor([1.5])], [torch.tensor([2.25])]])

    run = SimpleNamespace(outputs=[list(o) for o in python.outputs],
                          notes=["kept 'cache' at the top level"],
                          memory=SimpleNamespace(shared_bytes=64))
    monkeypatch.setattr(methods, "run_methods_on_runtime", lambda programs, calls: run)
    monkeypatch.setattr(runtime, "output_grid", lambda program: 0.1)
    monkeypatch.setattr(methods_flow, "find_mutations", lambda p: SimpleNamespace(writers={}))
    result = FlowResult()
    stage = lambda title, fn: fn()  # noqa: E731
    program = SimpleNamespace(graph_module=None)
    methods_flow._runtime_stage(stage, result, [("quantized", {"m": program}, python)],
                                [("m", (), {})] * 2, eager, ran_before={})
    assert result.step_errors["quantized on ExecuTorch"] == [0.5, 0.25]
    assert result.notes == ["quantized methods' lowering: kept 'cache' at the top level"]
    assert result.checks[-1].passed  # runtime == Python


class _Linear(torch.nn.Module):
    """No state at all: the passes have nothing to keep."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class _ScalesByABuffer(_Linear):
    """A buffer it reads and never writes: no state between calls either."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return self.proj(x) * self.scale


class _WritesAParameter(torch.nn.Module):
    """State kept in a parameter: the flow keeps it, but compares buffers only."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        with torch.no_grad():
            self.scale.add_(1)
        return x * self.scale


class _CountsCalls(torch.nn.Module):
    """Integer state alone: a call counter, no floating-point buffer."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return self.proj(x) + self.calls


def _flow(model, dtype=torch.float32, **options):
    from passes.flow import run_flow

    torch.manual_seed(0)
    steps = [(torch.randn(2, 4, dtype=dtype),) for _ in range(3)]
    return run_flow(model, steps[0], steps, delegate=False, log=lambda line: None, **options)


def test_a_model_with_integer_state_alone_is_not_told_it_has_no_buffers():
    result = _flow(_CountsCalls())
    assert result.ok
    buffers_check = next(c for c in result.checks if c.name.startswith("quantized buffers"))
    assert buffers_check.detail == (
        "the model's buffers are integers (calls): no quantization grid to compare them on; "
        "their values reach the outputs compared below")


class _RotatesAPhase(torch.nn.Module):
    """Complex state: a phase turned by what it reads, its real part in the output."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("phase", torch.ones(4, dtype=torch.complex64))

    def forward(self, x):
        y = self.proj(x)
        self.phase.mul_(torch.polar(torch.ones(4), y.mean(0)))
        return y + self.phase.real


def test_a_model_with_complex_state_has_it_compared_not_called_integers():
    """A complex buffer was labelled an integer and left out of every state comparison (and
    a complex value's difference dropped its imaginary part)."""
    from pass_manager.validation import Trace, buffer_errors, output_errors
    from passes.flow.quantization import NO_PASSES, WITH_PASSES

    turned = Trace([(torch.tensor([1j]),)], [{"phase": torch.tensor([1j])}], [])
    still = Trace([(torch.tensor([0j]),)], [{"phase": torch.tensor([0j])}], [])
    assert output_errors(turned, still) == [1.0]
    assert buffer_errors(turned, still) == [{"phase": 1.0}]
    result = _flow(_RotatesAPhase())
    assert result.ok
    errors = result.buffer_errors
    assert errors[WITH_PASSES]["phase"] < 0.1 < errors[NO_PASSES]["phase"]
    buffers_check = next(c for c in result.checks if c.name.startswith("quantized buffers"))
    assert "integers" not in buffers_check.detail and "worst phase" in buffers_check.detail


class _FillsACache(torch.nn.Module):
    """A static cache of 3 positions and a position counter: 3 calls fill it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(3, 4))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.cache.index_copy_(0, self.pos.view(1), self.proj(x).sum(0, keepdim=True))
        self.pos.add_(1)
        return self.cache * 2


def test_torchaos_recipe_decoding_past_the_cache_is_a_column_lost_not_the_job():
    """torchao's recipe decodes from the position calibration left (3 calls on), past the
    cache's end at its first call: the job stopped there (status 3, an IndexError), with
    the passes' flow, which decodes in range, never reported."""
    from passes.flow.quantization import NO_PASSES, RESET, WITH_PASSES

    result = _flow(_FillsACache())
    assert result.ok and result.failure is None
    assert NO_PASSES not in result.step_errors and max(result.step_errors[WITH_PASSES]) < 0.1
    assert RESET in result.step_errors and len(result.checks) == 4
    assert result.bought[0].startswith("torchao's recipe without the passes fails (decode "
                                       "quantized, no passes (call 1 of 3): IndexError")


class _ReturnsItsPosition(_CountsCalls):
    """Returns the position it wrote at beside its output, as a generate loop reads it."""

    def forward(self, x):
        self.calls.add_(1)
        return self.proj(x), self.calls + 0


def test_an_integer_output_off_after_calibration_shows_in_the_decode():
    """Integer outputs were left out of the comparison: torchao's recipe, which starts
    decoding at the position calibration left (3 calls on), was 'off by 0'."""
    from passes.flow.quantization import NO_PASSES, WITH_PASSES

    result = _flow(_ReturnsItsPosition())
    assert result.step_errors[NO_PASSES] == [3.0, 3.0, 3.0]
    assert max(result.step_errors[WITH_PASSES]) < 0.1
    assert result.bought[0].startswith("first decode step off by 3 without the passes")


def test_a_quantized_decode_off_by_inf_is_told_so():
    """Every column read 'inf' (a 309-digit number before) and the checks, which compare the
    flows with each other, passed without a word."""
    result = _flow(DividesByItsState())
    assert ("off by inf from fp32 eager (an output NaN or inf, or of another shape) at some "
            "step: 'quantized, no passes', 'quantized, no passes, caches reset by hand', "
            "'quantized, with passes'") in result.notes


def test_a_pipeline_leaving_the_writes_in_place_is_not_told_the_model_writes_no_buffer():
    from pass_manager import parse_pipeline

    result = _flow(_CountsCalls(), quantize=False, pipeline=parse_pipeline("MarkMutableBuffers"))
    assert result.ok
    assert not any("writes no buffer" in note for note in result.notes), result.notes


@pytest.mark.parametrize("model", [_Linear, _ScalesByABuffer])
def test_a_model_without_state_is_told_so_not_shown_a_zero_state_error(model):
    """A model with a buffer it never writes was told "the model has no buffers"."""
    result = _flow(model())
    assert result.ok
    assert ("the model writes no buffer: it keeps no state between calls, so the passes have "
            "nothing to keep and the comparisons measure quantization alone") in result.notes
    assert not any("state error" in line for line in result.bought)
    buffers_check = next(c for c in result.checks if c.name.startswith("quantized buffers"))
    assert buffers_check.detail == "the model writes no buffer: nothing to compare"


def test_a_model_writing_a_parameter_is_told_where_its_state_goes_unchecked():
    result = _flow(_WritesAParameter())
    assert result.ok
    assert ("the model writes the parameter(s) 'scale' in place: the flow keeps them as state, "
            "but the state comparisons read buffers only, and ExecuTorch's runtime refuses a "
            "written parameter (register them as buffers)") in result.notes
    assert not any("state error" in line for line in result.bought)


def test_a_float64_model_is_told_quantization_takes_float32():
    from passes.flow import FlowError

    with pytest.raises(FlowError) as info:
        _flow(_Linear().double(), torch.float64)
    failure = info.value.failure
    assert failure.stage == "quantize with the passes"
    assert failure.reason.endswith(
        "(pt2e quantization takes float32 models: convert the model with .float() in the "
        "factory, or run with --skip-quantization)")


def test_a_float64_model_writing_a_parameter_runs_through_quantization():
    """Its parameter's update, left unannotated, was folded by convert and its copy_ run on
    the parameter: torch's leaf-variable error stopped the flow at quantization."""
    result = _flow(_WritesAParameter().double(), torch.float64)
    assert result.ok
    assert any("'scale'" in note for note in result.notes)


@pytest.mark.parametrize("model", ["needs_a_package:factory", "needs_a_package.py:factory"])
def test_a_model_whose_own_import_fails_is_not_said_to_be_missing(monkeypatch, capsys,
                                                                   tmp_path, model):
    """The module is there; a package it imports is not installed. Saying where the job
    looked for the module sends the user to the wrong problem."""
    (tmp_path / "needs_a_package.py").write_text(
        "import torch\nimport a_package_nobody_installed\n\n\ndef factory():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "needs_a_package", raising=False)
    status = cli.main(["run", "--runtime", "python", model])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip() == (
        f"error: cannot import {model.split(':')[0]!r}: it imports 'a_package_nobody_installed', "
        "which is not installed (ModuleNotFoundError: No module named "
        "'a_package_nobody_installed')")


_NOT_A_FACTORY = """\
import sys

import torch

if __name__ == "exits_at_import":  # a script parsing its command line at import
    import argparse

    argparse.ArgumentParser().parse_args(["--size"])


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)
        return x + self.count


counter = Counter()


def exits():
    sys.exit(3)
"""


@pytest.mark.parametrize(("model", "message"), [
    # argparse's usage error, then SystemExit(2) out of the job with its usage line.
    ("exits_at_import:exits", "error: cannot import 'exits_at_import': importing it called "
     "sys.exit(2) (code run at import, such as a script's argparse: put it under "
     "if __name__ == '__main__':)"),
    # Status 3 ("the flow failed") and nothing said.
    ("not_a_factory:exits", "error: not_a_factory:exits() called sys.exit(3): a factory returns "
     "the model"),
    # "not_a_factory:Counter() must return (module, example_inputs) ..., got Counter".
    ("not_a_factory:Counter", "error: not_a_factory:Counter is an nn.Module class (Counter), "
     "not a factory: MODEL names a function returning the module and its example inputs, e.g. "
     "def factory(): return Counter(...), (example_input,)"),
    # "not_a_factory:counter() failed: TypeError: Counter.forward() missing 1 required ...".
    ("not_a_factory:counter", "error: not_a_factory:counter is an nn.Module instance (Counter), "
     "not a factory"),
])
def test_a_model_that_names_no_factory_is_one_line_and_status_two(monkeypatch, capsys, tmp_path,
                                                                  model, message):
    module = model.partition(":")[0]
    (tmp_path / f"{module}.py").write_text(_NOT_A_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    status = cli.main(["run", "--runtime", "python", model])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.strip().splitlines()[-1].startswith(message), err
    assert "Traceback" not in err


@pytest.mark.parametrize(("model", "message"), [
    # "MODEL must be package.module:factory ... got 'mymodels.handwritten.factory'" alone.
    ("mymodels.handwritten.factory", "(did you mean mymodels.handwritten:factory?)"),
    # A folder without __init__.py imports as an empty namespace package: "'newcomer_models'
    # has no attribute 'factory'" alone.
    ("newcomer_models:factory", "'newcomer_models' is a folder, and MODEL names a module in it, "
     "e.g. newcomer_models.handwritten:factory"),
])
def test_a_model_named_almost_right_is_told_the_name_it_meant(user_folder, monkeypatch, capsys,
                                                              model, message):
    (user_folder / "newcomer_models").mkdir()
    (user_folder / "newcomer_models" / "handwritten.py").write_text(HANDWRITTEN)
    monkeypatch.chdir(user_folder)
    monkeypatch.syspath_prepend(str(user_folder))
    status = cli.main(["run", "--runtime", "python", model])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip().endswith(message), err


@pytest.mark.parametrize("made", [lambda: decoder_job(n_layers=1, steps=2),
                                  lambda: prefill_decode_job(n_layers=1)],
                         ids=["a factory's result", "several methods"])
def test_run_model_given_what_it_does_not_take_says_what_it_takes(made):
    """It failed with "AttributeError: 'tuple' object has no attribute 'module'"."""
    from passes.flow import model_spec, run_model

    given = made()
    given = model_spec(given, "job", 2) if isinstance(given, dict) else given
    with pytest.raises(TypeError, match=r"run_model takes model_spec\(factory\(\), name, steps\)"):
        run_model(given, quantize=False, log=lambda line: None)


def test_run_flow_given_steps_past_the_cache_says_which_before_decoding():
    """Without a program exported beforehand, eager decoded first and failed at that call
    with torch's IndexError ("index 4 is out of bounds"): now the flow exports first."""
    from passes import StatePastEndError
    from passes.flow import run_flow
    from passes.flow.factory import export_program
    from passes.flow.result import FlowError
    from tests.models.static_cache import CountedWrites, token_calls

    calls = token_calls(6)
    for exported in (export_program(CountedWrites(), calls[0]), None):
        with pytest.raises(FlowError) as info:
            run_flow(CountedWrites(), calls[0], calls, exported=exported, log=lambda line: None)
        stages = [title for title, _ in info.value.result.stage_times]
        assert stages == ["export"] * (exported is None) + [
            "check the steps stay within the state"]
        assert isinstance(info.value.__cause__, StatePastEndError)
        assert "steps[4] writes position 4 of 'cache'" in info.value.failure.reason


def test_a_position_the_caller_carries_in_an_input_is_followed_by_the_flow():
    """A model advancing its position input in place, given one tensor for every step: the
    check missed the step past the cache (each step read position 0), and quantize_program's
    calibration advanced the steps' own tensor, so the decodes after it started at 4 and
    failed with torch's IndexError."""
    from passes import StatePastEndError
    from passes.errors import CarriedStateWarning
    from passes.flow import run_flow
    from passes.flow.result import FlowError
    from tests.models.static_cache import ROWS, CarriedCounter, token_calls

    def calls(count):
        pos = torch.zeros(1, dtype=torch.long)
        return [(x, pos) for (x,) in token_calls(count)]

    steps = calls(ROWS)
    with warnings.catch_warnings():  # "pass fresh tensors": the flow calibrates on copies
        warnings.simplefilter("error", CarriedStateWarning)
        result = run_flow(CarriedCounter(), steps[0], steps, delegate=False,
                          log=lambda line: None)
    assert result.ok, [c for c in result.checks if not c.passed]
    assert int(steps[0][1]) == 0  # the caller's tensor: no call of the flow wrote it
    steps = calls(ROWS + 1)
    with pytest.raises(FlowError) as info:
        run_flow(CarriedCounter(), steps[0], steps, quantize=False, log=lambda line: None)
    assert isinstance(info.value.__cause__, StatePastEndError)
    assert f"steps[{ROWS}] writes position {ROWS} of 'cache'" in info.value.failure.reason


def test_state_carried_in_inputs_is_not_called_no_buffers():
    """A model whose cache is an input it writes: the buffer check said "the model has no
    buffers: nothing to compare", as of a model without state."""
    from passes.flow import run_flow
    from tests.models.input_state import DIM, InputCache

    cache = torch.zeros(4, DIM)
    steps = [(torch.randn(1, DIM), torch.tensor([i]), cache) for i in range(3)]
    result = run_flow(InputCache(), steps[0], steps, delegate=False, log=lambda line: None)
    detail = next(c.detail for c in result.checks if c.name.startswith("quantized buffers"))
    assert detail == ("the model keeps its state in the inputs it writes (cache), not in "
                      "buffers: the outputs compared below are what measure it")
    assert result.ok


class _ReturnsNothing(torch.nn.Module):
    """Keeps a running sum and returns None: only its state says what it computed."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.total.add_(x.sum(0))


def test_a_model_returning_nothing_is_told_its_output_errors_compare_nothing():
    """Its decode table read 0.000000 in every output column without a word."""
    result = _flow(_ReturnsNothing())
    assert result.ok
    assert ("the model returns no tensor (None, or only Python values): the decode table's "
            "output errors compare nothing and read 0; its state, compared below it, is what "
            "measures the programs") in result.notes
    # What the passes bought is its state alone, not "first decode step off by 0 ... 0 with".
    assert [line.split(" error ")[0] for line in result.bought] == ["worst state"]
    assert not any("returns no tensor" in note for note in _flow(_CountsCalls()).notes)


class _SumsWithAnEmptyCache(torch.nn.Module):
    """A running sum beside a cache of zero positions (a window sized to nothing) that
    forward also writes."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("window", torch.zeros(0, 4))

    def forward(self, x):
        self.total.add_(self.proj(x).sum(0))
        self.window.mul_(2)
        return self.total + 1


def test_an_empty_buffer_is_compared_not_a_crash_of_the_checks():
    """Its relative error divided by the largest value of an empty tensor: the flow failed
    in 'checks after decode quantized, with passes' with torch's RuntimeError max()."""
    result = _flow(_SumsWithAnEmptyCache())
    assert result.ok
    assert set(result.buffer_errors["quantized, with passes"]) == {"total", "window"}
    assert result.buffer_errors["quantized, with passes"]["window"] == 0.0


def test_a_quantized_minus_inf_mask_is_a_note_naming_it():
    """Every check passed while the quantized decode was off by 0.6 (both quantized flows
    made the mask finite, so they agreed), and nothing said so."""
    from passes.flow.run import run_flow
    from tests.models.main_job import MaskedCacheAttention, masked_cache_steps

    steps = masked_cache_steps()
    result = run_flow(MaskedCacheAttention().eval(), steps[0], steps, delegate=False,
                      log=lambda line: None)
    (note,) = [n for n in result.notes if "inf, NaN or an extreme value" in n]
    assert "'add' held -inf" in note and "no longer masks" in note
