"""The fuzzing command ``python -m benchmarks.fuzz_functionalize`` reports its counts.

Run as a user runs it, in a subprocess from the checkout: tests never import benchmarks
(the generator and the check it runs are tests/models/random_programs.py's, which the
property-based test drives in process)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fuzz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.fuzz_functionalize", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )


def test_fuzz_command_reports_counts():
    done = fuzz("--programs", "12", "--seed", "7", "--no-torch")
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout
    assert "checked 12 programs" in report
    assert "mismatch                     0" in report
    assert "run_decompositions" not in report
    done = fuzz("--programs", "2", "--seed", "7")  # next to torch's own result
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout
    assert "run_decompositions({}) on the same valid programs:" in report
