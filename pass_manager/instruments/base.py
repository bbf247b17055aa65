"""Instrumentation hooks around every pass and every run.

The core loop (``running``) calls these hooks and nothing else; timing, the check of a
pass's "unmodified" claim, semantic validation and diff printing are instruments like
any a user writes. Before-hooks run in registration order, after-hooks in reverse, so
instruments nest. An instrument observes: it must not change the program. An
``after_pass`` hook may reject the pass by raising a :class:`PassManagerError`; the
manager then rolls the pass back like any other failure.

Hook API (all optional; ``pass_`` is the Pass, ``record`` its :class:`PassRecord`, whose
``index`` gives its place in the plan):

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

from typing import Any

from ..errors import PassManagerError
from ..report import PassRecord, Report

__all__ = ["Instrumentation"]


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
