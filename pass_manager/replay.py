"""Replaying a crash reproducer: load the folder a :class:`~.instruments.Reproducer` wrote
and run its failing pass again (``python -m pass_manager replay FOLDER [--trust]``).

Loading a folder from someone else runs none of their code unless you say you trust it
(``trusted=True``, ``--trust``): without, the program and validation files are read only
in their safe formats (``exported``, ``plain``: no code from the file runs), only modules
of this library's packages (``pass_manager``, ``passes``) are imported, and only a state
reader defined there is used; anything else is an
:class:`~pass_manager.errors.UntrustedFileError` naming the file and why. The checks read
the files themselves, not what the manifest claims about them.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .archive import load_data, load_program
from .errors import ArchiveError, PassManagerError, UntrustedFileError
from .instruments.base import Instrumentation
from .instruments.reproducer import LIBRARY_PACKAGES, library_module
from .instruments.semantic_validation import SemanticValidation
from .pipeline_text import parse_passes
from .report import Report
from .running import Runner, default_instruments
from .validation import Trace

__all__ = ["Reproduction", "load_reproducer", "replay"]


class _StoredValidation(SemanticValidation):
    """Semantic validation against the reference trace saved with the reproducer."""

    def __init__(self, saved: dict, state: Any):
        super().__init__(saved["inputs"], atol=saved["atol"], rtol=saved["rtol"], state=state)
        reference = saved["reference"]
        self._stored = Trace(**reference) if isinstance(reference, dict) else reference

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


def _check_modules(modules: list[Any], where: Path, trusted: bool,
                   what: str = "module list") -> None:
    outside = [m for m in modules if not (isinstance(m, str) and library_module(m))]
    if outside and not trusted:
        raise UntrustedFileError(
            where, what,
            f"it names modules outside this library's packages ({', '.join(LIBRARY_PACKAGES)}): "
            f"{outside}, and importing a module runs its code",
        )


def _state_reader(state: Any, where: Path, trusted: bool) -> Any:
    """The saved state reader: ``"module:qualname"`` imported, or the pickled function."""
    if not isinstance(state, str):
        return state
    module, _, qualname = state.partition(":")
    _check_modules([module], where, trusted, "state reader name")
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def load_reproducer(folder: str | Path, *, trusted: bool = False) -> Reproduction:
    """Load a reproducer folder (imports the modules that define its passes).

    Args:
        folder: a folder a :class:`~.instruments.Reproducer` wrote.
        trusted: also read pickled files and import modules outside this library's
            packages (from the folders the manifest's ``import_paths`` names, put first on
            ``sys.path``), which runs code from the folder: only for a folder you made or
            whose author you trust.

    Raises:
        UntrustedFileError: without ``trusted``, a file is pickled or the manifest names a
            module outside ``pass_manager`` / ``passes``; the message says which.
        ArchiveError: a file is damaged or was not written by a Reproducer, or the
            Reproducer recorded that the pass cannot be rebuilt (e.g. a lambda): the
            message says why.
    """
    folder = Path(folder)
    manifest_file = folder / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    if not isinstance(manifest, dict):
        raise ArchiveError(manifest_file, "it is not a reproducer manifest (a JSON object)")
    if not manifest["replayable"]:
        because = manifest["not_replayable_because"]
        raise ArchiveError(folder, because, f"{folder} cannot be replayed: {because}; its "
                           "program files and program.txt still show the program the pass met")
    _check_modules(manifest["modules"], manifest_file, trusted)  # all, before importing any
    # The folders of the user's own passes, only with trust: an untrusted manifest must
    # not put a folder of its choosing before this library's packages on sys.path.
    for root in reversed(manifest.get("import_paths", []) if trusted else []):
        if isinstance(root, str) and Path(root).is_dir() and root not in sys.path:
            sys.path.insert(0, root)
    for module in manifest["modules"]:
        importlib.import_module(module)
    passes = parse_passes(manifest["pipeline"])
    program_file = folder / "program.pt2"
    if not program_file.exists():
        program_file = folder / "program.pt"  # pickled
    program = load_program(program_file, trusted=trusted)
    instruments = default_instruments(manifest["strict"])
    if manifest["validation"]:
        validation_file = folder / "validation.pt"
        saved = load_data(validation_file, trusted=trusted)
        state = _state_reader(saved["state"], validation_file, trusted)
        instruments.append(_StoredValidation(saved, state))
    return Reproduction(folder, manifest, program, passes, instruments)


def replay(
    folder: str | Path,
    *,
    trusted: bool = False,
    pdb: bool = False,
    instruments: list[Instrumentation] = (),
    out: TextIO | None = None,
) -> int:
    """Run a reproducer's failing pass again; the exit status for the command line.

    1: the pass failed (the message says whether with the recorded error), 0: it no
    longer fails, 2: the folder cannot be replayed (among others: it needs ``trusted``,
    and the message says why). With ``trusted``, the folder is loaded as
    :func:`load_reproducer` does with ``trusted=True``. With ``pdb``, the debugger starts
    post mortem at the exception the pass raised.
    """
    out = out or sys.stdout
    try:
        reproduction = load_reproducer(folder, trusted=trusted)
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
