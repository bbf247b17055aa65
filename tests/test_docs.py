"""Every code block of the README and the guides runs as written, each in a fresh interpreter.

A ``python`` block is one program: a user copies it into a file and runs it, so it may not
lean on a block before it. A ``sh`` block's ``python -m ...`` lines run too (``make`` and
``pip`` lines are the set-up the suite itself runs under). Blocks run from an empty folder
with the checkout first on the path: what a user outside the repository gets.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(kind: str) -> list[tuple[str, int, str]]:
    found = []
    for document in DOCUMENTS:
        runs = [code for lang, code in FENCE.findall(document.read_text()) if lang == kind]
        found += [(document.relative_to(ROOT).as_posix(), i, code) for i, code in enumerate(runs)]
    return found


def commands() -> list[tuple[str, int, list[str]]]:
    found = []
    for name, index, code in blocks("sh"):
        joined = code.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("python -m "):
                argv = shlex.split(line)
                # A redirection is the shell's business: the command's output is checked here.
                found.append((name, index, argv[:argv.index(">")] if ">" in argv else argv))
    return found


def run(argv: list[str], tmp_path: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_document_has_runnable_blocks():
    documented = {name for name, _, _ in blocks("python")}
    assert "README.md" in documented
    assert len(blocks("python")) >= 6 and commands()
    # Every other fenced block says what it is: python, sh or text.
    for document in DOCUMENTS:
        kinds = {lang for lang, _ in FENCE.findall(document.read_text())}
        assert kinds <= {"python", "sh", "text"}, (document.name, kinds)


@pytest.mark.parametrize(("document", "index", "code"), blocks("python"),
                         ids=[f"{n}-{i}" for n, i, _ in blocks("python")])
def test_python_block_runs_as_written(document, index, code, tmp_path):
    done = run([sys.executable, "-c", code], tmp_path)
    assert done.returncode == 0, (
        f"{document} python block {index} failed:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}")


@pytest.mark.parametrize(("document", "index", "argv"), commands(),
                         ids=[f"{n}-{i}-{a[2]}" for n, i, a in commands()])
def test_command_runs_as_written(document, index, argv, tmp_path):
    done = run([sys.executable, *argv[1:]], tmp_path)
    assert done.returncode == 0, (
        f"{document} sh block {index}: {shlex.join(argv)} exited {done.returncode}\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def test_every_public_error_type_has_a_row_in_the_errors_guide():
    guide = (ROOT / "docs" / "errors.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", guide, flags=re.M))
    public = set()
    for package in ("pass_manager", "passes", "passes.delegation", "passes.executorch"):
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, BaseException):
                public.add(name)
    assert public - rows == set(), "error types without a row in docs/errors.md"
    assert rows - public == set(), "rows in docs/errors.md naming no public error type"
