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
    "Condition",
    "ConditionSet",
    "as_condition_set",
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


class _AllConditions:
    """``preserves = ALL_CONDITIONS``: the pass leaves every condition as it found it.

    It is the set of all conditions, not an empty set: ``ALL | s`` is ``ALL``, ``ALL & s``
    is ``s``, ``s - ALL`` is empty. Operations whose result has no finite spelling
    (``ALL - s``, ``ALL ^ s``, iterating, ``len``) raise TypeError rather than guess.
    """

    _instance: _AllConditions | None = None

    def __new__(cls) -> _AllConditions:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __contains__(self, item: object) -> bool:
        return isinstance(item, Condition)

    def __bool__(self) -> bool:
        return True

    @staticmethod
    def _other(other: object) -> frozenset | _AllConditions | None:
        if isinstance(other, _AllConditions):
            return other
        if isinstance(other, (set, frozenset)):
            return frozenset(other)
        return None

    def __or__(self, other: object) -> _AllConditions:
        return self if self._other(other) is not None else NotImplemented

    __ror__ = __or__

    def __and__(self, other: object) -> frozenset | _AllConditions:
        other = self._other(other)
        return NotImplemented if other is None else other

    __rand__ = __and__

    def __rsub__(self, other: object) -> frozenset:
        return frozenset() if self._other(other) is not None else NotImplemented

    def __sub__(self, other: object) -> _AllConditions:
        if isinstance(other, (set, frozenset)) and not other:
            return self
        raise TypeError("ALL_CONDITIONS minus a set has no finite spelling")

    def __xor__(self, other: object) -> Any:
        raise TypeError("ALL_CONDITIONS ^ a set has no finite spelling")

    __rxor__ = __xor__

    def __iter__(self) -> Any:
        raise TypeError("ALL_CONDITIONS cannot be iterated: it stands for every condition")

    def __len__(self) -> int:
        raise TypeError("ALL_CONDITIONS has no length: it stands for every condition")

    def issuperset(self, other: Iterable[Condition]) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True if self._other(other) is not None else NotImplemented

    def __le__(self, other: object) -> bool:
        if self._other(other) is None:
            return NotImplemented
        return isinstance(other, _AllConditions)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _AllConditions)

    def __hash__(self) -> int:
        return hash(_AllConditions)

    def __repr__(self) -> str:
        return "ALL_CONDITIONS"

    def __reduce__(self) -> str:
        return "ALL_CONDITIONS"


ALL_CONDITIONS = _AllConditions()

# What requires / provides / preserves normalize to.
ConditionSet = frozenset | _AllConditions


def as_condition_set(conditions: Iterable[Condition] | Condition | None) -> ConditionSet:
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


def requires_of(pass_: Any) -> ConditionSet:
    """What a pass (anything with the Pass attributes) requires, as a condition set."""
    return as_condition_set(pass_.requires)


def provides_of(pass_: Any) -> ConditionSet:
    return as_condition_set(pass_.provides)


def preserves_of(pass_: Any) -> ConditionSet:
    return as_condition_set(pass_.preserves)
