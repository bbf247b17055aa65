"""Instrumentation: the hooks the core loop (``running``) calls around every pass and run,
and the two instruments every run has (:class:`Timing`, :class:`ClaimCheck`)."""

from __future__ import annotations

import inspect
import time
from typing import Any

from ..errors import PassFailedError, PassManagerError, PipelineElementError
from ..report import PassRecord, Report

__all__ = ["ClaimCheck", "Instrumentation", "Timing", "check_instrument"]


class Instrumentation:
    """Base class: override the hooks you need. An instrument observes; one that changes the
    program's nodes or signature is an InstrumentError. Before-hooks run in registration
    order, after-hooks in reverse, so instruments nest. ``record.index`` is the pass's place
    in the plan.

    * ``before_run`` / ``after_run``: once per run (``after_run`` only when it succeeds).
    * ``before_pass``: before the pass's requirements are checked.
    * ``after_pass``: after it ran and its guarantees hold (``program`` is its result,
      ``record.modified`` says whether it changed anything); raising a PassManagerError
      here rejects the pass, which is rolled back like any other failure.
    * ``after_pass_failed``: ``program`` is already restored to what the pass was given,
      and ``error`` (``diff`` and ``unrestored`` filled) is about to be raised.
    """

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


# Each hook and what the core loop calls it with: the base class's own parameters.
_HOOKS = {hook: tuple(inspect.signature(getattr(Instrumentation, hook)).parameters)[1:]
          for hook in ("before_run", "after_run", "before_pass", "after_pass",
                       "after_pass_failed")}
_NEEDS = ("an instance of pass_manager.Instrumentation, whose subclass overrides any of "
          + ", ".join(f"{hook}({', '.join(args)})" for hook, args in _HOOKS.items()))


def check_instrument(instrument: Any) -> None:
    """Raise PipelineElementError unless ``instrument`` is an Instrumentation whose hooks
    take what the core loop calls them with (else it failed at its first hook, mid-run)."""
    if isinstance(instrument, type) and issubclass(instrument, Instrumentation):
        raise PipelineElementError(instrument.__name__, "instrument", _NEEDS, (
            f"instrument {instrument.__name__} is not an Instrumentation instance but its "
            f"class: give {instrument.__name__}()"))
    if not isinstance(instrument, Instrumentation):
        raise PipelineElementError(instrument, "instrument", _NEEDS, (
            f"instrument {instrument!r} is not an Instrumentation instance: give {_NEEDS}"))
    for hook, args in _HOOKS.items():
        method = getattr(instrument, hook, None)
        if getattr(type(instrument), hook, None) is getattr(Instrumentation, hook):
            continue  # the base class's own: takes them
        try:
            inspect.signature(method).bind(*args)
        except (TypeError, ValueError) as e:  # not callable, or another parameter list
            raise PipelineElementError(instrument, "instrument", _NEEDS, (
                f"instrument {instrument!r}: its hook {hook} cannot be called as "
                f"{hook}({', '.join(args)}) ({e})")) from None


class Timing(Instrumentation):
    """Fills ``record.wall_time`` with the pass's wall time, checks included (and the
    rollback, for a pass that failed).

    The start is kept here, per record, and the time written whole: a second Timing (a
    user's own, or one shared by nested managers) rewrites the same figure instead of
    adding a raw clock reading to it."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}

    def before_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        self._started[id(record)] = time.perf_counter()

    def after_pass(self, pass_: Any, program: Any, record: PassRecord,
                   error: PassManagerError | None = None) -> None:
        started = self._started.pop(id(record), None)
        if started is not None:
            record.wall_time = time.perf_counter() - started

    after_pass_failed = after_pass  # the clock stops the same way for a pass that failed


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
