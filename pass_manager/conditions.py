"""Conditions: named, checkable properties of a program.

A condition's ``check(program)`` returns the violations it found, each a string naming
the node (or buffer, or signature entry) at fault. An empty list means the condition
holds. Conditions are compared by name, so two modules that declare the same property
agree on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ALL_CONDITIONS", "Condition", "as_condition_set"]

CheckFn = Callable[[Any], Iterable[str]]


class Condition:
    """A named property of a program.

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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Condition) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("Condition", self.name))

    def __repr__(self) -> str:
        return f"Condition({self.name!r})"

    def __str__(self) -> str:
        return self.name


class _AllConditions(frozenset):
    """Marker for ``preserves``: the pass leaves every condition as it found it."""

    def __contains__(self, item: object) -> bool:
        return isinstance(item, Condition)

    def __repr__(self) -> str:
        return "ALL_CONDITIONS"


ALL_CONDITIONS: frozenset = _AllConditions()


def as_condition_set(conditions: Iterable[Condition] | None) -> frozenset:
    """Normalize a declaration (None, a single Condition, or an iterable) to a frozenset."""
    if conditions is None:
        return frozenset()
    if isinstance(conditions, _AllConditions):
        return conditions
    if isinstance(conditions, Condition):
        return frozenset([conditions])
    result = frozenset(conditions)
    for item in result:
        if not isinstance(item, Condition):
            raise TypeError(f"expected Condition objects, got {item!r}")
    return result
