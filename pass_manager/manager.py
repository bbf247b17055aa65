"""PassManager: plan passes by their conditions, run them transactionally, report."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from .conditions import (
    ALL_CONDITIONS,
    preserves_everything,
    preserves_of,
    provides_of,
)
from .effects import Effects
from .errors import PipelineElementError, PipelineError
from .instruments import ClaimCheck, Instrumentation, Timing, check_instrument
from .pass_base import Pass, PassResult, as_pass
from .pipeline_text import format_pipeline, parse_passes
from .planning import Plan, build_plan
from .program_sets import MethodsRunResult, run_each
from .running import ENCLOSING, Runner, RunResult, default_instruments

__all__ = ["PassManager", "RunResult", "parse_pipeline"]


class PassManager(Pass):
    """Runs passes in dependency order with checked conditions and rollback.

    Args:
        passes: Pass instances, torch ``PassBase`` objects, plain ``gm -> ...`` callables,
            or nested PassManagers (a group).
        instruments: hooks around every pass and run (:class:`SemanticValidation`,
            :class:`PrintIR`, :class:`PrintDiff`, :class:`Reproducer` or your own); timing
            and the check of "unmodified" claims are always on.
        strict: a pass that claims "unmodified" but changed the program is an error
            instead of a report warning, and every pass's ``effects`` are checked in full
            (an edit it does not declare is an EffectsError); what a changing pass
            claims to preserve is checked again (PostconditionError if it broke).
        name: what to call the pipeline (in errors, and as a group in a larger one).

    Example:
        >>> result = PassManager([MarkMutableBuffers(), InplaceToFunctional()],
        ...                      instruments=[SemanticValidation((x, pos))]).run(ep)
        >>> print(result.report)
    """

    _unregistered = True  # built from passes, not from pipeline text

    def __init__(
        self,
        passes: Sequence[Any],
        *,
        instruments: Iterable[Instrumentation] = (),
        strict: bool = False,
        name: str | None = None,
    ):
        for given, role in ((passes, "pass"), (instruments, "instrument")):
            if isinstance(given, (Pass, Instrumentation, str)) or not isinstance(given, Iterable):
                raise PipelineElementError(given, role, "a list of them", (
                    "PassManager takes its passes and instruments as lists: "
                    f"PassManager([a_pass], instruments=[an_instrument]), got {given!r}"))
        self._plan: Plan = build_plan([as_pass(p) for p in passes])
        self.strict = strict
        instruments = list(instruments)
        for instrument in instruments:  # else it failed at its first hook, mid-run
            check_instrument(instrument)
        # The user's hooks run innermost-last: after-hooks run in reverse, so a check that
        # rejects a pass (SemanticValidation) runs before the hooks listed before it see
        # the pass succeed.
        # A Timing given here (it is public) replaces the one every run has: one clock.
        timed = any(isinstance(i, Timing) for i in instruments)
        defaults = [i for i in default_instruments(strict)
                    if not (timed and isinstance(i, Timing))]
        self.instruments: list[Instrumentation] = [*defaults, *instruments]
        self._name = name
        self._lock = threading.RLock()
        self._running = False

    # -- a PassManager is itself a pass, so pipelines nest as groups -------------------
    @property
    def name(self) -> str:
        return self._name or "PassManager[" + ", ".join(p.name for p in self.plan()) + "]"

    @property
    def requires(self) -> frozenset:
        # What no pass of the group provides: the plan puts every provider before its users.
        return frozenset(c for placed in self._plan.placements for c in placed.unprovided)

    @property
    def provides(self) -> frozenset:
        return frozenset().union(*(provides_of(p) for p in self.plan()))

    @property
    def preserves(self) -> frozenset | str:
        named = [preserves_of(p) for p in self.plan() if not preserves_everything(p)]
        return frozenset.intersection(*named) if named else ALL_CONDITIONS

    @property
    def accepts(self) -> tuple[str, ...]:
        forms = [set(p.accepts) for p in self.plan()]
        return tuple(sorted(set.intersection(*forms))) if forms else Pass.accepts

    @property
    def effects(self) -> Effects:
        """What the group may change: everything its passes may (in place if all are)."""
        return functools.reduce(Effects.union, (p.effects for p in self.plan()), Effects(
            rewrites=False, meta_keys=(), edits_meta_in_place=False))

    def call(self, program: Any) -> PassResult:
        result = self._run(program, enclosing=ENCLOSING.get())
        notes = [f"{r.name}: {n}" for r in result.report.records for n in r.notes]
        statistics: dict[str, Any] = {}
        for r in result.report.records:  # a group counts what its passes counted, summed
            for key, value in r.statistics.items():
                statistics[f"{r.name}: {key}"] = statistics.get(f"{r.name}: {key}", 0) + value
        return PassResult(result.program, result.modified, notes, statistics)

    def __repr__(self) -> str:
        return f"PassManager({self.plan()!r})"

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

    def pipeline_text(self) -> str:
        """The plan as text, e.g. ``A,B{strict=true}``; :func:`parse_pipeline` reads it back."""
        return format_pipeline(self.plan())

    # -- running -----------------------------------------------------------------------
    def __call__(self, graph_module: Any) -> TorchPassResult:
        """Torch PassManager compatibility: ``pm(gm) -> torch PassResult``."""
        result = self.run(graph_module)
        return TorchPassResult(result.graph_module, result.modified)

    def run(self, program: Any) -> RunResult | MethodsRunResult:
        """Run the plan on ``program``; return the program (same form) and a report.

        ``{name: program}`` (the methods of one model) runs the pipeline on each in turn,
        the registered joint conditions checked around them (``program_sets``).
        """
        if isinstance(program, Mapping):
            return run_each(self.run, program, self.name)
        return self._run(program)

    def _run(self, program: Any, enclosing: Sequence[Instrumentation] = ()) -> RunResult:
        """A run of the plan; ``enclosing``: the hooks of the pipelines a group runs in.

        One run at a time: the instruments hold the state of the run they are in (the
        report ClaimCheck warns in, SemanticValidation's reference), so a second thread
        running this manager waits instead of mixing two programs' runs."""
        # A group in a strict pipeline is strict too: its passes' effects are checked (and
        # named) in its run, not blamed on the group by the outer one.
        strict = self.strict or any(isinstance(i, ClaimCheck) and i.strict for i in enclosing)
        with self._lock:  # held by this thread already: a pass of this run called it again
            if self._running:  # its instruments would take the inner run's state as theirs
                raise PipelineError(
                    f"{self.name} is already running in this thread: one of its passes ran it "
                    "again, and its instruments hold the outer run's state; run a copy "
                    "(copy.deepcopy(manager)) or another PassManager inside a pass")
            self._running = True
            try:
                return Runner(self.plan(), self.instruments, name=self.name, strict=strict,
                              plan=self.explain(), enclosing=enclosing).run(program)
            finally:
                self._running = False

    # A lock is neither copied nor pickled: a copy (a process's) gets its own.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_running")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.RLock(), _running=False)


def parse_pipeline(text: str, **options: Any) -> PassManager:
    """Build a PassManager from pipeline text; ``options`` are PassManager options.

    Example:
        >>> pm = parse_pipeline("MarkMutableBuffers,ConsumeBufferMutationsInDelegate{strict=true}")
        >>> pm.pipeline_text()
        'MarkMutableBuffers,ConsumeBufferMutationsInDelegate{strict=true}'
    """
    return PassManager(parse_passes(text), **options)
