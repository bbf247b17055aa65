"""Replaying a crash reproducer: load the folder a :class:`~.instruments.Reproducer` wrote
and run its failing pass again (``python -m pass_manager replay FOLDER``)."""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from .archive import _PICKLE_MODULE, load_program
from .errors import PassManagerError
from .instruments.base import Instrumentation
from .instruments.semantic_validation import SemanticValidation
from .pipeline_text import parse_passes
from .report import Report
from .running import Runner, default_instruments

__all__ = ["Reproduction", "load_reproducer", "replay"]


class _StoredValidation(SemanticValidation):
    """Semantic validation against the reference trace saved with the reproducer."""

    def __init__(self, saved: dict):
        super().__init__(saved["inputs"], saved["atol"], saved["rtol"], saved["state"])
        self._stored = saved["reference"]

    def before_run(self, program: Any, report: Report) -> None:
        self._reference = self._stored


@dataclass
class Reproduction:
    """A loaded reproducer folder: the program, the passes to run and how."""

    folder: Path
    manifest: dict
    program: Any
    passes: list[Any]
    instruments: list[Instrumentation] = field(default_factory=list)

    def run(self, extra: list[Instrumentation] = ()) -> Any:
        """Run the failing pass (or group) on the program as the failed run did."""
        m = self.manifest
        runner = Runner(
            self.passes, [*self.instruments, *extra], name=m["pass"],
            start=0 if m["group"] else m["index"], strict=m["strict"],
        )
        return runner.run(self.program)


def load_reproducer(folder: str | Path) -> Reproduction:
    """Load a reproducer folder (imports the modules that define its passes)."""
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    if not manifest["replayable"]:
        raise ValueError(f"{folder} cannot be replayed: {manifest['not_replayable_because']}")
    for module in manifest["modules"]:
        importlib.import_module(module)
    passes = parse_passes(manifest["pipeline"])
    program = load_program(folder / "program.pt")
    instruments = default_instruments(manifest["strict"])
    if manifest["validation"]:
        saved = torch.load(folder / "validation.pt", weights_only=False,
                           pickle_module=_PICKLE_MODULE)
        instruments.append(_StoredValidation(saved))
    return Reproduction(folder, manifest, program, passes, instruments)


def replay(
    folder: str | Path,
    *,
    pdb: bool = False,
    instruments: list[Instrumentation] = (),
    out: TextIO | None = None,
) -> int:
    """Run a reproducer's failing pass again; the exit status for the command line.

    1: the pass failed (the message says whether with the recorded error), 0: it no
    longer fails, 2: the folder cannot be replayed. With ``pdb``, the debugger starts
    post mortem at the exception the pass raised.
    """
    out = out or sys.stdout
    try:
        reproduction = load_reproducer(folder)
    except Exception as e:  # noqa: BLE001 - any failure to load is reported the same way
        print(f"error: cannot load the reproducer {folder}: {type(e).__name__}: {e}", file=out)
        return 2
    m = reproduction.manifest
    print(f"replaying {m['pass']} (pipeline {m['pipeline']}) on the saved {m['form']}", file=out)
    try:
        reproduction.run(list(instruments))
    except PassManagerError as e:
        kind = f"{type(e).__module__}.{type(e).__qualname__}"
        same = kind == m["error_type"] and str(e) == m["error_message"]
        verdict = "the recorded error" if same else "a different error than recorded"
        print(f"{type(e).__name__}: {e}", file=out)
        print(f"reproduced: {verdict}", file=out)
        if pdb:
            import pdb as debugger

            origin = e.__cause__ or e
            debugger.post_mortem(origin.__traceback__)
        return 1
    print(f"{m['pass']} no longer fails (recorded: {m['error_type']})", file=out)
    return 0
