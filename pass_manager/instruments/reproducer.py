"""Crash reproducers: a failing pass leaves a folder from which ``python -m pass_manager
replay FOLDER`` (:mod:`pass_manager.replay`) runs it again.

The folder holds the program the pass was given (``program.pt2`` with ``program.state.pt``,
or a pickled ``program.pt``: :mod:`pass_manager.archive`), ``program.txt``, ``error.txt``,
``validation.pt`` when given the run's SemanticValidation, and ``manifest.json`` (the pass,
its pipeline text and modules, the error, each file's format, what needs trust). A folder
is made to be shared: docs/debugging.md says what a replay reads without trust.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shlex
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from torch._library.custom_ops import OPDEFS

from .._untrusted import library_module
from ..archive import PICKLED, save_data, save_program
from ..errors import PassManagerError
from ..pipeline_text import format_pass
from ..program import graph_modules, program_form, program_text
from ..report import PassRecord, Report
from .base import Instrumentation
from .semantic_validation import SemanticValidation

__all__ = ["REPRODUCER_FORMAT", "Reproducer"]

# The manifest's layout; a replay refuses a folder of a later one by name (a renamed key
# would otherwise be a bare KeyError). Manifests written before it had no "format": 1.
REPRODUCER_FORMAT = 1


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_root(module: str) -> str | None:
    """The ``sys.path`` entry ``module`` was imported from, if it is a file outside this
    library (a trusted replay puts it on ``sys.path``)."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if library_module(module) or not file:
        return None
    path = Path(file).resolve().with_suffix("")  # root/a/b/c for a.b.c, root/a/__init__ for a
    parts = tuple(module.split(".")) + (("__init__",) if path.name == "__init__" else ())
    return str(path.parents[len(parts) - 1]) if path.parts[-len(parts):] == parts else None


def _operator_modules(program: Any) -> set[str]:
    """The modules outside torch defining the operators (``torch.library.custom_op``) the
    program calls: a replay imports them before it loads the program."""
    defined = [OPDEFS.get(getattr(n.target, "_name", None))
               for _, m in graph_modules(program) for n in m.graph.nodes]
    return {d._init_fn.__module__ for d in defined
            if d is not None and not d._init_fn.__module__.startswith("torch.")}


class Reproducer(Instrumentation):
    """Writes a reproducer folder under ``directory`` for every failing pass.

    The folder's path is set on the error as ``error.reproducer`` (its message ends with
    it). Writing never hides the pass's error: a failure to write is a warning on the
    error (``error.reproducer_error``). The replay checks the pass as the run did (its
    ``strict`` option).

    Args:
        directory: where the folders go (created if missing).
        validation: the run's SemanticValidation (also in ``instruments``), whose inputs
            and reference are saved so that the replay validates the same way.

    Example:
        >>> checked = SemanticValidation((x, pos))
        >>> PassManager(passes, instruments=[checked, Reproducer("repro", checked)]).run(ep)
    """

    def __init__(self, directory: str | Path, validation: SemanticValidation | None = None):
        if validation is not None and not isinstance(validation, SemanticValidation):
            raise TypeError(f"Reproducer(validation={validation!r}): give the run's "
                            "SemanticValidation instrument, or nothing")
        self.directory = Path(directory)
        self.validation = validation
        self.strict = False

    def before_run(self, program: Any, report: Report) -> None:
        self.strict = report.strict

    def after_pass_failed(
        self, pass_: Any, program: Any, record: PassRecord, error: PassManagerError
    ) -> None:
        trace = traceback.format_exc()  # inside the runner's ``except``: the pass's own
        if getattr(error, "reproducer", None) is not None:
            return  # a nested pipeline already wrote one for the pass that failed in it
        try:
            error.reproducer = self._write(pass_, program, record, error, trace)
        except Exception as e:  # noqa: BLE001 - the pass's error must reach the caller
            error.reproducer_error = f"{type(e).__name__}: {e}"

    def _write(
        self, pass_: Any, program: Any, record: PassRecord, error: PassManagerError, trace: str
    ) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() else "_" for c in record.name)[:40]
        folder = Path(tempfile.mkdtemp(prefix=f"{record.index}-{safe}-", dir=self.directory))
        group = callable(getattr(pass_, "pipeline_text", None))
        modules = sorted({type(p).__module__ for p in (pass_.plan() if group else [pass_])}
                         | _operator_modules(program))
        try:
            pipeline = pass_.pipeline_text() if group else format_pass(pass_)
            not_replayable = ("a pass or an operator the program calls is defined in __main__, "
                              "which a replay cannot import" if "__main__" in modules else "")
        except PassManagerError as e:
            pipeline, modules, not_replayable = None, [], str(e)
        saved = save_program(program, folder / "program.pt2")
        program_file = saved.path
        if saved.needs_trust:  # a pickle, not a torch.export archive: not named as one
            program_file = saved.path.rename(folder / "program.pt")
        (folder / "program.txt").write_text(program_text(program))
        (folder / "error.txt").write_text(f"{type(error).__name__}: {error}\n\n{trace}")
        validation_format = None
        if self.validation is not None:
            validation_format = save_data(self.validation.saved(), folder / "validation.pt")
        trust = [f"program.pt is pickled: {saved.pickled_because}"] if saved.needs_trust else []
        if validation_format == PICKLED:
            trust.append("validation.pt is pickled: its inputs or reference are not plain data")
        if outside := [m for m in modules if not library_module(m)]:
            trust.append("the passes or the operators the program calls are defined outside "
                         f"this library's packages: {outside}")
        manifest = {
            "format": REPRODUCER_FORMAT,
            "pass": record.name,
            "index": record.index,
            "group": group,
            "pipeline": pipeline,
            "modules": modules,
            "import_paths": sorted({r for m in modules if (r := _import_root(m)) is not None}),
            "replayable": not not_replayable,
            "not_replayable_because": not_replayable,
            "strict": self.strict,
            "error_type": f"{type(error).__module__}.{type(error).__qualname__}",
            "error_message": str(error),
            "form": program_form(program),
            "program_file": program_file.name,
            "program_format": saved.format,
            "pickled_because": saved.pickled_because,
            "not_saved": saved.dropped,
            "not_restored_before_saving": list(error.unrestored),
            "validation": self.validation is not None,
            "validation_format": validation_format,
            "needs_trust": trust,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "torchao": _version("torchao"),
                         "mutable-buffer-passes": _version("mutable-buffer-passes")},
            # Quoted for a shell: pasted as printed, a folder with a space in its path
            # was two arguments.
            "replay": shlex.join(["python", "-m", "pass_manager", "replay", str(folder),
                                  *(["--trust"] if trust else [])]),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return folder
