"""What the main job found: checks, per-step errors, pass reports, and a failure's summary.

A :class:`FlowResult` fills up stage by stage; when a stage fails, :class:`FlowError`
carries the partial result and a short summary (stage, pass, node, reason) read from the
error chain, so the command line prints a few lines and what was done so far instead of a
traceback.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pass_manager import PostconditionError, PreconditionError, Report
from pass_manager.validation import Trace, first_difference

__all__ = ["Check", "Failure", "FlowError", "FlowInterrupted", "FlowResult", "check_same",
           "failure_of", "restricted"]


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Failure:
    """Where the flow stopped and why, in a few words each."""

    stage: str
    reason: str
    pass_name: str | None = None
    node: str | None = None
    reproducer: str | None = None  # the folder a --reproducer-dir run wrote
    reproducer_error: str | None = None  # why --reproducer-dir could not write one
    method: str | None = None  # of several methods, the one the pass failed on

    def lines(self) -> list[str]:
        lines = [f"stage:  {self.stage}"]
        if self.method:
            lines.append(f"method: {self.method}")
        if self.pass_name:
            lines.append(f"pass:   {self.pass_name}")
        if self.node:
            lines.append(f"node:   {self.node}")
        lines.append(f"reason: {self.reason}")
        if self.reproducer:
            lines.append(f"reproducer: {self.reproducer} (rerun it: {_replay_command(self)})")
        elif self.reproducer_error:
            lines.append(f"reproducer: not written: {self.reproducer_error}")
        return lines


@dataclass
class FlowResult:
    plan: str = ""
    dot: str = ""
    notes: list[str] = field(default_factory=list)
    reports: list[tuple[str, Report]] = field(default_factory=list)
    delegate_summary: list[str] = field(default_factory=list)
    # caches owned by the cache-update-only partitioner's delegates (see passes.flow)
    cache_update_delegation: dict[str, Any] = field(default_factory=dict)
    step_errors: dict[str, list[float]] = field(default_factory=dict)
    buffer_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    failure: Failure | None = None
    # the stage (and call) Ctrl-C stopped, when it did: the result holds what ran before it
    interrupted: str | None = None
    # quantize_program's report (passes.quantization.QuantizationReport), when quantized
    quantization: Any = None
    # --quantize-state: per buffer dtype and bytes before/after, totals, planned .pte bytes
    state_storage: dict[str, Any] = field(default_factory=dict)
    # (stage title, seconds) in the order the stages ran
    stage_times: list[tuple[str, float]] = field(default_factory=list)
    # what the passes changed, in a few measured lines (the report's first section)
    bought: list[str] = field(default_factory=list)
    # what each column of the decode table is, by column name
    column_notes: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.failure is None and self.interrupted is None
                and all(c.passed for c in self.checks))

    def pass_table(self) -> str:
        merged = Report()
        for stage, report in self.reports:
            for record in report.records:
                merged.records.append(copy.copy(record))
                # One numbering over the stages: '#' is the pass's row in this table.
                merged.records[-1].index = len(merged.records) - 1
                merged.records[-1].name = f"{stage}: {record.name}"
            merged.warnings += report.warnings
        return merged.table()

    def slowest_stages(self, count: int = 3) -> list[str]:
        """The ``count`` slowest stages with their share of the flow's time."""
        total = sum(seconds for _, seconds in self.stage_times) or 1.0
        ranked = sorted(self.stage_times, key=lambda item: item[1], reverse=True)[:count]
        return [f"{title}: {seconds:.1f} s ({seconds / total:.0%})" for title, seconds in ranked]

    def decode_table(self) -> str:
        names = list(self.step_errors)
        widths = [max(len(n), 10) for n in names]
        header = "step  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))
        steps = max((len(v) for v in self.step_errors.values()), default=0)
        rows = []
        for s in range(steps):
            cells = [
                f"{errors[s]:>{w}.6f}" if s < len(errors) else " " * w
                for errors, w in zip(self.step_errors.values(), widths, strict=True)
            ]
            rows.append(f"{s:>4}  " + "  ".join(cells))
        lines = ["max abs output error vs fp32 eager, per decode step", header, *rows]
        explained = [(n, self.column_notes[n]) for n in names if n in self.column_notes]
        if explained:
            lines += ["columns:", *(f"  {name}: {note}" for name, note in explained)]
        if self.buffer_errors:
            lines.append("state: the worst buffer's max abs difference from fp32 eager over "
                         "all steps, relative to its largest fp32 value")
        for name, errors in self.buffer_errors.items():
            worst = max(errors, key=errors.get, default=None)
            if worst is not None:
                lines.append(f"  {name}: {errors[worst]:.2%} ({worst})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "plan": self.plan,
            "notes": self.notes,
            "passes": {stage: report.to_dict() for stage, report in self.reports},
            "delegates": self.delegate_summary,
            "cache_update_delegation": self.cache_update_delegation,
            "step_errors": self.step_errors,
            "buffer_errors": self.buffer_errors,
            "quantization": None if self.quantization is None else {
                key: value for key, value in self.quantization.to_dict().items()
                if key != "passes"  # already under "passes", by stage
            },
            "state_storage": self.state_storage,
            "stage_seconds": dict(self.stage_times),
            "what_the_passes_bought": self.bought,
            "checks": [c.__dict__ for c in self.checks],
            "failure": None if self.failure is None else self.failure.__dict__,
            "interrupted": self.interrupted,
            "ok": self.ok,
        }


class FlowError(Exception):
    """A stage of the flow failed; ``result`` holds what the stages before it found."""

    def __init__(self, failure: Failure, result: FlowResult):
        self.failure = failure
        self.result = result
        super().__init__("; ".join(failure.lines()))


class FlowInterrupted(KeyboardInterrupt):
    """Ctrl-C arrived during a stage: still a KeyboardInterrupt (whoever catches those stops
    as before), carrying the stage it stopped and ``result``, what the stages before it found."""

    def __init__(self, stage: str, result: FlowResult):
        self.stage = stage
        self.result = result
        result.interrupted = stage
        super().__init__(stage)


def _replay_command(failure: Failure) -> str:
    """The command the reproducer's manifest gives (with ``--trust`` when its files need
    it), or the general one when the manifest cannot be read."""
    try:
        manifest = json.loads((Path(failure.reproducer) / "manifest.json").read_text())
        return str(manifest["replay"])
    except (OSError, ValueError, KeyError, TypeError):
        return "python -m pass_manager replay FOLDER [--trust]"


def _chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _node_name(value: Any) -> str | None:
    if isinstance(value, torch.fx.Node):
        return value.name
    return value if isinstance(value, str) and value else None


# What an error's ``reason`` is about, which its message names before the reason and the
# report's node line does not: a buffer, a partition, a carried input's name, an argument.
_SUBJECTS = (("buffer", "buffer {!r}"), ("partition", "partition {!r}"),
             ("tag", "partition {!r}"), ("name", "{!r}"), ("argument", "{}"))


def _subject(error: BaseException, reason: str) -> str:
    """``"buffer 'b', partition 'delegate_0': "`` for an error whose ``reason`` alone says
    only "its tensor shares storage with 'a'"; empty when the reason names them already."""
    # A name counts as said only quoted, as messages quote names: buffer 'a' is not said
    # by a reason holding the letter a.
    named = [form.format(value) for attribute, form in _SUBJECTS
             if isinstance(value := getattr(error, attribute, None), str) and value
             and (value if form == "{}" else repr(value)) not in reason]
    return f"{', '.join(named)}: " if named else ""


def failure_of(stage: str, error: BaseException) -> Failure:
    """Read the pass, node and reason out of an error and the errors it was raised from.

    The library's errors carry them as attributes (``pass_name``, ``node``, ``reason``,
    ``violations``); the innermost error gives the reason, else its type and first line.
    """
    chain = _chain(error)
    pass_name = next((e.pass_name for e in chain if getattr(e, "pass_name", None)), None)
    nodes = [_node_name(getattr(e, "node", None)) for e in chain]
    node = next((n for n in nodes if n), None)
    if node is None:
        violations = next((e.violations for e in chain if getattr(e, "violations", None)), [])
        node = violations[0] if violations else None
    innermost = chain[-1]
    said = getattr(innermost, "reason", None)
    said = _subject(innermost, said) + said if said else _first_line(innermost)
    if isinstance(innermost, (PreconditionError, PostconditionError)):
        # Its first line ends in "violation(s):"; the node line shows the first of them, and
        # the hint (which pass provides the condition) is what the user does next.
        said = (f"{innermost.kind} {innermost.condition!r} does not hold "
                f"({len(innermost.violations)} violation(s))"
                + (f"; {innermost.hint}" if innermost.hint else ""))
    reason = f"{type(innermost).__name__}: {said}"
    if "Guard failed" in reason:
        reason += (
            " (the program was exported for the example's shapes; a factory gives other shapes "
            "per call with 'dynamic_shapes')"
        )
    if any(said in reason for said in ("Expecting input to have dtype torch.float32",  # torchao
                                       "convert the model with .float() before export")):  # ours
        reason += (" (pt2e quantization takes float32 models: convert the model with .float() "
                   "in the factory, or run with --skip-quantization)")
    reproducer = next((e.reproducer for e in chain if getattr(e, "reproducer", None)), None)
    unwritten = next((e.reproducer_error for e in chain if getattr(e, "reproducer_error", None)),
                     None)
    method = next((e.method for e in chain if isinstance(getattr(e, "method", None), str)), None)
    return Failure(stage, reason, pass_name, node, str(reproducer) if reproducer else None,
                   unwritten, method)


def restricted(trace: Trace, names: set[str]) -> Trace:
    """The trace with only the buffers named (outputs and inputs as they are)."""
    buffers = [{n: v for n, v in state.items() if n in names} for state in trace.buffers]
    return Trace(trace.outputs, buffers, trace.inputs)


def check_same(result: FlowResult, name: str, expected: Trace, actual: Trace) -> None:
    """Add a check to ``result``: ``actual`` equals ``expected`` exactly."""
    difference = first_difference(expected, actual)
    result.checks.append(Check(name, difference is None, difference or "outputs and buffers equal"))
