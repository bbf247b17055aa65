"""Snapshot: what a rollback needs, and the measure of whether a pass changed anything.

A snapshot is taken before every pass. It records the nodes (by reference, with a copy of
their meta's mutable containers), every module's attributes, every tensor's identity and
version counter (its data only when the pass declares ``writes_state``), the graph
module's meta and, for an ExportedProgram, its signature, state, constants and call
graph. A pass that names the meta keys it touches on existing nodes
(``Effects.rewrite(meta_keys=...)``) gets only those entries recorded, not a copy of
every node's meta. After the pass, :meth:`Snapshot.compare` tells whether the structure changed
(a recompile is needed) and whether anything changed at all, by identity checks against
those records: no node is printed or hashed. :meth:`Snapshot.restore` undoes the pass.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, NamedTuple

import torch
from torch.export import ExportedProgram

from ..analysis import equal, node_fields
from ..collector import collector_paused
from ..program import graph_module_of, modules_of
from .copying import MISSING, copy_value, is_container, meta_entries, same
from .export_state import ObjectsRecord, SignatureRecord
from .state import TENSOR, ModulesRecord, TensorsRecord, same_dicts

__all__ = ["Change", "GraphRecord", "Snapshot"]

# Meta entries that hold values or provenance: kept by reference (the meta dict itself
# is copied, so replacing them is still undone). Passes replace these, never edit them in
# place; copying the module stacks of every node was most of a snapshot's cost.
_SHARED_META = frozenset(
    {
        "val",
        "nn_module_stack",
        "source_fn_stack",
        "fwd_nn_module_stack",
        "fwd_source_fn_stack",
        "tensor_meta",
        "example_value",
        "stack_trace",
        "from_node",
        "seq_nr",
        "torch_fn",
        "original_aten",
        "unbacked_bindings",
    }
)


class GraphRecord:
    """The nodes of a graph as plain records; a graph is rebuilt from them only on demand.

    Per node: the node, its fields and its meta entries, by reference (built and compared
    in C loops); with ``copy_values``, also copies of the mutable objects its meta holds
    (the objects a pass may edit in place), else none. With ``meta_keys`` (the only keys a
    pass may change on existing nodes), the meta dicts are kept by reference and only
    those entries are recorded.
    """

    def __init__(self, graph: torch.fx.Graph, copy_values: bool = True,
                 meta_keys: frozenset[str] | None = None):
        self.graph = graph
        self.after: tuple[list, list] | None = None  # the nodes and fields compared last
        self._tracer_cls = graph._tracer_cls
        self._codegen = copy.copy(graph._codegen)
        nodes = list(graph.nodes)
        self._nodes = nodes
        self._fields = node_fields(nodes)
        metas = [n.meta for n in nodes]
        self._entries: dict[str, list] | None = None
        if meta_keys is None:
            self._meta = list(map(dict.copy, metas))
            copied = None
        else:
            self._meta = metas
            self._entries = {key: meta_entries(metas, key) for key in meta_keys}
            copied = meta_keys
        # Most nodes hold only shared entries (values, provenance): nothing to copy.
        self._copies = {
            i: {k: copy_value(v) for k, v in n.meta.items()
                if k not in _SHARED_META and is_container(v) and (copied is None or k in copied)}
            for i, n in enumerate(nodes) if not _SHARED_META.issuperset(n.meta)
        } if copy_values else {}

    def structure_changed(self, graph: torch.fx.Graph) -> bool:
        if graph is not self.graph or len(graph.nodes) != len(self._nodes):
            return True
        nodes = list(graph.nodes)
        if nodes != self._nodes:  # Node equality is identity: a C loop
            return True
        if graph._codegen.__dict__ != self._codegen.__dict__:
            return True
        current = node_fields(nodes)
        self.after = (nodes, current)
        if equal(current, self._fields):
            return False
        # Equal values assigned anew (``node.args = tuple(node.args)``) are no change.
        return not all(
            all(a is b or equal(a, b) for a, b in zip(now, old, strict=True))
            for now, old in zip(current, self._fields, strict=True)
        )

    def meta_changed(self) -> bool:
        nodes = self._nodes
        if self._entries is not None:
            if not all(map(operator.is_, map(operator.attrgetter("meta"), nodes), self._meta)):
                return True  # a node's meta dict replaced
            if any(meta_entries(self._meta, k) != v for k, v in self._entries.items()):
                return True
        elif not equal([n.meta for n in nodes], self._meta):
            return True
        return not all(
            same(nodes[i].meta.get(k, MISSING), c)
            for i, copies in self._copies.items() for k, c in copies.items()
        )

    def edited_in_place(self) -> list[str]:
        """``node: key`` of each meta object (as it was before) whose contents changed."""
        return [
            f"{self._nodes[i].name}: meta[{k!r}]"
            for i, copies in self._copies.items() for k, c in copies.items()
            if not same(self._recorded_metas()[i].get(k, MISSING), c)
        ]

    def _recorded_metas(self) -> list[dict]:
        """Each node's meta as recorded (the live dicts with the recorded entries put back,
        when only some keys were recorded)."""
        if self._entries is None:
            return self._meta
        metas = list(map(dict.copy, self._meta))
        for key, values in self._entries.items():
            for meta, value in zip(metas, values, strict=True):
                if value is MISSING:
                    meta.pop(key, None)
                else:
                    meta[key] = value
        return metas

    def nodes_changed(self, graph: torch.fx.Graph) -> bool:
        """Nodes added, removed or reordered, or the graph replaced (not their fields)."""
        return graph is not self.graph or list(graph.nodes) != self._nodes

    def restore_entries(self) -> None:
        """With ``meta_keys``: each node's meta dict, and the recorded entries in it, back."""
        for node, meta in zip(self._nodes, self._meta, strict=True):
            if node.meta is not meta:
                node.meta = meta
        for key, values in (self._entries or {}).items():
            for meta, value in zip(self._meta, values, strict=True):
                if value is MISSING:
                    meta.pop(key, None)
                else:
                    meta[key] = value

    def rebuild(self) -> torch.fx.Graph:
        """A new graph of the recorded nodes, fields and (copies of their) meta."""
        graph = torch.fx.Graph(tracer_cls=self._tracer_cls)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for i, (old, (name, op, target, args, kwargs, type_), items) in enumerate(
            zip(self._nodes, self._fields, self._recorded_metas(), strict=True)
        ):
            new = graph.create_node(
                op,
                target,
                torch.fx.node.map_arg(args, env.__getitem__),
                torch.fx.node.map_arg(kwargs, env.__getitem__),
                name=name,
                type_expr=type_,
            )
            new.meta = dict(items)  # a copy: the record may be restored again
            new.meta.update((k, copy_value(v)) for k, v in self._copies.get(i, {}).items())
            env[old] = new
        graph._codegen = copy.copy(self._codegen)
        return graph


class Change(NamedTuple):
    """What a pass changed: ``structure`` (nodes, so the code) and ``anything`` at all."""

    structure: bool
    anything: bool


class Snapshot:
    """Everything a pass can change, captured so that :meth:`restore` undoes it exactly.

    Tensor *contents* are copied only with ``copy_state=True`` (a pass declaring
    ``writes_state``): a KV cache is not cloned before every pass. A tensor whose version
    counter moved without a copy is listed by :meth:`written` and
    :meth:`unrestorable_changes`, never silently kept.

    Meta: every node's meta dict and the graph module's meta are copied shallowly, so a
    pass that adds, replaces or removes entries (``node.meta[key] = new``) is undone. The
    mutable objects those entries hold (a quantization annotation, a list, a dict) are
    copied only with ``copy_meta_values=True``, the default and what the manager does for
    every pass whose effects do not exclude ``edits_meta_in_place``: a pass that edits
    such an object in place is undone too. Without the copies, rollback is exact for a
    pass that replaces meta objects instead of editing them (the declaration's contract;
    ``PassManager(strict=True)`` copies anyway and checks it, see :meth:`edited_in_place`).
    """

    def __init__(self, program: Any, copy_state: bool = True, copy_meta_values: bool = True,
                 meta_keys: frozenset[str] | None = None):
        with collector_paused():
            self._record(program, copy_state, copy_meta_values, meta_keys)

    def _record(self, program: Any, copy_state: bool, copy_meta_values: bool,
                meta_keys: frozenset[str] | None) -> None:
        self.program = program
        gm = graph_module_of(program)
        self._gm = gm
        self._graph = GraphRecord(gm.graph, copy_meta_values, meta_keys)
        self._modules = ModulesRecord(modules_of(gm))
        tensors = self._modules.tensors()
        named = self._modules.named_tensors
        self._gm_meta = (
            tuple(gm.meta.items()),
            {k: copy_value(v) for k, v in gm.meta.items() if is_container(v)}
            if copy_meta_values else {},
        )
        self._ep_state = None
        if isinstance(program, ExportedProgram):
            self._ep_state = {
                "_graph_signature": SignatureRecord(program._graph_signature),
                "_state_dict": dict(program._state_dict),
                "_constants": dict(program._constants),
                "_module_call_graph": program._module_call_graph,
                "_call_graph_record": ObjectsRecord(program._module_call_graph),
                "_range_constraints": dict(program._range_constraints),
                "_verifiers": list(program._verifiers),
            }
            # Its state (the tensors the graph module does not hold), after the modules'.
            extra = [(key, value, not isinstance(value, torch.nn.Parameter))
                     for mapping in (program._state_dict, program._constants)
                     for key, value in mapping.items() if isinstance(value, TENSOR)]
            tensors += [t for _, t, _ in extra]
            named = lambda modules=self._modules.named_tensors: modules() + extra  # noqa: E731
        self._state = TensorsRecord(tensors, named, copy_state)

    def measured(self, program: Any, after: bool) -> tuple[torch.fx.Graph, list | None,
                                                           list | None]:
        """The graph of ``program`` and its node records as this snapshot measured them
        (before the pass, or after it when :meth:`compare` got that far), for
        ``analysis.unchanged``."""
        graph = graph_module_of(program).graph
        record = self._graph
        if not after:
            return graph, record._nodes, record._fields
        if record.after is not None and graph is record.graph:
            return graph, *record.after
        return graph, None, None

    # -- what changed ------------------------------------------------------------------
    def compare(self, program: Any, written: list[str] | None = None) -> Change:
        """What differs between ``program`` (the pass's result) and the snapshot.

        ``written``: what :meth:`written` returned just before, if the caller has it
        (reading every tensor's version counter again costs as much as the rest).
        """
        gm = graph_module_of(program)
        with collector_paused():
            if gm is not self._gm or self._graph.structure_changed(gm.graph):
                return Change(True, True)
            return Change(False, self._state_changed(program, written))

    def _state_changed(self, program: Any, written: list[str] | None) -> bool:
        if (self.written() if written is None else written) or self._graph.meta_changed():
            return True
        return self.outside_nodes_changed(program)

    def outside_nodes_changed(self, program: Any) -> bool:
        """Whether anything but the nodes and their meta changed: the graph module's meta,
        the modules and, for an ExportedProgram, its signature, state and call graph."""
        items, copies = self._gm_meta
        if (
            not equal(list(self._gm.meta.items()), list(items))
            or not all(same(self._gm.meta.get(k, MISSING), c) for k, c in copies.items())
            or self._modules.changed()
        ):
            return True
        if self._ep_state is None:
            return program is not self.program
        state = self._ep_state
        return not (
            not state["_graph_signature"].changed(program._graph_signature)
            and same_dicts([program._state_dict], [state["_state_dict"]])
            and same_dicts([program._constants], [state["_constants"]])
            and program._module_call_graph is state["_module_call_graph"]
            and not state["_call_graph_record"].changed()
            and program._range_constraints == state["_range_constraints"]
            and program._verifiers == state["_verifiers"]
        )

    def written(self) -> list[str]:
        """Tensors whose data was written in place since the snapshot (version counter)."""
        return self._state.written()

    def edited_in_place(self) -> list[str]:
        """Meta objects the pass edited in place (needs ``copy_meta_values=True``): what a
        pass declaring ``edits_meta_in_place = False`` must not do."""
        items, copies = self._gm_meta
        edited = [f"graph module meta[{k!r}]" for k, c in copies.items()
                  if not same(dict(items)[k], c)]
        return self._graph.edited_in_place() + edited

    def unrestorable_changes(self) -> list[str]:
        """Tensors written in place whose old data was not copied, so cannot come back."""
        return self._state.unrestorable()

    # -- undo ----------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The program as it was, as text (rendered only when a diff is asked for)."""
        text = str(self._graph.rebuild())
        if self._ep_state is not None:
            text += "\n" + str(self._ep_state["_graph_signature"].rebuilt())
        return text

    def restore(self) -> None:
        gm = self._gm
        self._modules.restore()
        self._state.restore()
        gm.graph = self._graph.rebuild()
        gm.meta.clear()
        items, copies = self._gm_meta
        gm.meta.update(items)
        gm.meta.update((k, copy_value(v)) for k, v in copies.items())
        gm.recompile()
        if self._ep_state is not None:
            program = self.program
            state = self._ep_state
            program._graph_signature = state["_graph_signature"].restore()
            state["_call_graph_record"].restore()
            program._module_call_graph = state["_module_call_graph"]
            for key in ("_state_dict", "_constants", "_range_constraints", "_verifiers"):
                setattr(program, key, copy.copy(state[key]))
            program._graph_module = gm
