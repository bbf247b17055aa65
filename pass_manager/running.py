"""The core loop: for each planned pass, require -> record -> call -> measure -> provide.

The program's form is decided once, where it enters (:meth:`Runner.run`). The checks share
the rollback record's measurement of the nodes (``analysis.unchanged``). Everything else
is an instrument. This module does not know the Pass class (``pass_base`` uses it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from contextvars import ContextVar
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._export.verifier import SpecViolationError, _verify_exported_program_signature
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from ._rollback import RollbackRecord, recorded
from .analysis import Stamp, edited_fields, unchanged
from .conditions import (
    Condition,
    as_condition_set,
    preserves_everything,
    preserves_of,
    provides_of,
    requires_of,
)
from .effects import Effects
from .errors import (
    EffectsError,
    InstrumentError,
    PassFailedError,
    PassManagerError,
    PostconditionError,
    PreconditionError,
    ProgramFormError,
)
from .instruments import ClaimCheck, Instrumentation, Timing
from .pipeline_text import registered_passes
from .program import (
    EXPORTED_PROGRAM,
    GRAPH_MODULE,
    graph_module_of,
    node_count,
    pass_diff,
    program_form,
)
from .report import PassRecord, PassResult, Report

__all__ = ["ENCLOSING", "RunResult", "Runner", "default_instruments"]

# What an instrument's hook may be undone with: the program's nodes, their meta entries and
# everything outside the graph (an instrument writing tensor data is not measured).
_OBSERVED = Effects.rewrite()

# The hooks around the pass being called: a group's passes run under them (MLIR nesting).
ENCLOSING: ContextVar[tuple[Instrumentation, ...]] = ContextVar("enclosing", default=())


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
    """Which known passes provide ``condition``: said to a pipeline without one, or to the
    pass ``alone`` (its repr) called by itself."""
    found = set()
    for cls in registered_passes(collect=True):
        try:
            if condition in as_condition_set(cls.__dict__.get("provides", ())):
                found.add(cls.__name__)
        except TypeError:  # its provides is not a set of conditions
            continue
    names = sorted(found)
    if not names:
        return f"No known pass provides {condition.name}."
    if alone is not None:
        return (
            f"This pass was called alone, so nothing in its run provides "
            f"{condition.name}: run {' or '.join(names)} on the program first, or both in one "
            f"pipeline: PassManager([{names[0]}(), {alone}]).run(program)."
        )
    return f"No pass in this pipeline provides it; add one of: {', '.join(names)}."


# How to turn the form a pass refused into the other one.
_FORM_ADVICE = {
    EXPORTED_PROGRAM: "pass its .module()",
    GRAPH_MODULE: "pass the ExportedProgram it came from (torch.export.export)",
}


def _unpack(out: Any, program: Any, exported: bool
            ) -> tuple[Any, bool | None, list[str], dict[str, Any]]:
    """A pass's return value -> (program, claimed modified, notes, statistics)."""
    if isinstance(out, TorchPassResult):
        if not isinstance(out.graph_module, torch.fx.GraphModule):
            raise TypeError(f"a pass returned a torch PassResult holding a "
                            f"{type(out.graph_module).__name__}, not a GraphModule")
        if exported and out.graph_module is not program.graph_module:
            return program._update(out.graph_module, program.graph_signature), out.modified, [], {}
        out = PassResult(out.graph_module, out.modified)
    elif out is None or isinstance(out, (torch.fx.GraphModule, torch.export.ExportedProgram)):
        out = PassResult(program if out is None else out)
    if not isinstance(out, PassResult):
        raise TypeError(f"a pass returned {type(out).__name__}, not a PassResult, program or None")
    # Read later: a note per letter, a count no number, "no" as a claim of a change, and a
    # count of 0 as no claim of "unmodified" (``0 is not False``): named here instead.
    notes, statistics, claim = out.notes, out.statistics, out.modified
    if (isinstance(notes, str) or not isinstance(notes, (list, tuple))
            or not isinstance(statistics, Mapping)
            or not all(isinstance(v, (int, float)) for v in statistics.values())
            or not isinstance(claim, (int, type(None)))):
        raise TypeError(f"a pass returned modified={claim!r}, notes={notes!r}, "
                        f"statistics={statistics!r}: modified is a bool or None; notes are a "
                        "list of strings, statistics {description: number}")
    # An ExportedProgram's own graph module stands for it (a plain function gets only that).
    new = program if out.program is graph_module_of(program) else out.program
    return new, None if claim is None else bool(claim), list(notes), dict(statistics)


def _unchanged(record: Any, program: Any, after: bool) -> Any:
    """The analysis cache takes ``program`` as unchanged, measured as ``record`` did."""
    return unchanged(*record.measured(program, after))


def _call_spec_fault(program: Any) -> str | None:
    """Why ``ep.module()`` could not take or return the values the signature lists, or None:
    the call spec flattens a call into exactly the USER_INPUT placeholders and builds the
    result from exactly the USER_OUTPUT values (torch's signature check looks at neither,
    and a pass adding an output without its out_spec fails at the program's first call, as
    a pytree length error)."""
    in_spec, out_spec = program.call_spec
    signature = program.graph_signature
    counts = [
        ("input", "in_spec", in_spec,
         [s.kind for s in signature.input_specs].count(InputKind.USER_INPUT)),
        ("output", "out_spec", out_spec,
         [s.kind for s in signature.output_specs].count(OutputKind.USER_OUTPUT)),
    ]
    for what, name, spec, listed in counts:
        if spec is not None and spec.num_leaves != listed:
            return (f"its signature lists {listed} user {what}(s) but its call spec "
                    f"({name}, module_call_graph[0].signature) has {spec.num_leaves}: update "
                    f"both, or ep.module() cannot be called")
    return None


def _check_pytree_codegen(graph: torch.fx.Graph) -> None:
    """Raise if the pytree specs of ``graph``'s code (``ep.module()``'s) no longer fit it:
    its call is flattened into exactly its placeholders and its result built from exactly
    its output's values (else its first call fails, a pytree length error)."""
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None:
        return
    for what, count, name, spec in (
            ("placeholders", len(graph.find_nodes(op="placeholder")), "in_spec", info.in_spec),
            ("output values", len(pytree.tree_leaves(graph.output_node().args[0])), "out_spec",
             info.out_spec)):
        if spec is not None and spec.num_leaves != count:
            raise RuntimeError(f"it has {count} {what} but its code's {name} "
                               f"(graph._codegen.pytree_info) has {spec.num_leaves}: update both")


def _misnamed(program: Any) -> set[tuple[str, str]]:
    """``(name in the signature, name of the node in its place)`` of each input and output
    the signature names otherwise than the graph does."""
    signature, graph = program.graph_signature, program.graph
    pairs = [*zip(signature.input_specs, graph.find_nodes(op="placeholder"), strict=False),
             *zip(signature.output_specs, graph.output_node().args[0], strict=False)]
    return {(spec.arg.name, node.name) for spec, node in pairs if isinstance(node, torch.fx.Node)
            and getattr(spec.arg, "name", node.name) != node.name}


def _signature_fault(program: Any, misnamed: set[tuple[str, str]]) -> str | None:
    """What torch's check of an ExportedProgram's signature finds wrong with it, or None;
    asked only if the counts of inputs and outputs or the state's names disagree (it is
    quadratic in the mutated buffers). Names are compared here, but for those ``misnamed``
    in the program given (torch's deepcopy renames an input called ``input``; the passes
    pair inputs with specs by position)."""
    call_fault = _call_spec_fault(program)
    if call_fault:
        return call_fault
    renamed = sorted(_misnamed(program) - misnamed)
    if renamed:  # torch.export.save, ep.validate() and to_edge would reject it, naming no pass
        return "; ".join(f"its signature names {name!r} where the graph has node {node!r}"
                         for name, node in renamed) + " (rename it in both)"
    signature, graph = program.graph_signature, program.graph
    if (len(graph.find_nodes(op="placeholder")) == len(signature.input_specs)
            and len(graph.output_node().args[0]) == len(signature.output_specs)
            and {s.target for s in signature.input_specs} - {None}
            <= program.state_dict.keys() | program.constants.keys()):
        return None
    try:
        _verify_exported_program_signature(program)
    except SpecViolationError as e:
        return str(e)
    return None


def _notify(instruments: Iterable[Instrumentation], hook: str, around: tuple[Any, int | None],
            *args: Any, undo: RollbackRecord | None = None) -> None:
    """Call ``hook`` on each instrument; what one raises but a PassManagerError (a verdict,
    as ClaimCheck's) is a bug in it: an InstrumentError naming it, the hook and the pass. So
    is a change to the program's nodes or signature (an instrument observes: a change the
    pass's record does not cover would be reported as the pass's, or as none), undone first
    with ``undo`` (the record of the program taken before the hook) or, if that cannot put
    back a signature (a meta-only record), with a record taken here. A failure hook that
    breaks does not silence the others (a Reproducer after a broken printer still writes its
    folder): the first error is raised once every instrument has had its hook."""
    program = args[0] if hook.endswith("_run") else args[1]
    stamp, first = None, None
    for instrument in instruments:
        if stamp is None and type(instrument) not in (Timing, ClaimCheck):
            stamp = Stamp(program)
            if undo is None or not undo.records_state:
                undo = RollbackRecord(program, _OBSERVED)
        error = None
        try:
            getattr(instrument, hook)(*args)
        except PassManagerError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - a bug in the instrument: named, raised below
            error = _broken(instrument, hook, around, f"{type(e).__name__}: {e}",
                            stamp, program, undo)
            error.__cause__ = e
        if error is None and stamp is not None and not stamp.matches(program):
            error = _broken(instrument, hook, around, "nothing, but changed the program's "
                            "nodes or signature; an instrument observes (its change was undone)",
                            stamp, program, undo)
        if error is not None and hook != "after_pass_failed":
            raise error
        first = first or error
    if first is not None:
        raise first


def _broken(instrument: Instrumentation, hook: str, around: tuple[Any, int | None],
            reason: str, stamp: Stamp | None, program: Any, undo: Any) -> InstrumentError:
    """The InstrumentError of a hook that raised or changed the program, the change undone."""
    error = InstrumentError(type(instrument).__name__, hook, *around, reason)
    if stamp is not None and not stamp.matches(program):
        undo.restore()
        error.rolled_back = True
    return error


def _error_statistics(error: BaseException) -> dict[str, Any]:
    """Statistics an exception carries (``error.statistics``), or its cause's."""
    for e in (error, error.__cause__):
        if isinstance(getattr(e, "statistics", None), dict):
            return e.statistics
    return {}


@dataclass(eq=False)  # one Runner per run, compared by identity
class Runner:
    """Runs passes in the given order, checked and transactional; one Runner per run.

    ``name`` is the pipeline's (in an error about the program given), ``plan`` its
    explanation (for the report), ``start`` the place of the first pass (a replay runs one
    pass under its original number), ``strict`` checks every pass's effects in full, and
    ``alone`` says the one pass was called by itself (errors say so).
    """

    passes: Sequence[Any]
    instruments: Sequence[Instrumentation]
    _: KW_ONLY
    name: str = "PassManager"
    plan: str = ""
    start: int = 0
    strict: bool = False
    alone: bool = False
    enclosing: Sequence[Instrumentation] = ()  # a group's: the pipelines' it runs in

    def run(self, program: Any) -> RunResult:
        try:
            self.form = program_form(program)
        except TypeError as e:
            advice = ("export it first (torch.export.export(module, example_args)) and pass "
                      "the ExportedProgram or its .module()"
                      if isinstance(program, torch.nn.Module) else "")
            raise ProgramFormError(
                self.name, None, type(program).__name__, [GRAPH_MODULE, EXPORTED_PROGRAM], advice
            ) from e
        self.exported = self.form == EXPORTED_PROGRAM
        self.misnamed = _misnamed(program) if self.exported else set()
        self._form_type = torch.export.ExportedProgram if self.exported else torch.fx.GraphModule
        self.holds: set[Condition] = set()  # the conditions known to hold
        # A condition that held until a changing pass did not preserve it: that pass.
        self.dropped_by: dict[Condition, str] = {}
        report = Report(plan=self.plan, strict=self.strict)
        # Around each pass: the enclosing runs' hooks (a group's), then this run's own.
        self.hooks = [*self.enclosing, *(i for i in self.instruments if i not in self.enclosing)]
        _notify(self.instruments, "before_run", (None, None), program, report)
        for index, p in enumerate(self.passes, self.start):
            record = PassRecord(p.name, index)
            try:
                program = self._run_pass(p, index, program, record)
            except PassManagerError as e:
                # The report so far, ending with the failed pass, travels with the
                # error (the outermost pipeline's, when groups nest).
                report.records.append(record)
                e.report = report
                raise
            report.records.append(record)
        _notify(reversed(self.instruments), "after_run", (None, None), program, report)
        return RunResult(program, any(r.modified for r in report.records), report)

    # -- one pass ----------------------------------------------------------------------
    def _run_pass(self, p: Any, index: int, program: Any, record: PassRecord) -> Any:
        taken = rollback = None
        current = program
        try:
            # The record after the hooks: what an instrument left (a meta entry) is not the pass's.
            _notify(self.hooks, "before_pass", (p.name, index), p, program, record)
            taken = RollbackRecord(program, p.effects, self.strict)
            record.nodes_before = node_count(program)
            # The checks share the node records the rollback record took; a pass that
            # leaves the nodes alone runs inside that one measurement too.
            through = taken.leaves_nodes_alone
            with _unchanged(taken, program, False) if through else nullcontext():
                with nullcontext() if through else _unchanged(taken, program, False):
                    self._require(p, index, program, record, taken)
                rollback = taken  # from here on, a failure restores the program
                with recorded(program):
                    current = self._call(p, index, program, record)
                rollback.check(p.name, index, current)
                self._measure(p, index, program, current, rollback, record)
                with nullcontext() if through else _unchanged(rollback, current, True):
                    self._provide(p, index, current, record)
            _notify(reversed(self.hooks), "after_pass", (p.name, index), p, current, record,
                    undo=rollback)
            return current
        except Exception as e:
            error = self._failed(p, index, program, current, rollback, record, e)
            if error is e:
                raise
            raise error from e
        except BaseException:  # Ctrl-C mid-rewrite (or mid-check): the program as it was,
            if taken is not None:  # the interrupt kept
                taken.restore()
            raise

    def _failed(self, p: Any, index: int, program: Any, current: Any, rollback: Any,
                record: PassRecord, e: Exception) -> PassManagerError:
        """The typed error of a failed pass, after the rollback and the failure hooks."""
        error = e if isinstance(e, PassManagerError) else PassFailedError(
            p.name, index, f"{type(e).__name__}: {e}"
        )
        error._from_runner = True
        record.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        record.statistics = dict(_error_statistics(e) or record.statistics)
        if rollback is not None:
            if not error.diff:  # of the program given, if the pass returned no program of its form
                shown = current if isinstance(current, self._form_type) else program
                error.diff = pass_diff(rollback.text, shown, p.name)
            error.unrestored = sorted(set(error.unrestored)
                                      | set(rollback.unrestorable_changes()))
            rollback.restore()
            error.rolled_back = True
        try:
            _notify(reversed(self.hooks), "after_pass_failed", (p.name, index), p, program,
                    record, error, undo=rollback)
        except InstrumentError as broken:  # raised with the pass's own error as its cause
            broken.rolled_back, broken.diff = error.rolled_back or broken.rolled_back, error.diff
            raise broken from error
        return error

    def _call(self, p: Any, index: int, program: Any, record: PassRecord) -> Any:
        """Run the pass; its result program, with its claim, notes and statistics recorded."""
        token = ENCLOSING.set(tuple(self.hooks))
        try:
            out = p.call(program)
        except Exception as e:
            if getattr(e, "_from_runner", False):  # a nested pipeline named its failing pass
                e.within.append((p.name, index))
                raise
            raise PassFailedError(p.name, index, f"{type(e).__name__}: {e}") from e
        finally:
            ENCLOSING.reset(token)
        current, record.claimed_modified, record.notes, record.statistics = _unpack(
            out, program, self.exported)
        return current

    def _require(self, p: Any, index: int, program: Any, record: PassRecord,
                 undo: RollbackRecord) -> None:
        if self.form not in p.accepts:
            raise ProgramFormError(p.name, index, self.form, p.accepts, _FORM_ADVICE[self.form])
        failed = self._check(requires_of(p), program, record, undo)
        if failed:
            condition, violations = failed
            provided_here = any(condition in provides_of(q) for q in self.passes)
            hint = "" if provided_here else _providers_hint(
                condition, repr(p) if self.alone else None)
            if condition in self.dropped_by:
                hint = (f"It held until pass {self.dropped_by[condition]}, which changed the "
                        "program and does not list it in preserves: that pass broke it, or "
                        f"{p.name} must run before it. {hint}").rstrip()
            raise PreconditionError(p.name, index, condition.name, violations, hint=hint)

    def _measure(self, p: Any, index: int, program: Any, new_program: Any, rollback: Any,
                 record: PassRecord) -> None:
        if new_program is not program and not isinstance(new_program, self._form_type):
            raise PassFailedError(p.name, index, f"returned a {type(new_program).__name__} "
                                  f"for the {self.form} it was given: a pass returns its form")
        in_place = p.effects.in_place
        if in_place is True and new_program is not program:
            raise EffectsError(p.name, index, "in_place", reason=(
                "declares in_place = True (in its effects) but returned a different program "
                "object; a pass returning a new program declares "
                "effects = Effects.rewrite(in_place=False)"))
        change = rollback.compare(new_program, record.claimed_modified)
        record.modified = change.anything
        if in_place is False and new_program is program and record.modified:
            raise EffectsError(p.name, index, "in_place", reason=(
                "declares in_place = False (returns a new program) but changed the program "
                "it was given"))
        for changed in change.checked:
            try:  # a node used before it is defined, one of another graph, a missing attribute
                changed.graph.lint()
                _check_pytree_codegen(changed.graph)
            except RuntimeError as e:  # else the program's first call fails, naming no pass
                raise PassFailedError(p.name, index, f"left an ill-formed graph: {e}") from e
        for stale in change.structure:
            stale.recompile()
        fault = (_signature_fault(new_program, self.misnamed) if self.exported
                 and change.anything else None)
        if fault:  # e.g. a buffer deleted from the state, an input added to the graph alone
            raise PassFailedError(p.name, index, "left the ExportedProgram's signature out of "
                                  f"step with its graph or state: {fault}")
        record.nodes_after = node_count(new_program)

    def _provide(self, p: Any, index: int, program: Any, record: PassRecord) -> None:
        if record.modified and not preserves_everything(p):
            kept = preserves_of(p)
            self.dropped_by.update(dict.fromkeys(self.holds - kept, f"#{index} {p.name}"))
            self.holds &= kept
        checked = provides_of(p)
        if record.modified and self.strict:  # what it claims to preserve is checked, not trusted
            checked, self.holds = checked | self.holds, set()
        failed = self._check(checked, program, record)
        if failed:
            condition, violations = failed
            hint = "" if condition in provides_of(p) else f"{p.name} declares it preserves it."
            raise PostconditionError(p.name, index, condition.name, violations, hint=hint)

    def _check(self, conditions: Iterable[Condition], program: Any, record: PassRecord,
               undo: RollbackRecord | None = None) -> tuple[Condition, list[str]] | None:
        """Check each condition not known to hold; the first violated one and its violations.
        A check observes: one that changes the program's nodes is a PassFailedError, its
        change undone with ``undo`` (before the pass) or with the pass's rollback (after it)."""
        for condition in sorted(conditions, key=lambda c: c.name):
            if condition in self.holds:
                record.cached.append(condition.name)
                continue
            start = time.perf_counter()
            graph = graph_module_of(program).graph
            # Nodes by identity (a C loop); their fields as edited (every node's, strict).
            nodes = list(graph.nodes)
            raised = None
            with edited_fields(graph, exact=self.strict) as edited:
                try:
                    violations = condition.check(program)
                except Exception as e:  # noqa: BLE001 - named below, after its change is undone
                    raised = e
            record.check_time += time.perf_counter() - start
            record.checked.append(condition.name)
            changed = list(graph_module_of(program).graph.nodes) != nodes or edited()
            if raised is not None or changed:
                what = (f"raised {type(raised).__name__}: {raised}" if raised is not None
                        else "changed the program's nodes; a check observes")
                undone = "its change was undone; " if changed else ""
                error = PassFailedError(record.name, record.index, (
                    f"the check of condition {condition.name!r} {what} ({undone}a bug in the "
                    "condition's check, not in the pass)"))
                if changed and undo is not None:
                    undo.restore()
                    error.rolled_back = True
                raise error from raised
            if violations:
                return condition, violations
            self.holds.add(condition)
        return None
