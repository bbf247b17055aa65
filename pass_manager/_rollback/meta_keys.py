"""The snapshot of a pass that declares it edits only some node-meta keys.

A pass that only annotates (marks state, rewrites quantization annotations) declares
``Effects.only_meta(keys)``: the meta keys it may set, replace or remove, and nothing else
of the program. A rollback then needs only those entries, one list per key: recording every
module, tensor and node field (:class:`~pass_manager._rollback.snapshot.Snapshot`) would cost more
than such a pass. The node list and the nodes' fields (what the analysis stamps of the
checks around the pass measure anyway) are kept too, so a pass breaking its declaration by
adding or removing nodes gets a typed error and the graph back. The rest of the
declaration is trusted, as ``edits_meta_in_place`` is; ``PassManager(strict=True)`` takes
the full snapshot and checks all of it instead (:func:`undeclared_edits`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..program import graph_module_of, program_text
from .copying import MISSING
from .snapshot import Change, GraphRecord

__all__ = ["MetaKeysSnapshot", "undeclared_edits"]


class MetaKeysSnapshot:
    """The entries ``keys`` of every node's meta (by reference), the nodes and their fields.

    Offers what the core loop uses of a :class:`~pass_manager._rollback.snapshot.Snapshot`.
    """

    def __init__(self, program: Any, keys: frozenset[str]):
        self.program = program
        self._gm = graph_module_of(program)
        self._graph = GraphRecord(self._gm.graph, copy_values=False, meta_keys=keys)

    def measured(self, program: Any, after: bool) -> tuple[torch.fx.Graph, list, list | None]:
        """The graph, its nodes and (before the pass) their fields, for the stamps of the
        checks and of the pass's own cached analyses (``analysis.unchanged``)."""
        record = self._graph
        return graph_module_of(program).graph, record._nodes, None if after else record._fields

    def written(self) -> list[str]:
        return []  # tensors are not recorded: the declaration says none are touched

    def edited_in_place(self) -> list[str]:
        return []

    def added_or_removed_nodes(self, program: Any) -> list[str]:
        """Nodes the pass added or removed (what this record cannot undo)."""
        graph, recorded = graph_module_of(program).graph, self._graph._nodes
        if not self._graph.nodes_changed(graph):
            return []
        nodes = list(graph.nodes)
        before, after = set(recorded), set(nodes)
        return sorted([f"added {n.name}" for n in nodes if n not in before]
                      + [f"removed {n.name}" for n in recorded if n not in after]
                      or ["the graph object was replaced"])

    def compare(self, program: Any, written: list[str] | None = None) -> Change:
        return Change(False, self._graph.meta_changed() or program is not self.program)

    def unrestorable_changes(self) -> list[str]:
        return []  # nodes added or removed: the graph is rebuilt from the recorded nodes

    @property
    def text(self) -> str:
        """The program as it was (its code changes only if the pass broke its declaration)."""
        if not self._graph.nodes_changed(self._gm.graph):
            return program_text(self.program)
        text = str(self._graph.rebuild())
        signature = getattr(self.program, "graph_signature", None)
        return text if signature is None else f"{text}\n{signature}"

    def restore(self) -> None:
        rebuild = self._graph.nodes_changed(self._gm.graph)
        self._graph.restore_entries()
        if rebuild:  # after the metas: the rebuilt nodes get copies of them as restored
            self._gm.graph = self._graph.rebuild()
            self._gm.recompile()


def undeclared_edits(snapshot: Any, program: Any, effects: Any) -> list[str]:
    """What a pass changed besides what its ``effects`` declare (the meta keys of existing
    nodes; for a pass that does not rewrite, anything else at all), measured against a full
    :class:`~pass_manager._rollback.snapshot.Snapshot` (``strict`` mode)."""
    keys = effects.meta_keys
    found = []
    graph = graph_module_of(program).graph
    structure_changed = graph_module_of(program) is not snapshot._gm or (
        snapshot._graph.structure_changed(graph))
    if structure_changed and not effects.rewrites:
        found.append("the graph's nodes or their arguments")
    else:
        present = set(graph.nodes) if structure_changed else None
        for node, recorded in zip(snapshot._graph._nodes, snapshot._graph._meta, strict=True):
            if present is not None and node not in present:
                continue
            now = node.meta
            others = (now.keys() | recorded.keys()) - keys
            if any(now.get(k, MISSING) is not recorded.get(k, MISSING) for k in others):
                found.append(f"{node.name}: meta keys other than {sorted(keys)}")
    if snapshot.written() and not effects.writes_state:
        found.append("tensor data: " + ", ".join(snapshot.written()))
    if not effects.rewrites and snapshot.outside_nodes_changed(program):
        found.append("the graph module's meta, its modules or the program's signature or state")
    return found
