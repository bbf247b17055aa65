"""Conditions: named, checkable properties of a program, and what a pass declares of them.

A condition is one object: equal only to itself, so a user's own ``Condition("Functional",
...)`` is never mistaken for the built-in one (a plan holding both is a PipelineError).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "ALL_CONDITIONS",
    "Condition",
    "as_condition_set",
    "preserves_everything",
    "preserves_of",
    "provides_of",
    "requires_of",
]


class Condition:
    """A named property of a program; ``check(program)`` returns the violations, each a
    string naming the node (or buffer, or signature entry) at fault, empty when it holds.

    Example:
        >>> no_dead_code = Condition(
        ...     "NoDeadCode",
        ...     lambda gm: [n.name for n in graph_of(gm).nodes if is_dead(n)],
        ...     doc="Every call_function node has a user.",
        ... )
    """

    __slots__ = ("_check", "doc", "name")

    def __init__(self, name: str, check: Callable[[Any], Iterable[str]], doc: str = ""):
        if not name or not isinstance(name, str):
            raise TypeError("Condition needs a non-empty string name")
        if not callable(check):
            raise TypeError(f"Condition {name!r}: check must be callable, got {check!r}")
        self.name = name
        self._check = check
        self.doc = doc

    def check(self, program: Any) -> list[str]:
        found = self._check(program)
        # read as violations: a list of letters, none, or (a check that forgot to return) none
        if found is None or isinstance(found, (str, bool)):
            raise TypeError(f"check returned {found!r}, not the violations: a list of strings, "
                            "empty when the condition holds")
        return [str(v) for v in (found or ())]

    def holds(self, program: Any) -> bool:
        return not self.check(program)

    def __repr__(self) -> str:
        return f"Condition({self.name!r})"

    def __str__(self) -> str:
        return self.name


# ``preserves = ALL_CONDITIONS`` is a flag, not a set: the pass changes only what no
# condition reads, so every condition holds after it as before.
ALL_CONDITIONS = "everything"


def as_condition_set(conditions: Iterable[Condition] | Condition | None) -> frozenset:
    """Normalize a declaration (None, a single Condition, or an iterable) to a frozenset."""
    if conditions is None:
        return frozenset()
    if isinstance(conditions, Condition):
        return frozenset([conditions])
    if isinstance(conditions, str):
        raise TypeError(f"expected Condition objects, got the string {conditions!r} (only "
                        f"preserves takes {ALL_CONDITIONS!r})")
    result = frozenset(conditions)
    for item in result:
        if not isinstance(item, Condition):
            raise TypeError(f"expected Condition objects, got {item!r}")
    return result


def preserves_everything(pass_: Any) -> bool:
    return isinstance(pass_.preserves, str) and pass_.preserves == ALL_CONDITIONS


def requires_of(pass_: Any) -> frozenset:
    return as_condition_set(pass_.requires)


def provides_of(pass_: Any) -> frozenset:
    return as_condition_set(pass_.provides)


def preserves_of(pass_: Any) -> frozenset:
    """The conditions a pass names in ``preserves`` (none for ALL_CONDITIONS, a flag)."""
    return frozenset() if preserves_everything(pass_) else as_condition_set(pass_.preserves)
