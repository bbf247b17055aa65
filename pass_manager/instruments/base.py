"""Instrumentation: the hooks the core loop (``running``) calls around every pass and run."""

from __future__ import annotations

from typing import Any

from ..errors import PassManagerError
from ..report import PassRecord, Report

__all__ = ["Instrumentation"]


class Instrumentation:
    """Base class: override the hooks you need. An instrument observes; it must not change
    the program. Before-hooks run in registration order, after-hooks in reverse, so
    instruments nest. ``record.index`` is the pass's place in the plan.

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
