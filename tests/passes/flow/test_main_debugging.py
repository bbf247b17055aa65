"""The main job's debugging flags: statistics in its table and --json, --print-after and
friends, and --reproducer-dir for a pass that fails inside the job."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pass_manager import PassManager, PassManagerError, PreconditionError, Reproducer
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.flow.result import failure_of
from tests.models.failing import writes_constant
from tests.models.main_job import one_layer_decoder

ROOT = Path(__file__).resolve().parents[3]


def _run(*args, module="passes", command="run"):
    return subprocess.run(
        [sys.executable, "-m", module, command, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )


def test_statistics_and_printing_in_the_main_job(tmp_path):
    report = tmp_path / "report.json"
    done = _run("tests.models.main_job:one_layer_decoder", "--steps", "2",
                "--skip-quantization", "--print-after", "InplaceToFunctional",
                "--print-before", "MarkMutableBuffers", "--json", str(report))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "IR Dump Before MarkMutableBuffers (#0)" in out
    assert "IR Dump After InplaceToFunctional (#1)" in out
    table = out.split("== passes")[1]
    assert "statistics:" in table and "in-place ops rewritten: aten.index_copy_" in table
    assert "buffers moved into a delegate" in table
    data = json.loads(report.read_text())
    records = data["passes"]["functionalize"]["records"]
    assert records[0]["statistics"]["mutable buffers marked"] == 2  # the k and v caches
    assert records[1]["statistics"]["in-place ops rewritten: aten.index_copy_"] == 2


def test_a_pass_failing_in_the_main_job_leaves_a_reproducer(tmp_path):
    dumps = tmp_path / "ir"
    done = _run("tests.models.failing:writes_constant", "--steps", "2",
                "--reproducer-dir", str(tmp_path / "repro"), "--print-after-failure",
                "--print-to", str(dumps))
    assert done.returncode == 3, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("reproducer: "))
    folder = Path(line.split()[1])
    assert folder.parent == tmp_path / "repro"
    # the exact command to rerun it, as its manifest gives it (with --trust when its files
    # need it)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert line.endswith(f"(rerun it: {manifest['replay']})")
    assert [p.name for p in dumps.iterdir()] == ["001-1-InplaceToFunctional-after-failure.txt"]
    replayed = _run(str(folder), module="pass_manager", command="replay")
    assert replayed.returncode == 1
    assert "UnsupportedMutationError" in replayed.stdout
    assert "reproduced: the recorded error" in replayed.stdout


def test_a_reproducer_that_could_not_be_written_is_said_in_the_failure(tmp_path):
    """The failure names why there is no reproducer, instead of leaving the line out."""
    taken = tmp_path / "a_file"
    taken.write_text("")  # where the folder should go: mkdir fails
    model, example = writes_constant()
    program = torch.export.export(model, example, strict=False)
    with pytest.raises(PassManagerError) as info:
        PassManager([MarkMutableBuffers(), InplaceToFunctional()],
                    instruments=[Reproducer(taken / "repro")]).run(program)
    lines = failure_of("functionalize", info.value).lines()
    assert lines[-1].startswith("reproducer: not written: ")
    assert "a_file" in lines[-1]


def test_a_missing_requirement_names_the_pass_that_provides_it_in_the_failure():
    """--pipeline InplaceToFunctional alone: the reason ends with which pass to add, not with
    the 'violation(s):' its first line stops at."""
    model, example, _ = one_layer_decoder()
    program = torch.export.export(model, example)
    with pytest.raises(PreconditionError) as info:
        PassManager([InplaceToFunctional()]).run(program)
    failure = failure_of("functionalize", info.value)
    assert failure.reason == (
        "PreconditionError: required condition 'MutableBuffersMarked' does not hold "
        f"({len(info.value.violations)} violation(s)); No pass in this pipeline provides it; "
        "add one of: MarkMutableBuffers.")
    assert failure.node == info.value.violations[0]


class _TwoNamesOneTensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        state = torch.zeros(1, 4)
        self.register_buffer("a", state)
        self.register_buffer("b", state)  # the same tensor: writing a writes b

    def forward(self, x):
        self.a.add_(x)
        return x * 2 + self.b


def test_a_failure_about_a_buffer_names_the_buffer_and_partition():
    """The report said only "BufferAliasingError: its tensor shares storage with a": the
    error's reason, without the buffer and partition its message leads with."""
    from passes.flow import model_spec, run_model
    from passes.flow.run import FlowError

    spec = model_spec((_TwoNamesOneTensor(), (torch.ones(1, 4),)), "aliased", 2)
    with pytest.raises(FlowError) as info:
        run_model(spec, quantize=False, runtime="python", log=lambda line: None)
    assert info.value.failure.reason == (
        "BufferAliasingError: buffer 'b', partition 'delegate_0': its tensor shares storage "
        "with 'a'")


def test_a_buffer_named_by_a_letter_of_the_reason_is_still_named():
    """The buffer counted as said when its name occurred anywhere in the reason: buffer
    's' was dropped from "its tensor shares storage with 't'" (the s of "shares")."""
    from passes.delegation.errors import BufferAliasingError
    from passes.flow.result import failure_of

    error = BufferAliasingError("s", "delegate_0", "its tensor shares storage with 't'",
                                "ConsumeBufferMutationsInDelegate")
    assert failure_of("delegate", error).reason == (
        "BufferAliasingError: buffer 's', partition 'delegate_0': its tensor shares storage "
        "with 't'")
