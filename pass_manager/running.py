"""The core loop: for each planned pass, require -> record -> call -> measure -> provide.

The program's form (GraphModule or ExportedProgram) is decided once, where it enters
(:meth:`Runner.run`); every step reads it from the run's state.

* require: the form the pass accepts, then every required condition (cached results
  reused; the checks share the rollback record's measurement of the nodes, passed to
  the analysis cache with ``analysis.unchanged``).
* record: what a rollback needs, chosen from the pass's ``effects`` (``_rollback``).
* call: the pass; whatever it raises becomes a typed, rolled-back error.
* measure: the pass kept its declaration, what it changed (compared with the record by
  identity), its ``in_place`` contract; recompile only if the nodes changed.
* provide: drop cached results the pass did not preserve, check what it provides.

Everything else (timing, the "unmodified" claim check, semantic validation, diffs,
reproducers) is an instrument; see ``instruments``. This module does not know the
Pass class: it runs anything with the Pass attributes, so ``pass_base`` can use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from ._rollback import recorded, take
from .analysis import unchanged
from .conditions import (
    Condition,
    as_condition_set,
    preserves_everything,
    preserves_of,
    provides_of,
    requires_of,
)
from .errors import (
    EffectsError,
    PassFailedError,
    PassManagerError,
    PostconditionError,
    PreconditionError,
    ProgramFormError,
)
from .instruments import ClaimCheck, Instrumentation, Timing
from .program import (
    EXPORTED_PROGRAM,
    GRAPH_MODULE,
    graph_module_of,
    node_count,
    program_form,
    program_text,
    text_diff,
)
from .registry import registered_passes
from .report import PassRecord, Report
from .result import PassResult

__all__ = ["RunResult", "Runner", "default_instruments", "run_alone"]


@dataclass
class RunResult:
    """The outcome of a run: the program (same form as the input), whether any pass
    changed it, and the report."""

    program: Any
    modified: bool
    report: Report

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return graph_module_of(self.program)


def default_instruments(strict: bool = False) -> list[Instrumentation]:
    """What every run has: timing, and the check of "unmodified" claims."""
    return [Timing(), ClaimCheck(strict)]


def _providers_hint(condition: Condition, alone: str | None = None) -> str:
    """Which known passes provide ``condition``, said to a pipeline without one, or to the
    pass ``alone`` (its repr, options included) when it was called by itself
    (``pass_(program)``)."""
    names = set()
    for cls in registered_passes():
        try:
            if condition in as_condition_set(cls.__dict__.get("provides", ())):
                names.add(cls.__name__)
        except TypeError:
            continue
    if not names:
        return f"No known pass provides {condition.name}."
    providers = " or ".join(sorted(names))
    if alone is not None:
        first = sorted(names)[0]
        return (
            f"This pass was called alone, so nothing in its run provides "
            f"{condition.name}: run {providers} on the program first, or both in one "
            f"pipeline: PassManager([{first}(), {alone}]).run(program)."
        )
    return f"No pass in this pipeline provides it; add one of: {', '.join(sorted(names))}."


# How to turn the form a pass refused into the other one.
_FORM_ADVICE = {
    EXPORTED_PROGRAM: "pass its .module()",
    GRAPH_MODULE: "pass the ExportedProgram it came from (torch.export.export)",
}


def _unpack(out: Any, program: Any, exported: bool
            ) -> tuple[Any, bool | None, list[str], dict[str, Any]]:
    """A pass's return value -> (program, claimed modified, notes, statistics)."""
    if out is None:
        return program, None, [], {}
    if isinstance(out, PassResult):
        return out.program, out.modified, list(out.notes), dict(out.statistics)
    if isinstance(out, TorchPassResult):
        gm = out.graph_module
        if exported and gm is not program.graph_module:
            return program._update(gm, program.graph_signature), out.modified, [], {}
        return (program if gm is graph_module_of(program) else gm), out.modified, [], {}
    if isinstance(out, (torch.fx.GraphModule, torch.export.ExportedProgram)):
        return out, None, [], {}
    raise TypeError(f"a pass returned {type(out).__name__}; expected PassResult, a program or None")


def _unchanged(record: Any, program: Any, after: bool) -> Any:
    """The analysis cache takes ``program`` as unchanged, measured as ``record`` did."""
    return unchanged(*record.measured(program, after))


def _error_statistics(error: BaseException) -> dict[str, Any]:
    """Statistics an exception carries (``error.statistics``), or its cause's."""
    for e in (error, error.__cause__):
        if isinstance(getattr(e, "statistics", None), dict):
            return e.statistics
    return {}


class _RunState:
    """What the loop carries from one pass to the next: the program's form, decided once
    where the program enters, and the conditions known to hold."""

    def __init__(self, form: str) -> None:
        self.form = form
        self.exported = form == EXPORTED_PROGRAM
        self.type = torch.export.ExportedProgram if self.exported else torch.fx.GraphModule
        self.holds: set[Condition] = set()


class Runner:
    """Runs passes in the given order, checked and transactional.

    Args:
        passes: planned passes (anything with the Pass attributes).
        instruments: hooks around every pass (see ``instruments``).
        name: what to call the pipeline in an error about the program it was given.
        plan: the plan's explanation, for the report.
        start: the place of the first pass in the plan (a replay runs one pass of a
            longer plan under its original number).
        strict: check every pass's effects in full (a full rollback record whatever the
            declaration; an edit it does not declare is a typed error).
        alone: the one pass was called by itself, not in a pipeline (errors say so).
    """

    def __init__(
        self,
        passes: Sequence[Any],
        instruments: Iterable[Instrumentation],
        *,
        name: str = "PassManager",
        plan: str = "",
        start: int = 0,
        strict: bool = False,
        alone: bool = False,
    ):
        self.passes = list(passes)
        self.alone = alone
        self.strict = strict
        self.start = start
        self.instruments = list(instruments)
        self.name = name
        self.plan = plan

    def run(self, program: Any) -> RunResult:
        try:
            state = _RunState(program_form(program))
        except TypeError as e:
            advice = ("export it first (torch.export.export(module, example_args)) and pass "
                      "the ExportedProgram or its .module()"
                      if isinstance(program, torch.nn.Module) else "")
            raise ProgramFormError(
                self.name, None, type(program).__name__, [GRAPH_MODULE, EXPORTED_PROGRAM], advice
            ) from e
        report = Report(plan=self.plan, strict=self.strict)
        for instrument in self.instruments:
            instrument.before_run(program, report)
        for index, p in enumerate(self.passes, self.start):
            record = PassRecord(p.name, index)
            try:
                program = self._run_pass(p, index, program, state, record)
            except PassManagerError as e:
                # The report so far, ending with the failed pass, travels with the
                # error (the outermost pipeline's, when groups nest).
                report.records.append(record)
                e.report = report
                raise
            report.records.append(record)
        for instrument in reversed(self.instruments):
            instrument.after_run(program, report)
        return RunResult(program, any(r.modified for r in report.records), report)

    # -- one pass ----------------------------------------------------------------------
    def _run_pass(
        self, p: Any, index: int, program: Any, state: _RunState, record: PassRecord
    ) -> Any:
        rollback, current = None, program
        try:
            for instrument in self.instruments:
                instrument.before_pass(p, program, record)
            record.nodes_before = node_count(program)
            taken = take(program, p.effects, self.strict)
            # The checks share the node records the rollback record took; a pass that
            # leaves the nodes alone runs inside that one measurement too.
            through = taken.leaves_nodes_alone
            with _unchanged(taken, program, False) if through else nullcontext():
                with nullcontext() if through else _unchanged(taken, program, False):
                    self._require(p, index, program, state, record)
                rollback = taken  # from here on, a failure restores the program
                with recorded(program):
                    current = self._call(p, index, program, state, record)
                rollback.check(p.name, index, current)
                self._measure(p, index, program, current, rollback, state, record)
                with nullcontext() if through else _unchanged(rollback, current, True):
                    self._provide(p, index, current, state, record)
            for instrument in reversed(self.instruments):
                instrument.after_pass(p, current, record)
            return current
        except Exception as e:
            error = self._failed(p, index, program, current, rollback, record, e)
            if error is e:
                raise
            raise error from e

    def _failed(self, p: Any, index: int, program: Any, current: Any, rollback: Any,
                record: PassRecord, e: Exception) -> PassManagerError:
        """The typed error of a failed pass, after the rollback and the failure hooks."""
        error = e if isinstance(e, PassManagerError) else PassFailedError(
            p.name, index, f"{type(e).__name__}: {e}"
        )
        error._from_runner = True
        # A refusal the pass counted (``error.statistics``) is a statistic of its record.
        record.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        record.statistics = dict(_error_statistics(e) or record.statistics)
        if rollback is not None:
            self._roll_back(p, rollback, current, error)
        for instrument in reversed(self.instruments):
            instrument.after_pass_failed(p, program, record, error)
        return error

    def _call(self, p: Any, index: int, program: Any, state: _RunState,
              record: PassRecord) -> Any:
        """Run the pass; its result program, with its claim, notes and statistics recorded."""
        try:
            out = p.call(program)
        except PassManagerError as e:
            if getattr(e, "_from_runner", False):  # a nested pipeline named its failing pass
                raise
            raise PassFailedError(p.name, index, f"{type(e).__name__}: {e}") from e
        except Exception as e:
            raise PassFailedError(p.name, index, f"{type(e).__name__}: {e}") from e
        current, record.claimed_modified, record.notes, record.statistics = _unpack(
            out, program, state.exported)
        return current

    def _require(
        self, p: Any, index: int, program: Any, state: _RunState, record: PassRecord
    ) -> None:
        if state.form not in p.accepts:
            raise ProgramFormError(p.name, index, state.form, p.accepts,
                                   _FORM_ADVICE.get(state.form, ""))
        failed = self._check(requires_of(p), program, state, record)
        if failed:
            condition, violations = failed
            provided_here = any(condition in provides_of(q) for q in self.passes)
            hint = "" if provided_here else _providers_hint(
                condition, repr(p) if self.alone else None)
            raise PreconditionError(p.name, index, condition.name, violations, hint=hint)

    def _measure(
        self, p: Any, index: int, program: Any, new_program: Any, rollback: Any,
        state: _RunState, record: PassRecord,
    ) -> None:
        if new_program is not program and not isinstance(new_program, state.type):
            raise PassFailedError(p.name, index, f"returned a {type(new_program).__name__} "
                                                 f"for a {state.form} input")
        in_place = p.effects.in_place
        if in_place is True and new_program is not program:
            raise EffectsError(p.name, index, "in_place", reason=(
                "declares in_place = True (in its effects) but returned a different program "
                "object"))
        change = rollback.compare(new_program, record.claimed_modified)
        record.modified = change.anything
        if in_place is False and new_program is program and record.modified:
            raise EffectsError(p.name, index, "in_place", reason=(
                "declares in_place = False (returns a new program) but changed the program "
                "it was given"))
        if change.structure:
            graph_module_of(new_program).recompile()
        record.nodes_after = node_count(new_program)

    def _provide(
        self, p: Any, index: int, program: Any, state: _RunState, record: PassRecord
    ) -> None:
        if record.modified and not preserves_everything(p):
            state.holds &= preserves_of(p)
        failed = self._check(provides_of(p), program, state, record)
        if failed:
            condition, violations = failed
            raise PostconditionError(p.name, index, condition.name, violations)

    @staticmethod
    def _check(
        conditions: Iterable[Condition], program: Any, state: _RunState, record: PassRecord
    ) -> tuple[Condition, list[str]] | None:
        """Check each condition not known to hold; the first violated one and its violations."""
        for condition in sorted(conditions, key=lambda c: c.name):
            if condition in state.holds:
                record.cached.append(condition.name)
                continue
            start = time.perf_counter()
            try:
                violations = condition.check(program)
            finally:
                record.check_time += time.perf_counter() - start
                record.checked.append(condition.name)
            if violations:
                return condition, violations
            state.holds.add(condition)
        return None

    @staticmethod
    def _roll_back(p: Any, rollback: Any, current: Any, error: PassManagerError) -> None:
        if not error.diff:
            error.diff = text_diff(
                rollback.text, program_text(current), "before " + p.name, "after " + p.name
            )
        error.unrestored = sorted(set(error.unrestored) | set(rollback.unrestorable_changes()))
        rollback.restore()
        error.rolled_back = True


def run_alone(pass_: Any, graph_module: Any) -> TorchPassResult:
    """Run one pass, checked and transactional, as a torch-style callable."""
    result = Runner([pass_], default_instruments(), name=pass_.name, alone=True).run(
        graph_module)
    return TorchPassResult(result.graph_module, result.modified)
