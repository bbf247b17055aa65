"""Runs the main job (``python -m passes run``) as a user does: a subprocess from the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "run_main"]

ROOT = Path(__file__).resolve().parents[3]


def run_main(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m passes run ARGS``, in Python only unless ARGS ask for ``--runtime``: the
    default (ExecuTorch's runtime when installed) lowers every program, tens of seconds each."""
    return subprocess.run(
        [sys.executable, "-m", "passes", "run", "--runtime", "python", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
