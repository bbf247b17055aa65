"""Crash reproducers: a failing pass leaves a folder from which it can be run again.

``PassManager(..., instruments=[Reproducer(PATH)])``: When a
pass fails (any PassManagerError), it writes a fresh folder under PATH holding:

* ``program.pt2`` and ``program.state.pt``: the program as the failing pass was given it
  (the rollback has already restored it), saved by :func:`~pass_manager.archive.save_program`.
  An ExportedProgram is its ``torch.export.save`` archive (tensors as stand-ins) and a
  file of plain data (its tensors, and the node meta torch.export does not keep: the
  passes' marks), which load without running code from the folder; a node meta entry
  that is not plain data (torch's ``original_aten``, an observer) is left out and listed
  in the manifest's ``not_saved``. A GraphModule, or an ExportedProgram torch.export.save
  cannot hold (a delegate call, a tensor subclass in its state), is ``program.pt``, a
  pickle with all of its meta, and loading a pickle runs the code it names;
* ``program.txt``: the same program as readable text;
* ``manifest.json``: the pass, its place, the pipeline text that builds it with its
  options, the modules defining its passes and the folders they were imported from
  (``import_paths``: a trusted replay puts them on ``sys.path``, so a pass of your project
  replays without setting ``PYTHONPATH``), the error's type and message, the program
  form, the format of each file and why, what could not be saved, what a replay needs
  trust for (``needs_trust``), and library / torch / torchao versions;
* ``error.txt``: the error and the traceback of what the pass raised;
* ``validation.pt`` when given the run's SemanticValidation: the inputs, tolerances, the reference
  trace (what the program computed before the pipeline) and the name of the state
  reader, as plain data when they are (``plain`` format, loads with
  ``weights_only=True``), else ``pickled``.

``python -m pass_manager replay FOLDER`` (:mod:`pass_manager.replay`) loads it and runs the
pass again, with the same checks: the same error type and message, exit status 1.

A folder is made to be shared (attached to a bug report), so reading one from someone
else must not run their code. The replay reads ``exported`` and ``plain`` files and
imports the modules of this library's own packages (``pass_manager``, ``passes``) with
no further ado; a ``pickled`` file, or a manifest naming any other module (a pass defined
in your project or your tests), it reads only with ``--trust`` (``trusted=True``), and
otherwise refuses with an :class:`~pass_manager.errors.UntrustedFileError` saying which
file and why. A program read without trust is checked to call only torch operators, so
running it (the replay's validation does) runs no function the folder chose. The
manifest's ``needs_trust`` tells you in advance what needs trust, but the replay never
believes it: it checks the files themselves.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from ..archive import PICKLED, save_data, save_program
from ..errors import PassManagerError
from ..pipeline_text import format_pass
from ..program import program_form, program_text
from ..report import PassRecord, Report
from .base import Instrumentation
from .semantic_validation import SemanticValidation

__all__ = ["LIBRARY_PACKAGES", "Reproducer", "library_module"]

_VERSIONS = ("mutable-buffer-passes", "torch", "torchao")


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["torch"] = torch.__version__
    return found


def _pipeline_of(pass_: Any) -> tuple[str | None, list[str], str]:
    """(pipeline text, modules to import, why it cannot be replayed or "")."""
    group = callable(getattr(pass_, "pipeline_text", None))
    passes = pass_.plan() if group else [pass_]
    try:
        text = pass_.pipeline_text() if group else format_pass(pass_)
    except PassManagerError as e:
        return None, [], str(e)
    modules = sorted({type(p).__module__ for p in passes})
    if "__main__" in modules:
        return text, modules, "a pass is defined in __main__, which a replay cannot import"
    return text, modules, ""


# The packages of this distribution (setup.cfg): a replay imports their modules untrusted.
LIBRARY_PACKAGES = ("pass_manager", "passes")


def library_module(name: str) -> bool:
    """Whether ``name`` is a module of this library's own packages."""
    return any(name == package or name.startswith(f"{package}.") for package in LIBRARY_PACKAGES)


def import_root(module: str) -> str | None:
    """The folder ``module`` was imported from (the ``sys.path`` entry holding it), if it
    is a file of a folder outside this library; a replay puts it on ``sys.path``."""
    if library_module(module):
        return None
    file = getattr(sys.modules.get(module), "__file__", None)
    if not file:
        return None
    path, parts = Path(file).resolve(), module.split(".")
    depth = len(parts) if path.name == "__init__.py" else len(parts) - 1
    if depth >= len(path.parents):
        return None
    root = path.parents[depth]
    inside = path.relative_to(root).with_suffix("").parts
    return str(root) if list(inside[: len(parts)]) == parts else None


def _qualified_name(function: Any) -> str | None:
    """``module:qualname`` of a function a replay can import, else None."""
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def _validation_record(v: SemanticValidation) -> dict[str, Any]:
    """The validation's inputs, tolerances, reference and state reader: plain data when
    the state reader has an importable name (a lambda stays a function, so is pickled)."""
    reference = v._reference
    state = v.state if v.state is None else (_qualified_name(v.state) or v.state)
    return {
        "inputs": v.inputs, "atol": v.atol, "rtol": v.rtol, "state": state,
        "reference": None if reference is None else {
            "outputs": reference.outputs, "buffers": reference.buffers,
            "inputs": reference.inputs},
    }


def _needs_trust(program_pickled_because: str, validation_format: str | None,
                 modules: list[str]) -> list[str]:
    reasons = []
    if program_pickled_because:
        reasons.append(f"program.pt is pickled: {program_pickled_because}")
    if validation_format == PICKLED:
        reasons.append("validation.pt is pickled: its inputs or reference are not plain data")
    outside = [m for m in modules if not library_module(m)]
    if outside:
        reasons.append(f"the passes are defined outside this library's packages: {outside}")
    return reasons


class Reproducer(Instrumentation):
    """Writes a reproducer folder under ``directory`` for every failing pass.

    The folder's path is set on the error as ``error.reproducer`` (and its message ends
    with it). Writing never hides the pass's error: a failure to write is a warning on the
    error (``error.reproducer_error``).

    Args:
        directory: where the folders go (created if missing).
        validation: the run's SemanticValidation (also in ``instruments``), whose inputs
            and reference are saved so that the replay validates the same way.

    The replay checks the pass as the run did (its ``strict`` option, from the report).

    Example:
        >>> checked = SemanticValidation((x, pos))
        >>> PassManager(passes, instruments=[checked, Reproducer("repro", checked)]).run(ep)
    """

    def __init__(self, directory: str | Path, validation: SemanticValidation | None = None):
        self.directory = Path(directory)
        self.validation = validation
        self.strict = False

    def before_run(self, program: Any, report: Report) -> None:
        self.strict = report.strict

    def after_pass_failed(
        self, pass_: Any, program: Any, record: PassRecord, error: PassManagerError
    ) -> None:
        # Called inside the runner's ``except``: the traceback is the pass's own.
        trace = traceback.format_exc()
        if getattr(error, "reproducer", None) is not None:
            return  # a nested pipeline already wrote one for the pass that failed in it
        try:
            folder = self._write(pass_, program, record, error, trace)
        except Exception as e:  # noqa: BLE001 - the pass's error must reach the caller
            error.reproducer_error = f"{type(e).__name__}: {e}"
            return
        error.reproducer = folder

    def _write(
        self, pass_: Any, program: Any, record: PassRecord, error: PassManagerError, trace: str
    ) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() else "_" for c in record.name)[:40]
        folder = Path(tempfile.mkdtemp(prefix=f"{record.index}-{safe}-", dir=self.directory))
        pipeline, modules, not_replayable = _pipeline_of(pass_)
        saved = save_program(program, folder / "program.pt2")
        program_file = saved.path
        if saved.needs_trust:  # a pickle, not a torch.export archive: not named as one
            program_file = saved.path.rename(folder / "program.pt")
        (folder / "program.txt").write_text(program_text(program))
        message = str(error)
        (folder / "error.txt").write_text(f"{type(error).__name__}: {message}\n\n{trace}")
        validation_format = None
        if self.validation is not None:
            validation_format = save_data(_validation_record(self.validation),
                                          folder / "validation.pt")
        trust = _needs_trust(saved.pickled_because, validation_format, modules)
        # The user's own passes: the replay (trusted) imports them from where they came from.
        import_paths = sorted({root for m in modules if (root := import_root(m)) is not None})
        form = program_form(program)
        manifest = {
            "pass": record.name,
            "index": record.index,
            "group": callable(getattr(pass_, "pipeline_text", None)),
            "pipeline": pipeline,
            "modules": modules,
            "import_paths": import_paths,
            "replayable": not not_replayable,
            "not_replayable_because": not_replayable,
            "strict": self.strict,
            "error_type": f"{type(error).__module__}.{type(error).__qualname__}",
            "error_message": message,
            "form": form,
            "program_file": program_file.name,
            "program_format": saved.format,
            "pickled_because": saved.pickled_because,
            "not_saved": saved.dropped,
            "not_restored_before_saving": list(error.unrestored),
            "validation": self.validation is not None,
            "validation_format": validation_format,
            "needs_trust": trust,
            "versions": _versions(),
            "replay": f"python -m pass_manager replay {folder}" + (" --trust" if trust else ""),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return folder
