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


# The public names of the design's contract (DESIGN.md, "Public API" and the rounds after it),
# one import statement each as the design writes it.
PUBLIC_API = """
from pass_manager import PassManager, Pass, Condition, PassResult
from pass_manager import (PassManagerError, PipelineError, PreconditionError,
                          PostconditionError, PassFailedError, SemanticsError)
from passes import (MarkMutableBuffers, InplaceToFunctional, SkipAnnotateDataMovementOps,
                    UnfreezeMutableBuffer, ConsumeBufferMutationsInDelegate)
from passes import conditions
from passes import mutable_buffers, reset_mutable_buffers
from passes.quantization import PassQuantizer
from passes.delegation import to_delegate, AllNodePartitioner, OpSupportPartitioner, delegates
from pass_manager import parse_pipeline
from passes.executorch import BufferOwningPartitioner
from passes import QuantizeMutableBuffers
from passes import exported_program_from
from passes.quantization import quantize_program, quantize_methods
from passes.executorch import run_methods_on_runtime
from passes import InputsToBuffers, BuffersToInputs
"""


def test_every_public_name_of_the_design_is_importable():
    exec(compile(PUBLIC_API, "DESIGN.md Public API", "exec"), {})
    assert importlib.import_module("passes.examples").__all__


def _layout_folders(readme: str) -> set[str]:
    """The folders the README's Layout block lists, as paths (``pass_manager/instruments``)."""
    section = readme[readme.index("## Layout\n"):]
    block = FENCE.search(section).group(2)
    folders, parent = set(), ""
    for line in block.splitlines():
        entry = line.split()[0] if line.strip() else ""
        if not entry.endswith("/"):
            continue
        if line.startswith(" "):
            folders.add(parent + entry.rstrip("/"))
        else:
            parent = entry
            folders.add(entry.rstrip("/"))
    return folders


def test_the_readme_layout_names_every_package_folder():
    packages = {
        path.parent.relative_to(ROOT).as_posix()
        for top in ("pass_manager", "passes")
        for path in (ROOT / top).rglob("__init__.py")
    }
    listed = _layout_folders((ROOT / "README.md").read_text())
    assert packages - listed == set(), "package folders missing from the README's Layout"
    assert {p for p in listed if p.split("/")[0] in ("pass_manager", "passes")} <= packages
