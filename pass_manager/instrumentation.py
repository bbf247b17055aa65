"""Instrumentation hooks around every pass.

The run loop only calls ``before_pass`` and ``after_pass`` on each registered
instrument; timing and diff printing are instruments like any a user writes.
After-hooks run in reverse registration order, so instruments nest. Instruments observe:
they must not change the program (the manager measures changes around the pass only).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from .pass_base import Pass
from .program import program_text, text_diff
from .report import PassRecord

__all__ = ["Instrumentation", "PrintDiff", "Timing"]


class Instrumentation:
    """Base class: override the hooks you need."""

    def before_pass(self, pass_: Pass, program: Any, record: PassRecord) -> None:
        pass

    def after_pass(self, pass_: Pass, program: Any, record: PassRecord) -> None:
        pass


class Timing(Instrumentation):
    """Fills ``record.wall_time`` with the pass's wall time, checks included."""

    def before_pass(self, pass_: Pass, program: Any, record: PassRecord) -> None:
        record.wall_time = -time.perf_counter()

    def after_pass(self, pass_: Pass, program: Any, record: PassRecord) -> None:
        record.wall_time += time.perf_counter()


class PrintDiff(Instrumentation):
    """Prints a unified diff of the program after every pass that changed it."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self._before = ""

    def before_pass(self, pass_: Pass, program: Any, record: PassRecord) -> None:
        self._before = program_text(program)

    def after_pass(self, pass_: Pass, program: Any, record: PassRecord) -> None:
        if record.modified:
            stream = self.stream or sys.stdout
            diff = text_diff(
                self._before, program_text(program), "before " + pass_.name, "after " + pass_.name
            )
            stream.write(diff)
