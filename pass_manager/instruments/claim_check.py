"""ClaimCheck: a pass that says "unmodified" but changed the program is caught."""

from __future__ import annotations

from typing import Any

from ..errors import PassFailedError
from ..report import PassRecord, Report
from .base import Instrumentation

__all__ = ["ClaimCheck"]


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
