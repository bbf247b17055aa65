"""PassManager: plan passes by their conditions, run them transactionally, report.

The core loop is small: for each planned pass, check what it requires (reusing cached
results still valid), snapshot, run, measure whether it changed the program, check
what it provides, and roll back on any failure. Timing, diffs and user hooks are
instruments around that loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from .conditions import ALL_CONDITIONS, Condition, as_condition_set
from .errors import (
    PassFailedError,
    PassManagerError,
    PostconditionError,
    PreconditionError,
    ProgramFormError,
    SemanticsError,
)
from .instrumentation import Instrumentation, PrintDiff, Timing
from .pass_base import Pass, PassResult, as_pass, known_passes
from .planning import Plan, build_plan
from .program import (
    Fingerprint,
    Snapshot,
    fingerprint,
    graph_module_of,
    node_count,
    program_form,
    program_text,
    text_diff,
)
from .report import PassRecord, Report
from .validation import StateReader, Trace, call_inputs, first_difference, run_program

__all__ = ["PassManager", "RunResult"]


@dataclass
class RunResult:
    """The outcome of :meth:`PassManager.run`."""

    program: Any
    modified: bool
    report: Report

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return graph_module_of(self.program)


def _providers_hint(condition: Condition) -> str:
    names = []
    for cls in known_passes():
        try:
            if condition in as_condition_set(cls.__dict__.get("provides", ())):
                names.append(cls.__name__)
        except TypeError:
            continue
    if not names:
        return f"No known pass provides {condition.name}."
    return f"No pass in this pipeline provides it; add one of: {', '.join(sorted(set(names)))}."


class PassManager(Pass):
    """Runs passes in dependency order with checked conditions and rollback.

    Args:
        passes: Pass instances, torch ``PassBase`` objects, plain ``gm -> ...`` callables,
            or nested PassManagers (a group, e.g. with its own ``max_iterations``).
        reorder: order by dependencies (default); with False, keep the list order and
            raise PipelineError when a requirement is provided only later.
        strict: a pass that claims "unmodified" but changed the program is an error
            (rolled back) instead of a report warning.
        max_iterations: repeat the pipeline until no pass changes the program, at most
            this many times (1 = run once); hitting the bound is a report warning.
        validate: example inputs (one argument tuple, or one tuple per call) to check
            after every changing pass that the program still computes what it did
            before the pipeline; the first divergence raises SemanticsError.
        validation_calls: number of successive calls to compare (default: one per
            input tuple, or 3 for a single tuple).
        atol, rtol: tolerances of that comparison (exact by default).
        validation_state: ``module -> {fqn: tensor}`` reading the state to compare after
            each call (default: the module's named buffers); pass a reader that also sees
            state a delegate owns.
        instruments: extra Instrumentation objects (hooks around every pass).
        print_diff: print a unified diff of the program after every changing pass.

    Example:
        >>> result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep)
        >>> print(result.report)
    """

    def __init__(
        self,
        passes: Sequence[Any],
        *,
        reorder: bool = True,
        strict: bool = False,
        max_iterations: int = 1,
        validate: Any = None,
        validation_calls: int | None = None,
        atol: float = 0.0,
        rtol: float = 0.0,
        validation_state: StateReader | None = None,
        instruments: Iterable[Instrumentation] = (),
        print_diff: bool = False,
        name: str | None = None,
    ):
        if max_iterations < 1:
            raise ValueError("max_iterations must be at least 1")
        self._passes = [as_pass(p) for p in passes]
        self._plan: Plan = build_plan(self._passes, reorder=reorder)
        self.strict = strict
        self.max_iterations = max_iterations
        self.validation_inputs = (
            None
            if validate is None
            else call_inputs(
                validate, validation_calls or (3 if isinstance(validate, tuple) else None)
            )
        )
        self.atol, self.rtol = atol, rtol
        self.validation_state = validation_state
        self.instruments: list[Instrumentation] = [Timing(), *instruments]
        if print_diff:
            self.instruments.append(PrintDiff())
        self._name = name

    # -- a PassManager is itself a pass, so pipelines nest as groups -------------------
    @property
    def name(self) -> str:
        return self._name or "PassManager[" + ", ".join(p.name for p in self.plan()) + "]"

    @property
    def requires(self) -> frozenset:
        provided: set = set()
        needed: set = set()
        for p in self.plan():
            needed |= p.required - provided
            provided |= p.provided
        return frozenset(needed)

    @property
    def provides(self) -> frozenset:
        return frozenset().union(*(p.provided for p in self.plan()))

    @property
    def preserves(self) -> frozenset:
        preserved = ALL_CONDITIONS
        for p in self.plan():
            if preserved is ALL_CONDITIONS:
                preserved = p.preserved
            elif p.preserved is not ALL_CONDITIONS:
                preserved = preserved & p.preserved
        return preserved

    @property
    def accepts(self) -> tuple[str, ...]:
        forms = None
        for p in self.plan():
            forms = set(p.accepts) if forms is None else forms & set(p.accepts)
        return tuple(sorted(forms)) if forms is not None else Pass.accepts

    def call(self, program: Any) -> PassResult:
        result = self.run(program)
        notes = [f"{r.name}: {n}" for r in result.report.records for n in r.notes]
        return PassResult(result.program, result.modified, notes)

    # -- planning ----------------------------------------------------------------------
    def plan(self) -> list[Pass]:
        """The passes in the order they will run."""
        return self._plan.passes

    def explain(self) -> str:
        """The plan, one line per pass, with the reason for its place."""
        return self._plan.explain()

    def to_dot(self) -> str:
        """The pass/condition DAG as Graphviz DOT text."""
        return self._plan.to_dot()

    # -- running -----------------------------------------------------------------------
    def __call__(self, graph_module: Any) -> TorchPassResult:
        """Torch PassManager compatibility: ``pm(gm) -> torch PassResult``."""
        result = self.run(graph_module)
        return TorchPassResult(result.graph_module, result.modified)

    def run(self, program: Any) -> RunResult:
        """Run the plan on ``program``; return the program (same form) and a report."""
        try:
            program_form(program)
        except TypeError as e:
            raise ProgramFormError(
                self.name, None, type(program).__name__, ["GraphModule", "ExportedProgram"]
            ) from e
        report = Report(plan=self.explain())
        holds: set[Condition] = set()
        reference = self._trace(program) if self.validation_inputs is not None else None
        any_change = False
        # Each pass's "after" fingerprint is the next pass's "before": computed once.
        current: Fingerprint | None = None
        for iteration in range(self.max_iterations):
            changed_this_round = False
            for index, p in enumerate(self.plan()):
                record = PassRecord(p.name, index, iteration)
                program, current = self._run_pass(
                    p, index, program, holds, record, reference, current
                )
                report.records.append(record)
                changed_this_round |= record.modified
            any_change |= changed_this_round
            if not changed_this_round:
                break
        else:
            if self.max_iterations > 1:
                report.warnings.append(
                    f"no fixed point after {self.max_iterations} iterations; "
                    "the last one still changed the program"
                )
        for r in report.records:
            if r.claimed_modified is False and r.modified:
                report.warnings.append(
                    f"pass #{r.index} {r.name} reported 'unmodified' but changed the program"
                )
        return RunResult(program, any_change, report)

    def _trace(self, program: Any) -> Trace:
        if self.validation_state is None:
            return run_program(program, self.validation_inputs)
        return run_program(program, self.validation_inputs, state=self.validation_state)

    def _check(self, condition: Condition, program: Any, record: PassRecord) -> list[str]:
        start = time.perf_counter()
        try:
            return condition.check(program)
        finally:
            record.check_time += time.perf_counter() - start
            record.checked.append(condition.name)

    def _run_pass(
        self,
        p: Pass,
        index: int,
        program: Any,
        holds: set[Condition],
        record: PassRecord,
        reference: Trace | None,
        before: Fingerprint | None,
    ) -> tuple[Any, Fingerprint]:
        form = program_form(program)
        if form not in p.accepts:
            raise ProgramFormError(p.name, index, form, p.accepts)
        for instrument in self.instruments:
            instrument.before_pass(p, program, record)
        record.nodes_before = node_count(program)

        for condition in sorted(p.required, key=lambda c: c.name):
            if condition in holds:
                record.cached.append(condition.name)
                continue
            violations = self._check(condition, program, record)
            if violations:
                provided_here = any(condition in q.provided for q in self.plan())
                hint = "" if provided_here else _providers_hint(condition)
                raise PreconditionError(p.name, index, condition.name, violations, hint=hint)
            holds.add(condition)

        if before is None:
            before = fingerprint(program)
        snapshot = Snapshot(program)

        def fail(error: PassManagerError, cause: BaseException | None = None):
            lost = snapshot.unrestorable_changes()
            snapshot.restore()
            if lost:
                error.args = (
                    f"{error}\nNot restored: parameters written in place by the pass "
                    f"(their old values were not copied): {', '.join(lost)}",
                )
            raise error from cause

        def changes(after_program: Any) -> str:
            return text_diff(
                snapshot.text, program_text(after_program), "before " + p.name, "after " + p.name
            )

        try:
            out = p.call(program)
        except PassManagerError as e:
            if isinstance(p, PassManager):
                fail(e, e.__cause__)
            fail(
                PassFailedError(p.name, index, f"{type(e).__name__}: {e}", diff=changes(program)), e
            )
        except Exception as e:  # noqa: BLE001 - any failure of a pass becomes a typed, rolled-back error
            fail(
                PassFailedError(p.name, index, f"{type(e).__name__}: {e}", diff=changes(program)), e
            )

        new_program, claimed, notes = self._unpack(out, program)
        if new_program is not program and program_form(new_program) != form:
            fail(
                PassFailedError(
                    p.name, index, f"returned a {type(new_program).__name__} for a {form} input"
                )
            )
        after = fingerprint(new_program)
        modified = after != before
        record.claimed_modified, record.notes = claimed, notes
        if claimed is False and modified and self.strict:
            fail(
                PassFailedError(
                    p.name,
                    index,
                    "reported 'unmodified' but changed the program",
                    diff=changes(new_program),
                )
            )
        if after.code != before.code:
            graph_module_of(new_program).recompile()

        if modified:
            kept = p.preserved
            for condition in list(holds):
                if condition not in kept:
                    holds.discard(condition)
        for condition in sorted(p.provided, key=lambda c: c.name):
            if condition in holds:
                record.cached.append(condition.name)
                continue
            violations = self._check(condition, new_program, record)
            if violations:
                fail(
                    PostconditionError(
                        p.name, index, condition.name, violations, diff=changes(new_program)
                    )
                )
            holds.add(condition)

        if reference is not None and modified:
            difference = first_difference(reference, self._trace(new_program), self.atol, self.rtol)
            if difference:
                fail(SemanticsError(p.name, index, difference))

        record.modified = modified
        record.nodes_after = node_count(new_program)
        for instrument in reversed(self.instruments):
            instrument.after_pass(p, new_program, record)
        return new_program, after

    @staticmethod
    def _unpack(out: Any, program: Any) -> tuple[Any, bool | None, list[str]]:
        if out is None:
            return program, None, []
        if isinstance(out, PassResult):
            return out.program, out.modified, list(out.notes)
        if isinstance(out, TorchPassResult):
            gm = out.graph_module
            if program_form(program) == "ExportedProgram" and gm is not program.graph_module:
                return program._update(gm, program.graph_signature), out.modified, []
            return (program if gm is graph_module_of(program) else gm), out.modified, []
        if isinstance(out, (torch.fx.GraphModule, torch.export.ExportedProgram)):
            return out, None, []
        raise TypeError(
            f"a pass returned {type(out).__name__}; expected PassResult, a program or None"
        )
