"""SemanticValidation: the program computes what it did before the pipeline, pass by pass."""

from __future__ import annotations

from typing import Any

from ..errors import SemanticsError
from ..report import PassRecord, Report
from ..validation import StateReader, Trace, first_difference, run_program
from .base import Instrumentation

__all__ = ["SemanticValidation"]


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
