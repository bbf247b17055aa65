"""The rollback record: what a pass may change, recorded before it runs.

One interface for the core loop: :func:`take` records a program for a pass's
:class:`~pass_manager.effects.Effects` -> :meth:`RollbackRecord.check` (the pass kept its
declaration) and :meth:`RollbackRecord.compare` (what it changed) -> :meth:`RollbackRecord.restore`
(undo it). Behind it, two variants:

* :class:`~.meta_keys.MetaKeysSnapshot` for a pass that changes only some node-meta keys
  (:meth:`Effects.only_meta`): those entries, the nodes and their fields;
* :class:`~.snapshot.Snapshot` for anything else: nodes, meta (all of it, or only the
  declared keys of a rewrite that names them), modules, tensors (their data only for a pass
  that writes state) and an ExportedProgram's signature, state and call graph.

``strict`` takes the full snapshot whatever the declaration, and checks all of it.

:func:`transaction` is the same record for code that changes a program outside the core
loop (a pass's ``call`` invoked directly): it records and restores on failure, unless the
core loop already holds a record of that program (:func:`recorded`), so a pass never
needs an undo log of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..effects import Effects
from ..errors import EffectsError
from .meta_keys import MetaKeysSnapshot, undeclared_edits
from .snapshot import Change, Snapshot

__all__ = ["Change", "RollbackRecord", "recorded", "take", "transaction"]


class RollbackRecord:
    """A program recorded for one pass: check its declaration, measure, restore."""

    def __init__(self, program: Any, effects: Effects, strict: bool):
        self.effects = effects
        self.strict = strict
        self._written: list[str] = []
        if effects.meta_only and not strict:
            self._record: Any = MetaKeysSnapshot(program, effects.meta_keys)
        else:
            self._record = Snapshot(
                program,
                copy_state=effects.writes_state,
                copy_meta_values=effects.edits_meta_in_place or strict,
                meta_keys=None if strict else effects.meta_keys,
            )

    @property
    def leaves_nodes_alone(self) -> bool:
        """The pass changes only node meta other than the fake values: nothing a cached
        analysis's stamp measures (so the checks around it can share one measurement)."""
        return isinstance(self._record, MetaKeysSnapshot) and "val" not in self.effects.meta_keys

    def measured(self, program: Any, after: bool) -> tuple[Any, list | None, list | None]:
        """``program``'s graph and the node records this record took of it (before the
        pass, or after it once :meth:`compare` measured them; None when it did not), for
        the analysis cache (``analysis.unchanged``)."""
        return self._record.measured(program, after)

    # -- after the pass ----------------------------------------------------------------
    def check(self, pass_name: str, index: int, result: Any) -> None:
        """Raise the typed error of a broken declaration (what the record can see)."""
        effects = self.effects
        self._written = self._record.written()
        if self._written and not effects.writes_state:
            raise EffectsError(pass_name, index, "writes_state", self._written)
        if not effects.edits_meta_in_place and self.strict:
            edited = self._record.edited_in_place()
            if edited:
                raise EffectsError(pass_name, index, "edits_meta_in_place", edited)
        if effects.meta_keys is None:
            return
        if isinstance(self._record, MetaKeysSnapshot):
            edits = self._record.added_or_removed_nodes(result)
        elif self.strict:
            edits = undeclared_edits(self._record, result, effects)
        else:
            edits = []
        if edits:
            raise EffectsError(pass_name, index, "meta_keys", edits)

    def compare(self, result: Any, claimed_modified: bool | None) -> Change:
        """What the pass changed (after :meth:`check`)."""
        if isinstance(self._record, MetaKeysSnapshot) and claimed_modified:
            # A meta-only pass that says it changed something is taken at its word: the
            # comparison would only check claims of "no change", and there is no
            # recompile to decide (at worst, cached conditions are dropped needlessly).
            return Change(False, True)
        return self._record.compare(result, self._written)

    # -- undo ------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The program as it was, as text (for the diff a failure shows)."""
        return self._record.text

    def unrestorable_changes(self) -> list[str]:
        return self._record.unrestorable_changes()

    def restore(self) -> None:
        self._record.restore()


def take(program: Any, effects: Effects, strict: bool = False) -> RollbackRecord:
    """Record ``program`` for a pass declaring ``effects``."""
    return RollbackRecord(program, effects, strict)


# The programs the core loop holds a record of while their pass runs (by identity: the
# record is of that very object).
_RECORDED: ContextVar[tuple[Any, ...]] = ContextVar("recorded_programs", default=())


@contextmanager
def recorded(program: Any) -> Iterator[None]:
    """Mark ``program`` as held by a rollback record while the block runs."""
    token = _RECORDED.set((*_RECORDED.get(), program))
    try:
        yield
    finally:
        _RECORDED.reset(token)


@contextmanager
def transaction(program: Any, effects: Effects) -> Iterator[None]:
    """Leave ``program`` as it was if the block raises: the core loop's record when it holds
    one of ``program``, else one taken here (restored, then the error re-raised)."""
    if any(held is program for held in _RECORDED.get()):
        yield
        return
    record = take(program, effects)
    try:
        yield
    except BaseException:
        record.restore()
        raise
