"""PrintDiff: a unified diff of the program after every pass that changed it."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ..program import program_text, text_diff
from ..report import PassRecord
from .base import Instrumentation

__all__ = ["PrintDiff"]


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
