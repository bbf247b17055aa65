"""Effects: the one declaration of what a pass may change.

The core loop records only what a pass may change for its rollback and checks the parts a
cheaper record cannot see under ``PassManager(strict=True)``. The common cases are one line
(``Effects.only_meta("tag")``, ``Effects.rewrite()``, ``Effects.rewrite(in_place=False)``;
the table in docs/pass-manager.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

__all__ = ["Effects"]


@dataclass(frozen=True)
class Effects:
    """What a pass may change.

    Attributes:
        rewrites: the program beyond its nodes' meta (nodes, arguments, modules, the graph
            module's meta, an ExportedProgram's signature and state).
        meta_keys: the keys of existing nodes' meta it may set, replace or remove (None:
            any); new nodes' meta is the pass's own either way.
        edits_meta_in_place: it may edit an object held in node meta in place instead of
            replacing the entry (only then are such objects copied for a rollback).
        writes_state: it writes tensor data in place (only then is it copied).
        in_place: True: returns the program it was given; False: returns a new program
            when it changes something, its input untouched; None: either (not checked).
    """

    rewrites: bool = True
    meta_keys: frozenset[str] | None = None
    edits_meta_in_place: bool = True
    writes_state: bool = False
    in_place: bool | None = True

    def __post_init__(self) -> None:
        if self.meta_keys is not None:
            if isinstance(self.meta_keys, str):
                raise TypeError(f"meta_keys takes a collection of keys, got {self.meta_keys!r}")
            object.__setattr__(self, "meta_keys", frozenset(self.meta_keys))
        if self.in_place not in (True, False, None):
            raise TypeError(f"in_place is True, False or None, got {self.in_place!r}")

    @classmethod
    def only_meta(cls, *keys: str) -> Effects:
        """Sets, replaces or removes the node meta entries ``keys`` and changes nothing else
        (a marking or annotating pass): a rollback records those entries only."""
        return cls(rewrites=False, meta_keys=frozenset(keys), edits_meta_in_place=False)

    @classmethod
    def rewrite(
        cls,
        *,
        meta_keys: Iterable[str] | None = None,
        writes_state: bool = False,
        in_place: bool | None = True,
    ) -> Effects:
        """Rewrites the graph; meta entries are replaced (``node.meta[key] = new``), never
        edited in place. ``meta_keys``: the only keys of existing nodes' meta it touches
        (``()``: none; new nodes get their own meta)."""
        return cls(True, meta_keys, False, writes_state, in_place)  # frozenset: __post_init__

    @classmethod
    def anything(cls) -> Effects:
        """Nothing is known: it may change anything, tensor data included, and return its
        input or a new program (a plain function or torch ``PassBase`` in a pipeline)."""
        return cls(writes_state=True, in_place=None)

    def union(self, other: Effects) -> Effects:
        """What a group of two passes may change: everything either may; in place only if
        both are (a group of passes returning new programs is not checked)."""
        keys = (None if self.meta_keys is None or other.meta_keys is None
                else self.meta_keys | other.meta_keys)
        in_place = True if self.in_place is True and other.in_place is True else None
        return Effects(
            self.rewrites or other.rewrites, keys,
            self.edits_meta_in_place or other.edits_meta_in_place,
            self.writes_state or other.writes_state, in_place,
        )

    @property
    def meta_only(self) -> bool:
        """Only the declared node meta keys change: nothing a node-meta record misses."""
        return not self.rewrites and not self.writes_state and self.meta_keys is not None

    def __repr__(self) -> str:
        if self.meta_only and not self.edits_meta_in_place:
            return f"Effects.only_meta({', '.join(map(repr, sorted(self.meta_keys)))})"
        shown = [f"{f.name}={sorted(v) if isinstance(v, frozenset) else v!r}"
                 for f in fields(self) if (v := getattr(self, f.name)) != f.default]
        return f"Effects({', '.join(shown)})"
