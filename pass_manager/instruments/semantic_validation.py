"""SemanticValidation: the program computes what it did before the pipeline, pass by pass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..call_signature import describe_inputs, signature_of
from ..errors import SemanticsError, ValidationInputError
from ..report import PassRecord, Report
from ..validation import (
    StateReader,
    Trace,
    call_inputs,
    default_state,
    first_difference,
    run_program,
)
from .base import Instrumentation

__all__ = ["SemanticValidation"]


class SemanticValidation(Instrumentation):
    """Runs (a deep copy of) the program before the pipeline and after every changing pass;
    the first pass whose outputs, buffers or mutated inputs diverge raises SemanticsError.

    Args:
        inputs: one call's inputs (an argument tuple, an ``(args, kwargs)`` pair or a
            keyword mapping), repeated ``calls`` times (default 3), or a list of them.
        calls: number of successive calls to compare.
        atol, rtol: tolerances of the comparison (exact by default).
        state: ``module -> {fqn: tensor}``, the state to compare after each call (default:
            the named buffers; pass a reader that also sees state a delegate owns).

    Inputs that do not fit the program (its input tree or signature), or on which the
    program given to the pipeline already fails, raise :class:`ValidationInputError`
    naming the call (``inputs[i]``) before any pass runs; so do inputs that no longer fit
    after a pass changed the program's inputs (``InputsToBuffers``, ``BuffersToInputs``),
    naming that pass (its change rolled back).

    Example:
        >>> PassManager(passes, instruments=[SemanticValidation((x, pos), atol=1e-6)]).run(ep)
    """

    option = "SemanticValidation(inputs=...)"

    def __init__(
        self,
        inputs: Any,
        *,
        calls: int | None = None,
        atol: float = 0.0,
        rtol: float = 0.0,
        state: StateReader | None = None,
    ):
        single = isinstance(inputs, (tuple, Mapping))
        if isinstance(inputs, (torch.Tensor, str, bytes)) or not isinstance(inputs, Iterable):
            example = "(x,)" if isinstance(inputs, torch.Tensor) else "(...)"
            raise ValidationInputError(
                self.option, None,
                f"SemanticValidation takes one call's inputs (an argument tuple, an "
                f"(args, kwargs) pair or a keyword mapping) or a list of them, one per "
                f"call; got a {type(inputs).__name__}: write SemanticValidation({example})",
            )
        if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int)
                                  or calls < 1):
            raise ValidationInputError(
                self.option, None, f"calls={calls!r}: the number of calls to compare is a "
                "positive int")
        if not all(isinstance(t, (int, float)) and t >= 0 for t in (atol, rtol)):
            # torch.allclose refuses it after the first changing pass: blamed on the pass.
            raise ValidationInputError(self.option, None, f"atol={atol!r}, rtol={rtol!r}: "
                                       "the tolerances are numbers, at least 0")
        self.hint = ""
        if not single:
            inputs = list(inputs)
            if calls is not None and calls > len(inputs):
                raise ValidationInputError(
                    self.option, None,
                    f"calls={calls} asks for more calls than the {len(inputs)} given: give "
                    f"{calls} entries, or calls={len(inputs)} or less")
            if not inputs:
                raise ValidationInputError(
                    self.option, None, "an empty list of calls: nothing would be validated; "
                    "give one call's inputs, e.g. SemanticValidation((x,)), or a list of them")
            if not any(isinstance(e, (tuple, list, Mapping)) for e in inputs):
                self.hint = (" (a list of single values is one call per value; one call's "
                             "arguments are a tuple: SemanticValidation((x, pos)))")
        self.inputs = call_inputs(inputs, calls or (3 if single else None))
        self.labels = (["inputs"] * len(self.inputs) if single
                       else [f"inputs[{i}]" for i in range(len(self.inputs))])
        self.atol, self.rtol, self.state = atol, rtol, state
        self._reference: Trace | None = None
        self._replayed = False  # rebuilt by from_saved: its reference is the saved one

    def saved(self) -> dict[str, Any]:
        """What a reproducer saves of this check, as plain data where it can be: the inputs,
        tolerances, reference trace (its fields) and state reader (by ``module:qualname``
        when it has an importable name). :meth:`from_saved` rebuilds the check."""
        state, name = self.state, getattr(self.state, "__qualname__", "<")
        module = getattr(state, "__module__", None)
        if state is not None and module not in (None, "__main__") and "<" not in name:
            state = f"{module}:{name}"
        trace = self._reference
        return {"inputs": self.inputs, "atol": self.atol, "rtol": self.rtol, "state": state,
                "reference": None if trace is None else vars(trace)}

    @classmethod
    def from_saved(cls, saved: dict, state: StateReader | None) -> SemanticValidation:
        """The check :meth:`saved` gave (``state``: its reader, resolved from its name by
        the caller), comparing against the saved reference instead of tracing the program
        it is given again."""
        validation = cls(saved["inputs"], atol=saved["atol"], rtol=saved["rtol"], state=state)
        reference = saved["reference"]
        validation._reference = Trace(**reference) if isinstance(reference, dict) else reference
        validation._replayed = True
        return validation

    def _trace(self, program: Any, on_call: Any = None) -> Trace:
        return run_program(program, self.inputs, state=self.state or default_state,
                           on_call=on_call)

    def _error(self, index: int, reason: str, expected: str) -> ValidationInputError:
        args, kwargs = self.inputs[index]
        return ValidationInputError(
            self.option, self.labels[index], reason + self.hint, expected=expected,
            given=describe_inputs(args, kwargs),
        )

    def before_run(self, program: Any, report: Report) -> None:
        if self._replayed:  # compared against the failed run's reference, as it was saved
            return
        signature = signature_of(program)
        for index, (args, kwargs) in enumerate(self.inputs):
            reason = signature.mismatch(args, kwargs)
            if reason:
                raise self._error(index, reason, str(signature))
        done: list[int] = []
        try:
            self._reference = self._trace(program, on_call=done.append)
        except Exception as e:
            raise self._error(
                len(done), f"the program given to the pipeline, before any pass, raised "
                f"{type(e).__name__}: {e}", str(signature),
            ) from e

    def after_pass(self, pass_: Any, program: Any, record: PassRecord) -> None:
        if not record.modified or self._reference is None:
            return
        signature = signature_of(program)
        for index, (args, kwargs) in enumerate(self.inputs):
            reason = signature.mismatch(args, kwargs)
            if reason:  # a pass that moves state between inputs and buffers
                raise self._error(
                    index, f"pass #{record.index} {record.name} changed the program's "
                    f"inputs, so the calls before it no longer fit the program after it "
                    f"({reason}); validate the passes before it and from it on in two "
                    "pipelines, each with the inputs its program takes", str(signature))
        try:
            traced = self._trace(program)
        except Exception as e:  # the pass left a program that cannot run: the pass's fault
            raise SemanticsError(record.name, record.index, "the program it left raised "
                                 f"{type(e).__name__}: {e}") from e
        difference = first_difference(self._reference, traced, self.atol, self.rtol)
        if difference:
            raise SemanticsError(record.name, record.index, difference)
