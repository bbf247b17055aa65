"""Timing: each pass's wall time, checks included (``PassRecord.wall_time``)."""

from __future__ import annotations

import time
from typing import Any

from ..errors import PassManagerError
from ..report import PassRecord
from .base import Instrumentation

__all__ = ["Timing"]


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
