"""PassManager: plan passes by their conditions, run them transactionally, report.

The manager holds the options and the plan; the loop itself is ``running.Runner``
(require -> snapshot -> call -> measure -> provide), and everything around it is an
instrument: timing, the "unmodified" claim check (``strict``), semantic validation
(``validate``), diff printing (``print_diff``), printing the program around passes
(``print_before`` ...), crash reproducers (``reproducer_dir``) and whatever the user adds.
``pipeline_text()`` prints the plan as text and :func:`parse_pipeline` reads it back.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from .conditions import ALL_CONDITIONS, ConditionSet, preserves_of, provides_of, requires_of
from .effects import Effects
from .errors import PassManagerError, ValidationInputError
from .instruments import Instrumentation, PrintDiff, PrintIR, Reproducer, SemanticValidation
from .methods import MethodsRunResult, check_shared_buffers, share_again, shared_objects
from .pass_base import Pass, PassResult, as_pass
from .pipeline_text import format_pipeline, parse_passes
from .planning import Plan, build_plan
from .running import Runner, RunResult, default_instruments
from .validation import StateReader, call_inputs

__all__ = ["PassManager", "RunResult", "parse_pipeline"]


class PassManager(Pass):
    """Runs passes in dependency order with checked conditions and rollback.

    Args:
        passes: Pass instances, torch ``PassBase`` objects, plain ``gm -> ...`` callables,
            or nested PassManagers (a group, e.g. with its own ``max_iterations``).
        reorder: order by dependencies (default); with False, keep the list order and
            raise PipelineError when a requirement is provided only later.
        strict: a pass that claims "unmodified" but changed the program is an error
            (rolled back) instead of a report warning; and every pass's ``effects`` are
            checked in full: its rollback record is the full snapshot whatever it
            declares, and an edit it does not declare is a typed error (an in-place
            edit of a meta object, MetaEditError; other meta keys or more than meta,
            UndeclaredEditError).
        max_iterations: repeat the pipeline until no pass changes the program, at most
            this many times (1 = run once); hitting the bound is a report warning.
        validate: example inputs (one argument tuple, or one tuple per call) to check
            after every changing pass that the program still computes what it did
            before the pipeline; the first divergence raises SemanticsError. Inputs that
            do not fit the program (the inputs it takes, or the input tree it was
            exported with), or on which the given program already fails, raise
            ValidationInputError (a TypeError) naming the call before any pass runs.
        validation_calls: number of successive calls to compare (default: one per
            input tuple, or 3 for a single tuple).
        atol, rtol: tolerances of that comparison (exact by default).
        validation_state: ``module -> {fqn: tensor}`` reading the state to compare after
            each call (default: the module's named buffers); pass a reader that also sees
            state a delegate owns.
        instruments: extra Instrumentation objects (hooks around every pass).
        print_diff: print a unified diff of the program after every changing pass.
        print_before, print_after: names of passes (or True: every pass) to print the
            program before / after (MLIR's ``-print-ir-before`` / ``-after``).
        print_after_change: print the program after every pass that changed it.
        print_after_failure: print what a failing pass had changed, and the rolled-back
            program.
        print_to: where those go: a text stream (default stdout) or a folder path, one
            file per dump.
        reproducer_dir: when a pass fails, write a reproducer folder under this path
            (the program before the pass, its pipeline text, validation inputs, the error
            and versions); ``python -m pass_manager replay FOLDER`` reruns the pass.

    Example:
        >>> result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep)
        >>> print(result.report)
    """

    _unregistered = True  # built from passes, not from pipeline text

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
        print_before: bool | Iterable[str] = (),
        print_after: bool | Iterable[str] = (),
        print_after_change: bool = False,
        print_after_failure: bool = False,
        print_to: TextIO | str | Path | None = None,
        reproducer_dir: str | Path | None = None,
        name: str | None = None,
    ):
        if max_iterations < 1:
            raise ValueError("max_iterations must be at least 1")
        self._passes = [as_pass(p) for p in passes]
        self._plan: Plan = build_plan(self._passes, reorder=reorder)
        self.strict = strict
        self.max_iterations = max_iterations
        # Validation, diffs and user hooks run innermost-last: after-hooks run in reverse,
        # so a check that rejects a pass runs before the user's hooks see it succeed.
        self.instruments: list[Instrumentation] = [*default_instruments(strict), *instruments]
        if print_diff:
            self.instruments.append(PrintDiff())
        if print_before or print_after or print_after_change or print_after_failure:
            self.instruments.append(PrintIR(
                print_before, print_after, print_after_change, print_after_failure, print_to
            ))
        validation = None
        if validate is not None:
            validation = _validation(validate, validation_calls, atol, rtol, validation_state)
            self.instruments.append(validation)
        if reproducer_dir is not None:
            self.instruments.append(Reproducer(reproducer_dir, validation, strict))
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
            needed |= requires_of(p) - provided
            provided |= provides_of(p)
        return frozenset(needed)

    @property
    def provides(self) -> frozenset:
        return frozenset().union(*(provides_of(p) for p in self.plan()))

    @property
    def preserves(self) -> ConditionSet:
        preserved: ConditionSet = ALL_CONDITIONS
        for p in self.plan():
            preserved = preserved & preserves_of(p)
        return preserved

    @property
    def accepts(self) -> tuple[str, ...]:
        forms = None
        for p in self.plan():
            forms = set(p.accepts) if forms is None else forms & set(p.accepts)
        return tuple(sorted(forms)) if forms is not None else Pass.accepts

    @property
    def effects(self) -> Effects:
        """What the group may change: everything its passes may (in place if all are)."""
        return functools.reduce(Effects.union, (p.effects for p in self.plan()), Effects(
            rewrites=False, meta_keys=(), edits_meta_in_place=False))

    def call(self, program: Any) -> PassResult:
        result = self.run(program)
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
        """The plan as pipeline text, e.g. ``MarkMutableBuffers,InplaceToFunctional``.

        Each pass by its registered name, with its non-default options in braces;
        :func:`parse_pipeline` builds the same pipeline back.
        """
        return format_pipeline(self.plan())

    # -- running -----------------------------------------------------------------------
    def __call__(self, graph_module: Any) -> TorchPassResult:
        """Torch PassManager compatibility: ``pm(gm) -> torch PassResult``."""
        result = self.run(graph_module)
        return TorchPassResult(result.graph_module, result.modified)

    def run(self, program: Any) -> RunResult | MethodsRunResult:
        """Run the plan on ``program``; return the program (same form) and a report.

        ``program`` may also be the methods of one model, ``{name: program}`` sharing
        buffers by fully-qualified name: the methods must agree on every buffer they share
        (shape, dtype, initial value and each registered facet, see
        :mod:`pass_manager.methods`) before the first pass and again after the last, or
        :class:`~pass_manager.methods.SharedBufferError` names the buffer, the methods and
        what differs. The pipeline runs on each method in turn (an error from one says
        which: its ``method`` attribute); the result is a
        :class:`~pass_manager.methods.MethodsRunResult` with each method's RunResult.
        """
        if isinstance(program, Mapping):
            return self._run_methods(program)
        runner = Runner(
            self.plan(),
            self.instruments,
            max_iterations=self.max_iterations,
            name=self.name,
            strict=self.strict,
            plan=self.explain(),
        )
        return runner.run(program)

    def _run_methods(self, programs: Mapping[str, Any]) -> MethodsRunResult:
        if not programs:
            raise ValueError("PassManager.run got an empty mapping of methods")
        for name in programs:
            if not isinstance(name, str):
                raise TypeError(f"method names are strings, got {name!r}")
        check_shared_buffers(programs, "before the pipeline")
        groups = shared_objects(programs)
        results = {}
        for name, program in programs.items():
            try:
                results[name] = self.run(program)
            except PassManagerError as e:
                e.method = name
                done = f" (methods already run: {', '.join(results)})" if results else ""
                e.args = (f"method {name!r}{done}: {e.args[0] if e.args else ''}",
                          *e.args[1:])
                raise
        after = {name: result.program for name, result in results.items()}
        check_shared_buffers(after, f"after {self.name}")
        return MethodsRunResult(results, share_again(after, groups))


_VALIDATE = "PassManager(validate=...)"


def _validation(
    validate: Any, calls: int | None, atol: float, rtol: float, state: StateReader | None
) -> SemanticValidation:
    """The instrument checking ``validate``'s calls; what it is given is checked here (its
    shape) and, before the first pass, against the program (see SemanticValidation)."""
    single = isinstance(validate, (tuple, Mapping))
    if isinstance(validate, (torch.Tensor, str, bytes)) or not isinstance(validate, Iterable):
        example = "(x,)" if isinstance(validate, torch.Tensor) else "(...)"
        raise ValidationInputError(
            _VALIDATE, None,
            f"validate= takes one call's inputs (an argument tuple, an (args, kwargs) pair "
            f"or a keyword mapping) or a list of them, one per call; got a "
            f"{type(validate).__name__}: write validate={example}",
        )
    if not single:
        validate = list(validate)
        if calls is not None and calls > len(validate):
            raise ValidationInputError(
                _VALIDATE, None,
                f"validation_calls={calls} asks for more calls than the {len(validate)} "
                f"given: give {calls} entries, or validation_calls={len(validate)} or less")
    inputs = call_inputs(validate, calls or (3 if single else None))
    labels = ["validate"] * len(inputs) if single else [f"validate[{i}]" for i in
                                                         range(len(inputs))]
    hint = ""
    if not single and validate and not any(
        isinstance(entry, (tuple, list, Mapping)) for entry in validate
    ):
        hint = (" (a list of single values is one call per value; one call's arguments "
                "are a tuple: validate=(x, pos))")
    return SemanticValidation(inputs, atol, rtol, state, option=_VALIDATE, labels=labels,
                              hint=hint)


def parse_pipeline(text: str, **options: Any) -> PassManager:
    """Build a PassManager from pipeline text; ``options`` are PassManager options.

    Example:
        >>> pm = parse_pipeline("MarkMutableBuffers,ConsumeBufferMutationsInDelegate{strict=true}")
        >>> pm.pipeline_text()
        'MarkMutableBuffers,ConsumeBufferMutationsInDelegate{strict=true}'
    """
    return PassManager(parse_passes(text), **options)
