"""Effects: the one declaration of what a pass may change.

A pass sets ``effects`` once; the core loop picks the rollback record from it (recording
only what the pass may change) and checks the parts a cheaper record cannot see under
``PassManager(strict=True)``. The common cases are one line::

    effects = Effects.only_meta("mutable_buffer")   # marks or annotates nodes, nothing else
    effects = Effects.rewrite()                     # rewrites the graph, replaces meta entries
    effects = Effects.rewrite(in_place=False)       # returns a new program, input untouched
    effects = Effects.rewrite(meta_keys=())         # rewrites; existing nodes' meta untouched

A pass that declares nothing gets ``Effects()``: it may change anything but tensor data,
edit meta objects in place, and returns the program it was given. A plain function or a
torch ``PassBase`` in a pipeline gets :meth:`Effects.anything`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Effects"]


@dataclass(frozen=True)
class Effects:
    """What a pass may change.

    Attributes:
        rewrites: the program beyond its nodes' meta: nodes and their arguments, modules,
            the graph module's meta, an ExportedProgram's signature and state. False: the
            pass changes node meta (and, with ``writes_state``, tensor data) only.
        meta_keys: the keys of existing nodes' meta the pass may set, replace or remove;
            None: any key. New nodes' meta is the pass's own either way.
        edits_meta_in_place: whether it may edit an object held in node meta in place (a
            field of a quantization annotation, a list it appends to) instead of replacing
            the entry; only then are such objects copied for a rollback.
        writes_state: whether it writes tensor data (buffer contents) in place; only then is
            the data copied for a rollback.
        in_place: True: returns the program it was given (rewritten or not); False: returns a
            new program when it changes something and leaves its input untouched; None:
            either (not checked).
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

    # -- the common cases ----------------------------------------------------------------
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
        keys = None if meta_keys is None else frozenset(meta_keys)
        return cls(True, keys, False, writes_state, in_place)

    @classmethod
    def anything(cls) -> Effects:
        """Nothing is known: it may change anything, tensor data included, and return its
        input or a new program (a plain function or torch ``PassBase`` in a pipeline)."""
        return cls(writes_state=True, in_place=None)

    # -- combining -----------------------------------------------------------------------
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
        fields = []
        defaults = Effects()
        for name in ("rewrites", "meta_keys", "edits_meta_in_place", "writes_state", "in_place"):
            value = getattr(self, name)
            if value != getattr(defaults, name):
                shown = sorted(value) if isinstance(value, frozenset) else value
                fields.append(f"{name}={shown!r}")
        return f"Effects({', '.join(fields)})"
