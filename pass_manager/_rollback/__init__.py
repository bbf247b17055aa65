"""The rollback record: what a pass may change, recorded before it runs.

:class:`RollbackRecord` records a program for a pass's :class:`~pass_manager.effects.Effects`;
it then checks the declaration (:meth:`RollbackRecord.check`), measures what changed by
identity (:meth:`~RollbackRecord.compare`) and undoes it (:meth:`~RollbackRecord.restore`).
It records what the declaration allows: for a pass that changes only some node-meta keys
(``Effects.only_meta``), those entries, the nodes and their fields; for any other, the nodes
and their meta (:mod:`.graph`) and everything outside the graph (:mod:`.state`), tensor data
only for a pass that writes state. ``strict`` records everything and checks all of it.

:func:`transaction` is the same record for code that changes a program outside the core
loop (a pass's ``call`` invoked directly), unless the core loop already holds one of that
program (:func:`recorded`): a pass never needs an undo log of its own.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

from ..collector import collector_paused
from ..effects import Effects
from ..errors import EffectsError
from ..program import graph_module_of, graph_modules, graphs_text
from .graph import GraphRecord
from .state import StateRecord

__all__ = ["Change", "RollbackRecord", "recorded", "transaction"]


class Change(NamedTuple):
    """What a pass changed: ``structure``, the graph modules whose nodes changed (their code
    is stale), ``anything`` at all, and ``checked``, the graph modules whose nodes may no
    longer fit the program (``structure``, or every one if a module's attributes changed:
    a ``get_attr`` of a deleted buffer)."""

    structure: list[torch.fx.GraphModule]
    anything: bool
    checked: Sequence[torch.fx.GraphModule] = ()


class RollbackRecord:
    """A program recorded for one pass: check its declaration, measure, restore.

    Tensor data is copied only for a pass declaring ``writes_state``, or under ``strict`` (a
    KV cache is not cloned before every pass; parameters' data only under ``strict``): a
    tensor written without a copy is listed by :meth:`unrestorable_changes`, never silently
    kept. Meta objects are copied only for a
    pass that may edit them in place (``edits_meta_in_place``, or ``strict``).
    """

    def __init__(self, program: Any, effects: Effects, strict: bool = False):
        self.program = program
        self.effects = effects
        self.strict = strict
        self._written: list[str] = []
        gm = graph_module_of(program)
        # The rest of a meta-only declaration is trusted, as in-place edits are.
        meta_only = effects.meta_only and not strict
        # Thousands of small records, none in a cycle (a meta-only record gains nothing).
        with nullcontext() if meta_only else collector_paused():
            graphs = graph_modules(gm)
            self._names = [name for name, _ in graphs]
            self._graphs = [GraphRecord(m, effects.edits_meta_in_place or strict,
                                        None if strict else effects.meta_keys, copy_shared=strict)
                            for _, m in graphs]
            self._graph = self._graphs[0]
            copy_data = effects.writes_state or strict
            # Under strict, parameters' data too: a write through ``p.data`` leaves no mark.
            self._state = None if meta_only else StateRecord(program, gm, copy_data, strict)

    @property
    def records_state(self) -> bool:
        """It can put back everything outside the graph (not a meta-only record)."""
        return self._state is not None

    @property
    def leaves_nodes_alone(self) -> bool:
        """The pass changes only node meta other than the fake values: nothing a cached
        analysis's stamp measures (so the checks around it can share one measurement)."""
        return self._state is None and "val" not in self.effects.meta_keys

    def measured(self, program: Any, after: bool) -> tuple[torch.fx.Graph, list | None,
                                                           list | None]:
        """``program``'s graph, its nodes and their fields as this record measured them
        (before the pass, or after it once :meth:`compare` did), for ``analysis.unchanged``."""
        graph = graph_module_of(program).graph
        record = self._graph
        if not after:
            return graph, record.nodes, record.fields
        if record.after is not None and graph is record.graph:
            return graph, *record.after
        return graph, None, None

    # -- after the pass ----------------------------------------------------------------
    def check(self, pass_name: str, index: int, result: Any) -> None:
        """Raise the typed error of a broken declaration (what the record can see)."""
        effects = self.effects
        self._written = [] if self._state is None else self._state.tensors.written()
        if self._written and not effects.writes_state:
            raise EffectsError(pass_name, index, "writes_state", self._written)
        if self.strict and not effects.edits_meta_in_place:
            edited = self._graph.edited_in_place()
            if edited:
                raise EffectsError(pass_name, index, "edits_meta_in_place", edited)
        if effects.meta_keys is None:
            return
        if self._state is None:
            edits = self._added_or_removed_nodes(result)
        else:
            edits = self._undeclared_edits(result) if self.strict else []
        if edits:
            raise EffectsError(pass_name, index, "meta_keys", edits)

    def _added_or_removed_nodes(self, result: Any) -> list[str]:
        """Nodes a meta-only pass added to or removed from any graph (restored by rebuilding
        it)."""
        found = []
        for record in self._graphs:
            graph = graph_module_of(result).graph if record is self._graph else record.gm.graph
            if record.nodes_changed(graph):
                nodes, recorded = list(graph.nodes), record.nodes
                before, after = set(recorded), set(nodes)
                found += sorted([f"added {n.name}" for n in nodes if n not in before]
                                + [f"removed {n.name}" for n in recorded if n not in after]
                                or ["the graph object was replaced"])
        return found

    def _undeclared_edits(self, result: Any) -> list[str]:
        """What a pass changed besides the meta keys of existing nodes it declares (and, if
        it does not rewrite, anything else at all): checked by ``strict``."""
        effects, record = self.effects, self._graph
        gm = graph_module_of(result)
        structure_changed = gm is not record.gm or any(
            g.structure_changed(g.gm.graph) for g in self._graphs)
        if structure_changed and not effects.rewrites:
            found = ["the graph's nodes or their arguments"]
        else:
            present = set(gm.graph.nodes) if structure_changed else None
            found = record.other_meta_edits(effects.meta_keys, present)
        if not effects.rewrites and (record.module_meta_changed() or self._state.changed(result)):
            found.append("the graph module's meta, its modules or the program's signature or "
                         "state")
        return found

    def compare(self, result: Any, claimed_modified: bool | None) -> Change:
        """What the pass changed (after :meth:`check`)."""
        if self._state is None:
            # A meta-only pass that says it changed something is taken at its word: the
            # comparison would only check claims of "no change", and there is no
            # recompile to decide (at worst, cached conditions are dropped needlessly).
            return Change([], bool(claimed_modified) or result is not self.program
                          or any(g.meta_changed() for g in self._graphs))
        gm = graph_module_of(result)
        with collector_paused():
            stale = [gm] if gm is not self._graph.gm else [
                g.gm for g in self._graphs if g.structure_changed(g.gm.graph)]
            attributes = self._state.modules.changed()
            checked = [m for _, m in graph_modules(result)] if attributes else stale
            return Change(stale, bool(stale) or bool(self._written) or attributes
                          or self._state.changed(result, modules=False)
                          or any(g.meta_changed() for g in self._graphs), checked)

    # -- undo ------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The program as it was, as text (rendered only for the diff a failure shows)."""
        text = graphs_text(zip(self._names, map(GraphRecord.rebuild, self._graphs), strict=True))
        signature = (getattr(self.program, "graph_signature", None) if self._state is None
                     else self._state.signature_as_recorded())
        return text if signature is None else f"{text}\n{signature}"

    def unrestorable_changes(self) -> list[str]:
        """Tensors written in place whose old data was not copied, so cannot come back."""
        return [] if self._state is None else self._state.tensors.unrestorable()

    def restore(self) -> None:
        if self._state is not None:
            self._state.restore()
        for graph in self._graphs:
            graph.restore(rebuild=self._state is not None)


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
    if any(map(operator.is_, _RECORDED.get(), itertools.repeat(program))):
        yield
        return
    record = RollbackRecord(program, effects)
    try:
        yield
    except BaseException:
        record.restore()
        raise
