"""Instrumentation hooks around every pass and every run.

The core loop (``running``) calls these hooks and nothing else; timing, the check of a
pass's "unmodified" claim, semantic validation and diff printing are instruments like
any a user writes. Before-hooks run in registration order, after-hooks in reverse, so
instruments nest. An instrument observes: it must not change the program. An
``after_pass`` hook may reject the pass by raising a :class:`PassManagerError`; the
manager then rolls the pass back like any other failure.

Hook API (all optional; ``pass_`` is the Pass, ``record`` its :class:`PassRecord`, whose
``index`` and ``iteration`` give its place in the plan):

* ``before_run(program, report)`` / ``after_run(program, report)``: once per run
  (``after_run`` only when the run succeeds).
* ``before_pass(pass_, program, record)``: before the pass's requirements are checked.
* ``after_pass(pass_, program, record)``: after it ran and its guarantees hold;
  ``program`` is its result and ``record.modified`` says whether it changed anything.
* ``after_pass_failed(pass_, program, record, error)``: the pass (or a check of it)
  failed; ``program`` has already been restored to what the pass was given and
  ``error`` (a PassManagerError, with ``diff`` and ``unrestored`` filled) is about to be
  raised.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from .errors import PassFailedError, PassManagerError, SemanticsError
from .program import program_text, text_diff
from .report import PassRecord, Report
from .validation import StateReader, Trace, first_difference, run_program

__all__ = ["ClaimCheck", "Instrumentation", "PrintDiff", "SemanticValidation", "Timing"]


class Instrumentation:
    """Base class: override the hooks you need (see the module docstring)."""

    def before_run(self, program: Any, report: Report) -> None:
        pass

    def after_run(self, program: Any, report: Report) -> None:
        pass

    def before_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        pass

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        pass

    def after_pass_failed(
        self, pass_: Any, program: Any, record: PassRecord, error: PassManagerError
    ) -> None:
        pass


class Timing(Instrumentation):
    """Fills ``record.wall_time`` with the pass's wall time, checks included (and the
    rollback, for a pass that failed)."""

    def before_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        record.wall_time = -time.perf_counter()

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        record.wall_time += time.perf_counter()

    def after_pass_failed(
        self, pass_: Any, program: Any, record: PassRecord, error: PassManagerError
    ) -> None:
        record.wall_time += time.perf_counter()


class ClaimCheck(Instrumentation):
    """A pass that says "unmodified" but changed the program: a report warning, or with
    ``strict=True`` a PassFailedError (and the pass is rolled back)."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._report: Report | None = None

    def before_run(self, program: Any, report: Report) -> None:
        self._report = report

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        if record.claimed_modified is not False or not record.modified:
            return
        if self.strict:
            raise PassFailedError(
                record.name, record.index, "reported 'unmodified' but changed the program"
            )
        if self._report is not None:
            self._report.warnings.append(
                f"pass #{record.index} {record.name} reported 'unmodified' but changed the program"
            )


class SemanticValidation(Instrumentation):
    """Runs (a deep copy of) the program before the pipeline and after every changing pass;
    the first pass whose outputs, buffers or mutated inputs diverge raises SemanticsError."""

    def __init__(
        self,
        inputs: list[tuple],
        atol: float = 0.0,
        rtol: float = 0.0,
        state: StateReader | None = None,
    ):
        self.inputs, self.atol, self.rtol, self.state = inputs, atol, rtol, state
        self._reference: Trace | None = None

    def _trace(self, program: Any) -> Trace:
        if self.state is None:
            return run_program(program, self.inputs)
        return run_program(program, self.inputs, state=self.state)

    def before_run(self, program: Any, report: Report) -> None:
        self._reference = self._trace(program)

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        if not record.modified or self._reference is None:
            return
        difference = first_difference(self._reference, self._trace(program), self.atol, self.rtol)
        if difference:
            raise SemanticsError(record.name, record.index, difference)


class PrintDiff(Instrumentation):
    """Prints a unified diff of the program after every pass that changed it."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self._before = ""

    def before_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        self._before = program_text(program)

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        if record.modified:
            stream = self.stream or sys.stdout
            diff = text_diff(
                self._before, program_text(program), "before " + record.name,
                "after " + record.name,
            )
            stream.write(diff)
