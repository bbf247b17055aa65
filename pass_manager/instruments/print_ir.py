"""PrintIR: the program before / after chosen passes, after a change or a failure (MLIR's
IR printing), to a stream or one numbered file per dump in a folder. After a failure the
pass is already rolled back: the dump shows the error, the diff of what the pass had
changed, and the program as the pass was given it. PrintDiff: a unified diff of the program
after every pass that changed it."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from ..errors import PassManagerError
from ..program import pass_diff, program_text
from ..report import PassRecord, Report
from .base import Instrumentation

__all__ = ["PrintDiff", "PrintIR"]

Selection = bool | Iterable[str]


def _selected(selection: Selection) -> bool | frozenset[str]:
    if isinstance(selection, bool):
        return selection
    if isinstance(selection, str):
        return frozenset({selection})
    return frozenset(selection)


class PrintIR(Instrumentation):
    """Prints the program around passes, headed ``// -----// IR Dump After X (#1) //----- //``.

    Args:
        before: names of passes to print before (or True: all).
        after: names of passes to print after (or True: all).
        after_change: print after every pass that changed the program.
        after_failure: print after every pass that failed.
        to: a text stream, or a folder path (created) for one file per dump.
        warn: a name to print that no pass of a run has is a warning in its report
            (``unmatched()``: the names no run had so far, for a caller of several runs).
    """

    def __init__(
        self,
        before: Selection = (),
        after: Selection = (),
        after_change: bool = False,
        after_failure: bool = False,
        to: TextIO | str | Path | None = None,
        warn: bool = True,
    ):
        self.before = _selected(before)
        self.after = _selected(after)
        self.after_change = after_change
        self.after_failure = after_failure
        if isinstance(to, (str, Path)) and Path(to).exists() and not Path(to).is_dir():
            raise ValueError(f"PrintIR(to={str(to)!r}): a file, not a folder; to= takes a "
                             "folder (one file per dump) or a text stream such as open(path, 'w')")
        self.to, self.warn = to, warn
        self._count = 0
        self.seen: set[str] = set()  # the names of the passes of every run so far
        self._run_seen: set[str] = set()

    @staticmethod
    def _matches(selection: bool | frozenset[str], name: str) -> bool:
        return selection if isinstance(selection, bool) else name in selection

    def _emit(self, when: str, record: PassRecord, body: str) -> None:
        title = f"IR Dump {when} {record.name} (#{record.index})"
        text = f"// -----// {title} //----- //\n{body.rstrip()}\n\n"
        self._count += 1
        if isinstance(self.to, (str, Path)):
            folder = Path(self.to)
            folder.mkdir(parents=True, exist_ok=True)
            safe = "".join(c if c.isalnum() else "_" for c in record.name)
            slug = when.lower().removesuffix(" of").replace(" ", "-")
            (folder / f"{self._count:03d}-{record.index}-{safe}-{slug}.txt").write_text(text)
        else:
            (self.to or sys.stdout).write(text)

    def unmatched(self, seen: set[str] | None = None) -> list[str]:
        named = (s for s in (self.before, self.after) if not isinstance(s, bool))
        return sorted(set().union(*named) - (self.seen if seen is None else seen))

    def before_run(self, program: Any, report: Report) -> None:
        self._run_seen = set()

    def after_run(self, program: Any, report: Report) -> None:
        if self.warn:
            report.warnings += [f"PrintIR: no pass of this run is named {name!r}: nothing "
                                "printed for it" for name in self.unmatched(self._run_seen)]

    def before_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        self.seen.add(record.name)
        self._run_seen.add(record.name)
        if self._matches(self.before, record.name):
            self._emit("Before", record, program_text(program))

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        if self._matches(self.after, record.name) or (self.after_change and record.modified):
            self._emit("After", record, program_text(program))

    def after_pass_failed(
        self, pass_: Any, program: Any, record: PassRecord, error: PassManagerError
    ) -> None:
        if not (self.after_failure or self._matches(self.after, record.name)):
            return
        first_line = str(error).splitlines()[0]
        changed = error.diff or "(the pass had not changed the program)\n"
        body = (
            f"// {type(error).__name__}: {first_line}\n"
            f"// what the pass had changed before the rollback:\n{changed}\n"
            f"// the program, rolled back:\n{program_text(program)}"
        )
        self._emit("After Failure of", record, body)


class PrintDiff(Instrumentation):
    """Prints a unified diff of the program after every pass that changed it.

    Args:
        stream: a text stream (default stdout), or a file path: the diffs are appended to
            that file (created), each as its pass ends.
    """

    def __init__(self, stream: TextIO | str | Path | None = None):
        # Checked here: a wrong target failing in the first changing pass's hook would be
        # reported as that pass failing.
        if isinstance(stream, (str, Path)):
            if Path(stream).is_dir():
                raise ValueError(f"PrintDiff({str(stream)!r}): a folder; PrintDiff takes a "
                                 "file path or a text stream (PrintIR(to=folder) writes "
                                 "one file per dump)")
        elif stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(f"PrintDiff takes a text stream or a file path, got "
                            f"{type(stream).__name__}")
        self.stream = stream
        self._before = ""

    def before_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        self._before = program_text(program)

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        if not record.modified:
            return
        diff = pass_diff(self._before, program, record.name)
        if isinstance(self.stream, (str, Path)):
            with open(self.stream, "a") as file:
                file.write(diff)
        else:
            (self.stream or sys.stdout).write(diff)
