"""SemanticValidation: the program computes what it did before the pipeline, pass by pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..call_signature import describe_inputs, signature_of
from ..errors import SemanticsError, ValidationInputError
from ..report import PassRecord, Report
from ..validation import StateReader, Trace, first_difference, run_program
from .base import Instrumentation

__all__ = ["SemanticValidation"]


class SemanticValidation(Instrumentation):
    """Runs (a deep copy of) the program before the pipeline and after every changing pass;
    the first pass whose outputs, buffers or mutated inputs diverge raises SemanticsError.

    Before any pass runs, each call's inputs are checked against the inputs the program
    takes, and the program is run on them: inputs that do not fit, or on which the
    program given to the pipeline already fails, raise :class:`ValidationInputError`
    naming ``option`` and the call (``labels[i]``, by default ``inputs[i]``).
    """

    def __init__(
        self,
        inputs: list[tuple],
        atol: float = 0.0,
        rtol: float = 0.0,
        state: StateReader | None = None,
        *,
        option: str = "SemanticValidation(inputs=...)",
        labels: Sequence[str] | None = None,
        hint: str = "",
    ):
        self.inputs, self.atol, self.rtol, self.state = inputs, atol, rtol, state
        self.option = option
        self.labels = list(labels) if labels is not None else [
            f"inputs[{i}]" for i in range(len(inputs))]
        self.hint = hint
        self._reference: Trace | None = None

    def _trace(self, program: Any, on_call: Any = None) -> Trace:
        if self.state is None:
            return run_program(program, self.inputs, on_call=on_call)
        return run_program(program, self.inputs, state=self.state, on_call=on_call)

    def _error(self, index: int, reason: str, expected: str) -> ValidationInputError:
        args, kwargs = self.inputs[index]
        return ValidationInputError(
            self.option, self.labels[index], reason + self.hint, expected=expected,
            given=describe_inputs(args, kwargs),
        )

    def before_run(self, program: Any, report: Report) -> None:
        signature = signature_of(program)
        for index, (args, kwargs) in enumerate(self.inputs):
            reason = signature.mismatch(args, kwargs)
            if reason:
                raise self._error(index, reason, str(signature))
        done: list[int] = []
        try:
            self._reference = self._trace(program, on_call=done.append)
        except Exception as e:
            failed = len(done)
            raise self._error(
                failed, f"the program given to the pipeline, before any pass, raised "
                f"{type(e).__name__}: {e}", str(signature),
            ) from e

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        if not record.modified or self._reference is None:
            return
        difference = first_difference(self._reference, self._trace(program), self.atol, self.rtol)
        if difference:
            raise SemanticsError(record.name, record.index, difference)
