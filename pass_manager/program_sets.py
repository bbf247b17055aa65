"""Several programs that belong together, run by one pipeline: ``{name: program}``.

A model deployed as several methods is such a mapping. ``PassManager.run(mapping)`` runs
the pipeline on each program in turn and checks every registered :class:`JointCondition`
(a condition over all the programs at once) before the first pass and after the last.
The manager knows no such condition itself: a library registers its own
(:func:`register_joint_condition`; ``passes`` registers that methods agree on the buffers
they share).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import PassManagerError
from .report import Report

__all__ = [
    "JointCondition",
    "MethodsRunResult",
    "joint_conditions",
    "register_joint_condition",
    "run_each",
]


class JointCondition:
    """A condition over several programs run by one pipeline.

    ``check`` raises (a :class:`~pass_manager.PassManagerError`) when the programs do not
    meet it; the manager calls it before the first pass and after the last. A pass runs on
    one program at a time and may break what held *between* the programs without breaking
    the condition (e.g. give each its own copy of an object they held as one):
    ``remember`` notes it before the pipeline, ``settle`` restores it after the check and
    returns notes for the result (``MethodsRunResult.notes``).
    """

    name: str = "joint condition"

    def check(self, programs: Mapping[str, Any], when: str) -> None:
        raise NotImplementedError

    def remember(self, programs: Mapping[str, Any]) -> Any:
        return None

    def settle(self, programs: Mapping[str, Any], remembered: Any) -> Mapping[str, Any]:
        return {}


_JOINT: dict[str, JointCondition] = {}


def register_joint_condition(condition: JointCondition) -> None:
    """Check ``condition`` on every ``PassManager.run({name: program})``; registering a
    condition of the same name again replaces it."""
    if not isinstance(condition, JointCondition):
        raise TypeError(f"register_joint_condition: {condition!r} is not a JointCondition")
    _JOINT[condition.name] = condition


def joint_conditions() -> list[JointCondition]:
    """The registered conditions, in registration order."""
    return list(_JOINT.values())


@dataclass
class MethodsRunResult(Mapping):
    """The outcome of a run on several programs: a ``RunResult`` per program, by name
    (``result["decode"].program``), in the mapping's order.

    Attributes:
        results: the per-program ``RunResult``.
        notes: what the joint conditions' ``settle`` reported, merged.
    """

    results: dict[str, Any]
    notes: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.results[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def programs(self) -> dict[str, Any]:
        """The programs, by name (the form each was given in)."""
        return {name: result.program for name, result in self.results.items()}

    @property
    def program(self) -> dict[str, Any]:
        """The same as :attr:`programs`: what ``.program`` is for one program."""
        return self.programs

    @property
    def modified(self) -> bool:
        return any(result.modified for result in self.results.values())

    @property
    def reports(self) -> dict[str, Report]:
        return {name: result.report for name, result in self.results.items()}

    def __str__(self) -> str:
        return "\n".join(f"method {name!r}:\n{result.report}"
                         for name, result in self.results.items())


def run_each(run: Callable[[Any], Any], programs: Mapping[str, Any],
             pipeline: str) -> MethodsRunResult:
    """``run`` on each program in turn, the joint conditions checked around all of them.

    An error from one program says which (its ``method`` attribute, and the message).
    Only the conditions are checked across programs: a pipeline that fails on the second
    leaves the first as the pipeline made it.
    """
    if not programs:
        raise ValueError("PassManager.run got an empty mapping of methods")
    for name in programs:
        if not isinstance(name, str):
            raise TypeError(f"method names are strings, got {name!r}")
    conditions = joint_conditions()
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
    for condition in conditions:
        condition.check(after, f"after {pipeline}")
    notes: dict[str, Any] = {}
    for condition, memory in zip(conditions, remembered, strict=True):
        notes.update(condition.settle(after, memory))
    return MethodsRunResult(results, notes)
