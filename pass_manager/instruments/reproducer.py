"""Crash reproducers: a failing pass leaves a folder from which it can be run again.

``PassManager(..., reproducer_dir=PATH)`` adds a :class:`Reproducer` instrument. When a
pass fails (any PassManagerError), it writes a fresh folder under PATH holding:

* ``program.pt``: the program as the failing pass was given it (the rollback has already
  restored it), in either form, node meta included (``pass_manager.archive``);
  ``program.txt``: the same as readable text;
* ``manifest.json``: the pass, its place, the pipeline text that builds it with its
  options, the modules defining it, the error's type and message, the program form and
  how it was saved, what could not be saved, and library / torch / torchao versions;
* ``error.txt``: the error and the traceback of what the pass raised;
* ``validation.pt`` when ``validate=`` was given: the inputs, tolerances and the
  reference trace (what the program computed before the pipeline).

``python -m pass_manager replay FOLDER`` (:mod:`pass_manager.replay`) loads it and runs the
pass again, with the same checks: the same error type and message, exit status 1.
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

from ..archive import _PICKLE_MODULE, _PROTOCOL, save_program
from ..errors import PassManagerError
from ..pipeline_text import format_pass
from ..program import program_form, program_text
from ..report import PassRecord
from .base import Instrumentation
from .semantic_validation import SemanticValidation

__all__ = ["Reproducer"]

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


class Reproducer(Instrumentation):
    """Writes a reproducer folder under ``directory`` for every failing pass.

    The folder's path is set on the error as ``error.reproducer`` (and its message ends
    with it). Writing never hides the pass's error: a failure to write is a warning on the
    error (``error.reproducer_error``).

    Args:
        directory: where the folders go (created if missing).
        validation: the run's SemanticValidation, whose inputs and reference are saved.
        strict: the run's ``strict`` option (the replay checks claims the same way).
    """

    def __init__(
        self,
        directory: str | Path,
        validation: SemanticValidation | None = None,
        strict: bool = False,
    ):
        self.directory = Path(directory)
        self.validation = validation
        self.strict = strict

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
        dropped = save_program(program, folder / "program.pt")
        (folder / "program.txt").write_text(program_text(program))
        message = str(error)
        (folder / "error.txt").write_text(f"{type(error).__name__}: {message}\n\n{trace}")
        if self.validation is not None:
            v = self.validation
            state = v.state
            torch.save(
                {"inputs": v.inputs, "atol": v.atol, "rtol": v.rtol,
                 "reference": v._reference, "state": state},
                folder / "validation.pt", pickle_module=_PICKLE_MODULE, pickle_protocol=_PROTOCOL,
            )
        form = program_form(program)
        manifest = {
            "pass": record.name,
            "index": record.index,
            "iteration": record.iteration,
            "group": callable(getattr(pass_, "pipeline_text", None)),
            "pipeline": pipeline,
            "modules": modules,
            "replayable": not not_replayable,
            "not_replayable_because": not_replayable,
            "strict": self.strict,
            "error_type": f"{type(error).__module__}.{type(error).__qualname__}",
            "error_message": message,
            "form": form,
            "saved_as": (
                f"program.pt: the {form} pickled by torch.save with pass_manager.archive "
                "(graph as node records with their meta, tensor data as torch.save "
                "storages); load with pass_manager.archive.load_program"
            ),
            "not_saved": dropped,
            "not_restored_before_saving": list(error.unrestored),
            "validation": self.validation is not None,
            "versions": _versions(),
            "replay": f"python -m pass_manager replay {folder}",
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return folder
