"""Replaying a crash reproducer: load the folder a :class:`~.instruments.Reproducer` wrote and
run its failing pass again (``python -m pass_manager replay FOLDER [--trust] [--pdb]``).

Without ``trusted=True`` (``--trust``) no code from the folder runs: files are read only
in their safe formats and only this library's modules are imported, as the files
themselves say (never what the manifest claims); any refusal is an UntrustedFileError.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._untrusted import LIBRARY_PACKAGES, library_module
from .archive import load_data, load_program
from .errors import ArchiveError, PassManagerError, PipelineError, UntrustedFileError
from .instruments.base import Instrumentation
from .instruments.print_ir import PrintIR
from .instruments.reproducer import REPRODUCER_FORMAT
from .instruments.semantic_validation import SemanticValidation
from .pipeline_text import parse_passes
from .running import Runner, default_instruments

__all__ = ["Reproduction", "load_reproducer", "main", "replay"]


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
        runner = Runner(self.passes, [*self.instruments, *extra], name=m["pass"],
                        start=0 if m["group"] else m["index"], strict=m["strict"])
        return runner.run(self.program)


def _check_modules(modules: list[Any], where: Path, what: str) -> None:
    """Refuse (untrusted) to import a module outside this library: importing runs it."""
    outside = [m for m in modules if not (isinstance(m, str) and library_module(m))]
    if outside:
        raise UntrustedFileError(
            where, what,
            f"it names modules outside this library's packages ({', '.join(LIBRARY_PACKAGES)}): "
            f"{outside}, and importing a module runs its code",
        )


# The keys a replay reads from every manifest (the rest is for the reader, or optional),
# each with the type a Reproducer writes; "pipeline" is None in a manifest saying the pass
# cannot be replayed.
_MANIFEST_TYPES = {"pass": str, "index": int, "group": bool, "pipeline": str, "modules": list,
                   "replayable": bool, "not_replayable_because": str, "strict": bool,
                   "error_type": str, "error_message": str, "form": str, "validation": bool}
_TYPE_NAMES = {str: "a string", int: "an int", bool: "true or false", list: "a list"}


def _read_manifest(folder: Path) -> dict:
    """The folder's manifest, of a format this library reads; ArchiveError naming what the
    folder is otherwise (none, a file, no manifest, a newer format, keys missing)."""
    if not folder.exists():
        raise ArchiveError(folder, "no such folder")
    if not folder.is_dir():
        raise ArchiveError(folder, "a file, not a folder a Reproducer wrote")
    manifest_file = folder / "manifest.json"
    if not manifest_file.is_file():  # maybe the --reproducer-dir the folders are written in
        inside = sorted(str(m.parent) for m in folder.glob("*/manifest.json"))
        raise ArchiveError(folder, "it has no manifest.json: not a folder a Reproducer wrote"
                           + (f"; it holds reproducers: {', '.join(inside)}" if inside else ""))
    try:
        manifest = json.loads(manifest_file.read_text())
    except ValueError as e:
        raise ArchiveError(manifest_file, f"manifest.json is not JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise ArchiveError(manifest_file, "it is not a reproducer manifest (a JSON object)")
    found = manifest.get("format", 1)
    if not isinstance(found, int) or found > REPRODUCER_FORMAT:
        versions = manifest.get("versions")
        wrote = versions.get("mutable-buffer-passes") if isinstance(versions, dict) else None
        raise ArchiveError(manifest_file, (
            f"it is reproducer format {found}, written by mutable-buffer-passes "
            f"{wrote or '(version unknown)'}; this version reads formats up to "
            f"{REPRODUCER_FORMAT}: replay it with the version that wrote it, or a newer one"))
    missing = [key for key in _MANIFEST_TYPES if key not in manifest]
    if missing:
        raise ArchiveError(manifest_file, (
            f"it lacks {', '.join(map(repr, missing))}: not a whole reproducer manifest "
            "(damaged, or not written by a Reproducer)"))
    wrong = _wrong_values(manifest)
    if wrong:
        raise ArchiveError(manifest_file, (
            f"its {'; '.join(wrong)}: not a manifest a Reproducer wrote (damaged, or edited)"))
    return manifest


def _wrong_values(manifest: dict) -> list[str]:
    """The manifest's values a replay would misread (an index given as text, a module list
    as one string), each as "'key' is <what>, not <what a Reproducer writes>"."""
    wrong = []
    for key, kind in _MANIFEST_TYPES.items():
        value = manifest[key]
        if key == "pipeline" and value is None and manifest["replayable"] is False:
            continue
        if type(value) is not kind:  # exactly: a bool is no index
            wrong.append(f"{key!r} is {value!r}, not {_TYPE_NAMES[kind]}")
    if type(manifest["index"]) is int and manifest["index"] < 0:
        wrong.append(f"'index' is {manifest['index']}, not a place in a pipeline (0 or more)")
    for key, what in (("modules", "module names"), ("import_paths", "folders")):
        value = manifest.get(key, [])  # import_paths: optional, read only when trusted
        if (type(value) is list and not all(isinstance(v, str) for v in value)) or (
                key not in _MANIFEST_TYPES and type(value) is not list):
            wrong.append(f"{key!r} is {value!r}, not a list of {what}")
    if manifest["replayable"] is True and isinstance(manifest["pipeline"], str) \
            and not manifest["pipeline"].strip():
        wrong.append("'pipeline' is empty, not the failing pass as pipeline text")
    return wrong


def load_reproducer(folder: str | Path, *, trusted: bool = False) -> Reproduction:
    """Load a reproducer folder (imports the modules that define its passes).

    Args:
        folder: a folder a :class:`~.instruments.Reproducer` wrote.
        trusted: also read pickled files and import modules outside this library's
            packages (from the folders the manifest's ``import_paths`` names, put first on
            ``sys.path``): runs code from the folder.

    Raises:
        UntrustedFileError: without ``trusted``, a file is pickled or names a module
            outside ``pass_manager`` / ``passes``; the message says which.
        ArchiveError: the folder is missing or is no reproducer, a file is damaged or was
            not written by a Reproducer, the manifest is of a newer format than this
            library reads, or the Reproducer recorded that the pass cannot be rebuilt
            (e.g. a lambda).
    """
    folder = Path(folder)
    manifest_file = folder / "manifest.json"
    manifest = _read_manifest(folder)
    if not manifest["replayable"]:
        because = manifest["not_replayable_because"]
        raise ArchiveError(folder, because, f"{folder} cannot be replayed: {because}; its "
                           "program files and program.txt still show the program the pass met")
    if not trusted:  # all, before importing any
        _check_modules(manifest["modules"], manifest_file, "module list")
    # Only trusted: an untrusted manifest must not put its folders before the library's.
    for root in reversed(manifest.get("import_paths", []) if trusted else []):
        if isinstance(root, str) and Path(root).is_dir() and root not in sys.path:
            sys.path.insert(0, root)
    try:  # a module gone, or a pipeline edited: the folder names no pass this can build
        for module in manifest["modules"]:
            importlib.import_module(module)
        passes = parse_passes(manifest["pipeline"])
    except (ImportError, PipelineError) as e:
        raise ArchiveError(manifest_file, f"its pass cannot be rebuilt: {type(e).__name__}: "
                           f"{e}") from e
    if not manifest["group"] and len(passes) != 1:  # "A,A" replayed the pass twice
        raise ArchiveError(manifest_file, (
            f"its 'pipeline' holds {len(passes)} passes but 'group' is false: a Reproducer "
            "writes the one pass that failed (damaged, or edited)"))
    program_file = folder / "program.pt2"
    if not program_file.exists():
        program_file = folder / "program.pt"  # pickled
    if not program_file.exists():
        named = manifest.get("program_file")
        raise ArchiveError(folder / (named if isinstance(named, str) else "program.pt2"),
                           "it is missing: a reproducer folder holds the program the pass "
                           "met (program.pt2, or program.pt when pickled)")
    program = load_program(program_file, trusted=trusted)
    instruments = default_instruments(manifest["strict"])
    if manifest["validation"]:
        validation_file = folder / "validation.pt"
        saved = load_data(validation_file, trusted=trusted)
        state = saved["state"]
        if isinstance(state, str):  # "module:qualname"
            if not trusted:
                _check_modules([state.partition(":")[0]], validation_file, "state reader name")
            state = pkgutil.resolve_name(state)
        instruments.append(SemanticValidation.from_saved(saved, state))
    return Reproduction(folder, manifest, program, passes, instruments)


def replay(
    folder: str | Path,
    *,
    trusted: bool = False,
    pdb: bool = False,
    instruments: list[Instrumentation] = (),
) -> int:
    """Run a reproducer's failing pass again (loaded as :func:`load_reproducer` does) and
    return the command line's exit status: 1 the pass failed (the message says whether
    with the recorded error), 0 it no longer fails, 2 the folder cannot be replayed (the
    message says why). With ``pdb``, the debugger starts where the pass raised."""
    try:
        reproduction = load_reproducer(folder, trusted=trusted)
    except ArchiveError as e:  # names the folder or file, and what it is not
        print(f"error: cannot replay: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - any failure to load is reported the same way
        print(f"error: cannot load the reproducer {folder}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    m = reproduction.manifest
    print(f"replaying {m['pass']} (pipeline {m['pipeline']}) on the saved {m['form']}")
    try:
        reproduction.run(list(instruments))
    except PassManagerError as e:
        same = (f"{type(e).__module__}.{type(e).__qualname__}" == m["error_type"]
                and str(e) == m["error_message"])
        print(f"{type(e).__name__}: {e}")
        print(f"reproduced: {'the recorded error' if same else 'a different error than recorded'}")
        if pdb:
            import pdb as debugger

            debugger.post_mortem((e.__cause__ or e).__traceback__)
        return 1
    print(f"{m['pass']} no longer fails (recorded: {m['error_type']})")
    return 0


REPLAY_STATUSES = """exit status:
  0  the pass no longer fails
  1  the pass failed again (the last line says whether with the recorded error)
  2  the folder cannot be replayed (one line says why: no reproducer, damaged, not trusted)"""


def main(argv: list[str] | None = None) -> int:
    """``python -m pass_manager replay FOLDER [--trust] [--pdb] [--print-before]
    [--print-after-failure]``."""
    parser = argparse.ArgumentParser(prog="python -m pass_manager")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser(
        "replay", help="rerun the failing pass of a reproducer",
        description="Rerun the failing pass of a reproducer folder on the program it met.",
        epilog=REPLAY_STATUSES, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("folder", help="a folder written by a Reproducer")
    command.add_argument("--trust", action="store_true",
                         help="read pickled files and import the modules the folder names "
                              "(runs code from the folder: only for a folder you trust)")
    command.add_argument("--pdb", action="store_true",
                         help="start the debugger at the exception the pass raised")
    command.add_argument("--print-before", action="store_true",
                         help="print the program the pass is given")
    command.add_argument("--print-after-failure", action="store_true",
                         help="print what the pass changed before it failed")
    args = parser.parse_args(argv)
    printing = PrintIR(before=args.print_before, after_failure=args.print_after_failure)
    return replay(args.folder, trusted=args.trust, pdb=args.pdb, instruments=[printing])
