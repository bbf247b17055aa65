"""Conditions: named, checkable properties of a program.

A condition's ``check(program)`` returns the violations it found, each a string naming
the node (or buffer, or signature entry) at fault. An empty list means the condition
holds. A condition is one object: two conditions are equal only if they are the same
object, so a user's own ``Condition("Functional", ...)`` is never mistaken for the
built-in one (a plan holding both is a PipelineError, see ``planning``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "ALL_CONDITIONS",
    "EVERYTHING",
    "Condition",
    "as_condition_set",
    "preserves_everything",
    "preserves_of",
    "provides_of",
    "requires_of",
]

CheckFn = Callable[[Any], Iterable[str]]


class Condition:
    """A named property of a program; equal only to itself.

    Example:
        >>> no_dead_code = Condition(
        ...     "NoDeadCode",
        ...     lambda gm: [n.name for n in graph_of(gm).nodes if is_dead(n)],
        ...     doc="Every call_function node has a user.",
        ... )
    """

    __slots__ = ("_check", "doc", "name")

    def __init__(self, name: str, check: CheckFn, doc: str = ""):
        if not name or not isinstance(name, str):
            raise TypeError("Condition needs a non-empty string name")
        if not callable(check):
            raise TypeError(f"Condition {name!r}: check must be callable, got {check!r}")
        self.name = name
        self._check = check
        self.doc = doc

    def check(self, program: Any) -> list[str]:
        """Return the violations of this condition on ``program`` (empty when it holds)."""
        violations = self._check(program)
        return [str(v) for v in (violations or ())]

    def holds(self, program: Any) -> bool:
        return not self.check(program)

    def __repr__(self) -> str:
        return f"Condition({self.name!r})"

    def __str__(self) -> str:
        return self.name


# ``preserves = "everything"``: a flag, not a set: the pass leaves every condition as it
# found it (it changes only what no condition reads). ALL_CONDITIONS is its name.
EVERYTHING = ALL_CONDITIONS = "everything"


def as_condition_set(conditions: Iterable[Condition] | Condition | None) -> frozenset:
    """Normalize a declaration (None, a single Condition, or an iterable) to a frozenset."""
    if conditions is None:
        return frozenset()
    if isinstance(conditions, Condition):
        return frozenset([conditions])
    if isinstance(conditions, str):
        raise TypeError(f"expected Condition objects, got the string {conditions!r} (only "
                        f"preserves takes {EVERYTHING!r})")
    result = frozenset(conditions)
    for item in result:
        if not isinstance(item, Condition):
            raise TypeError(f"expected Condition objects, got {item!r}")
    return result


def preserves_everything(pass_: Any) -> bool:
    """Whether a pass declares ``preserves = "everything"``."""
    return isinstance(pass_.preserves, str) and pass_.preserves == EVERYTHING


def requires_of(pass_: Any) -> frozenset:
    """What a pass (anything with the Pass attributes) requires, as a condition set."""
    return as_condition_set(pass_.requires)


def provides_of(pass_: Any) -> frozenset:
    return as_condition_set(pass_.provides)


def preserves_of(pass_: Any) -> frozenset:
    """The conditions a pass names in ``preserves`` (none for "everything", a flag)."""
    return frozenset() if preserves_everything(pass_) else as_condition_set(pass_.preserves)
