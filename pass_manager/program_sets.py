"""Several programs that belong together (the methods of one model), run by one pipeline.

The manager knows no condition over them itself: a library registers its own
:class:`JointCondition` (``passes`` registers that methods agree on the buffers they share).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .errors import PassManagerError, ProgramFormError
from .program import EXPORTED_PROGRAM, GRAPH_MODULE
from .report import Report

__all__ = [
    "JointCondition",
    "MethodsRunResult",
    "register_joint_condition",
    "run_each",
]


class JointCondition:
    """A condition over several programs run by one pipeline.

    ``check`` raises a :class:`~pass_manager.PassManagerError` when the programs do not meet
    it (called before the first pass and after the last). ``join`` runs before that last
    check, for what one program's pass decides for the others. What held *between* the programs
    and a pass may break (one object they held, now a copy each) ``remember`` notes before
    the pipeline and ``settle`` restores after the check, returning notes for the result.
    ``amend`` then rewrites what each program's run result says, where ``join`` changed a
    program after the passes recorded it alone.
    """

    name: str = "joint condition"

    def check(self, programs: Mapping[str, Any], when: str) -> None:
        raise NotImplementedError

    def remember(self, programs: Mapping[str, Any]) -> Any:
        return None

    def join(self, programs: Mapping[str, Any]) -> Mapping[str, Any]:
        """After the pipeline ran on each program alone, before the check: carry over to
        the others what a pass decided in one program that they must follow (and could not
        decide alone); returns notes for the result."""
        return {}

    def settle(self, programs: Mapping[str, Any], remembered: Any) -> Mapping[str, Any]:
        return {}

    def amend(self, results: Mapping[str, Any], joined: Mapping[str, Any]) -> None:
        """Last, with each program's run result (``.program``, ``.report``, ``.modified``)
        and the notes this condition's ``join`` returned: make the results say what the
        programs now are. A pass's record describes the program it saw alone; what ``join``
        changed after it (the record's notes, statistics, node count, ``modified``) is
        only the condition's to restate, and every run of the mapping needs it restated."""


_JOINT: dict[str, JointCondition] = {}


def register_joint_condition(condition: JointCondition) -> None:
    """Check ``condition`` on every ``PassManager.run({name: program})``; registering a
    condition of the same name again replaces it."""
    if not isinstance(condition, JointCondition):
        raise TypeError(f"register_joint_condition: {condition!r} is not a JointCondition")
    _JOINT[condition.name] = condition


class MethodsRunResult(dict):
    """A ``RunResult`` per program, by name (``result["decode"].program``), in the mapping's
    order; ``notes``: what the joint conditions' ``join`` and ``settle`` reported, merged."""

    def __init__(self, results: Mapping[str, Any], notes: dict[str, Any] | None = None):
        super().__init__(results)
        self.notes = notes or {}

    @property
    def programs(self) -> dict[str, Any]:
        """The programs, by name (the form each was given in)."""
        return {name: result.program for name, result in self.items()}

    program = programs  # what ``.program`` is for one program

    @property
    def modified(self) -> bool:
        return any(result.modified for result in self.values())

    @property
    def reports(self) -> dict[str, Report]:
        return {name: result.report for name, result in self.items()}

    def __str__(self) -> str:
        return "\n".join(f"method {name!r}:\n{result.report}"
                         for name, result in self.items())


def run_each(run: Callable[[Any], Any], programs: Mapping[str, Any],
             pipeline: str) -> MethodsRunResult:
    """``run`` on each program in turn, the joint conditions checked around all of them; an
    error from one program says which (its ``method`` attribute, and the message). A
    pipeline that fails on the second program leaves the first as the pipeline made it."""
    if not programs or not all(isinstance(name, str) for name in programs):
        got = "mapping of no methods" if not programs else f"mapping named by {list(programs)}"
        raise ProgramFormError(pipeline, None, got, [GRAPH_MODULE, EXPORTED_PROGRAM,
                                                     "{method name (a string): program}"])
    conditions = list(_JOINT.values())  # in registration order
    for condition in conditions:
        condition.check(programs, "before the pipeline")
    remembered = [condition.remember(programs) for condition in conditions]
    results = {}
    for name, program in programs.items():
        try:
            results[name] = run(program)
        except PassManagerError as e:
            e.method = name
            done = f" (methods already run: {', '.join(results)})" if results else ""
            e.args = (f"method {name!r}{done}: {e.args[0] if e.args else ''}", *e.args[1:])
            raise
    after = {name: result.program for name, result in results.items()}
    notes: dict[str, Any] = {}
    joined = []
    for condition in conditions:
        joined.append(condition.join(after))
        notes.update(joined[-1])
    for condition in conditions:
        condition.check(after, f"after {pipeline}")
    for condition, memory in zip(conditions, remembered, strict=True):
        notes.update(condition.settle(after, memory))
    for condition, said in zip(conditions, joined, strict=True):
        condition.amend(results, said)
    return MethodsRunResult(results, notes)
