"""The rewrite behind InplaceToFunctional: one walk over the graph with an undo log.

Every tensor has a storage root and a chain of views from it (``aliasing``, built from
the op facts of ``op_schema``). Each written root has a *current value* node and a
version; a write replaces the op by its functional variant and writes the new value back
through the view chain into the root (``view_inverse``); a read of a view whose root has
moved on replays the chain on the current value. At the output, each mutated buffer /
input gets its final value as a mutation output (ExportedProgram) or a trailing ``copy_``
(GraphModule): see ``end``; ops reading storage or layout are in
``storage_reads``.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature
from torch.fx import Node, map_arg

from pass_manager import graph_module_of

from .._analysis.buffers import call_graph_names
from .._analysis.fake_values import is_contiguous, same_metadata, same_strides
from .._analysis.op_schema import (
    MAYBE_VIEWS,
    METADATA_QUERIES,
    STORAGE_READERS,
    STORAGE_VIEWS,
    in_dialect_of,
    schema_of,
    target_of,
    view_base_index,
    written_arguments,
)
from ..errors import UnsupportedMutationError
from ..functional_variants import functional_variant
from .end import VALUE_META, ProgramEnd, fresh_like
from .mutation_checks import check_opaque, check_shared_storage, check_write
from .overlapping_writes import OverlappingWrites
from .start import ProgramStart
from .storage_reads import StorageReads

__all__ = ["Rewrite"]

aten = torch.ops.aten


class Rewrite(ProgramStart, StorageReads, OverlappingWrites, ProgramEnd):
    """One functionalization of one program: analysis, rewrite with an undo log, commit."""

    def __init__(self, program: Any):
        self.program = program
        self.is_ep = isinstance(program, ExportedProgram)
        self.gm = graph_module_of(program)
        self.graph = self.gm.graph
        inlined, metadata = self._prepare(program)
        self.cur: dict[Node, Node] = {}
        self.version: dict[Node, int] = {}
        self.value: dict[Node, tuple[Node, int]] = {}
        self.memo: dict[tuple, Node] = {}
        self.last_writer: dict[Node, Node] = {}
        self.multi_results: dict[Node, list[Node | None]] = {}
        self.new_nodes: list[Node] = inlined.new_nodes + metadata.new_nodes
        self.arg_changes: list[tuple[Node, tuple, dict]] = (
            inlined.arg_changes + metadata.arg_changes)
        self.fake_changes: list[tuple[Node, Any]] = []
        self.dead: list[Node] = []
        # Erased first: they read nodes that die too.
        self.inlined_dead = inlined.dead + metadata.dead
        # Roots whose shape/strides a write changed: their storage order is not eager's.
        self.relaid: set[Node] = set(self.state_views)
        self.stale: list[Node] = []  # original nodes whose users now read a new node
        self.cursor: Node = self.output
        self.new_signature: ExportGraphSignature | None = None
        # Values named by preserved module call signatures: their new node, per old name.
        self.call_graph_names = call_graph_names(program) if self.is_ep else set()
        self.boundary: dict[str, Node] = {}
        self.notes: list[str] = []
        self.statistics: Counter[str] = Counter()  # what the rewrite did, for the report
        self.statistics.update(f"metadata mutations as views or renames: {m.target}"
                               for m in metadata.dead)

    @functools.cached_property
    def order(self) -> dict[Node, int]:
        """Graph positions, asked only about a relayout: nodes inserted since keep the
        original nodes' relative order."""
        return {n: i for i, n in enumerate(self.graph.nodes)}

    # -- building blocks --------------------------------------------------------------
    def emit(self, like: Node, target: Any, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.cursor):
            node = self.graph.call_function(in_dialect_of(like, target), args, kwargs)
        self.new_nodes.append(node)
        node.meta.update((k, v) for k, v in like.meta.items() if k not in VALUE_META)
        self._infer(node, like)
        return node

    def _infer(self, node: Node, like: Node) -> None:
        try:
            self.fake.infer(node)
        except Exception as e:
            raise UnsupportedMutationError(
                like, f"its rewrite {node.target} fails on the fake inputs ({e})",
                "fake-failure") from e

    def resolve(self, node: Node) -> Node:
        """The node holding ``node``'s value now (a replayed view when it went stale)."""
        entry = self.value.get(node)
        if entry is None:
            return node
        val, ver = entry
        alias = self.aliases.get(node)
        root = alias.root if alias is not None else None
        if root not in self.version or self.version[root] == ver:
            return val
        val = self._view_values(root, alias.chain)[-1]
        self.value[node] = (val, self.version[root])
        return val

    def _view_values(self, root: Node, chain: tuple[Node, ...]) -> list[Node]:
        """Current values of the root and of each prefix of a view chain (memoized)."""
        ver = self.version[root]
        values = [self.cur[root]]
        for k, view in enumerate(chain):
            key = (root, chain[: k + 1], ver)
            if key not in self.memo:
                self.memo[key] = self._replay(view, values[-1])
            values.append(self.memo[key])
        return values

    def _replay(self, view: Node, base: Node) -> Node:
        if target_of(view) in STORAGE_VIEWS:  # ``base`` is the storage root's current value
            size, stride = view.args[1:3]
            offset = self._storage_offset(view, view, view.meta.get("val"))
            return self.emit(view, aten.as_strided.default, base, size, stride, offset)
        if view.target is operator.getitem:
            return self.emit(view, operator.getitem, base, view.args[1])
        schema = schema_of(view)
        index = view_base_index(view)
        args, kwargs = list(view.args), dict(view.kwargs)
        if index < len(args):
            args[index] = base
        else:
            kwargs[schema.arguments[index].name] = base
        return self.emit(view, view.target, *args, **kwargs)

    def _set_args(self, node: Node, args: tuple, kwargs: dict) -> None:
        self.arg_changes.append((node, node.args, node.kwargs))
        # Each assignment re-links every input's use list: assign only what changed.
        if args is not node.args:
            node.args = args
        if kwargs is not node.kwargs:
            node.kwargs = kwargs

    def _remap(self, node: Node) -> None:
        if not any(a in self.value for a in node.all_input_nodes):
            return
        old_inputs = node.all_input_nodes
        args = _resolved(node.args, self.resolve)
        kwargs = _resolved(node.kwargs, self.resolve) if node.kwargs else node.kwargs
        self._set_args(node, args, kwargs)
        if target_of(node) in MAYBE_VIEWS and "val" in node.meta and not (
            self.aliases[node].root is node and same_metadata(old_inputs, node.all_input_nodes)
        ):
            # Whether it is a view is read from storage sharing: keep that true of its new input.
            # A copy (reshape of an expanded cache) of inputs with unchanged metadata stays a
            # copy with the same metadata, so its value needs no new fake dispatch.
            self.fake_changes.append((node, node.meta["val"]))
            self._infer(node, node)

    def _track(self, node: Node, root: Node) -> None:
        if node is root:
            self.cur[root] = self.value[node][0] if node in self.value else node
            self.version[root] = 0
            self.value.setdefault(node, (node, 0))
        elif node not in self.value:
            ver = self.version[root]
            self.value[node] = (node, ver)
            self.memo.setdefault((root, self.aliases[node].chain, ver), node)

    # -- the walk ---------------------------------------------------------------------
    def _to_visit(self) -> list[Node]:
        """The nodes the walk must visit, in graph order: writers, opaque and refused
        nodes, every node of a written root (tracked) and every reader of those or of a
        writer's results (re-wired). Any other node reads nothing a write changes, and the
        walk would leave it as it is: on a decoder that is most of the graph."""
        tracked = [n for n, a in self.aliases.items() if a.root in self.roots]
        frontier = [*tracked, *self.writing_nodes]
        visit = {*frontier, *self.opaque, *self.refused_metadata}
        for node in frontier:
            visit.update(node.users)
        for node in self.writing_nodes:  # a multi-result writer's getitems get new values
            for user in node.users:
                visit.update(user.users)
        if self.call_graph_names:
            visit.update(n for n in self.graph.nodes if n.name in self.call_graph_names)
        visit.add(self.output)
        return [n for n in self.graph.nodes if n in visit]

    def run(self) -> None:
        check_shared_storage(self.program, self.states,
                             {self.states[r] for r in self.roots if r in self.states}, self.is_ep)
        for node in self._to_visit():
            self.cursor = node
            if node in self.skipped:  # an inlined region, erased on commit
                continue
            if node.op == "output":
                self._finish(node)
                continue
            if node.op in ("placeholder", "get_attr"):
                root = self.aliases[node].root
                if root in self.roots:
                    self.value[node] = (node, 0)
                    if node is root:
                        self.cur[root], self.version[root] = node, 0
                continue
            if node.target is operator.getitem and node.args[0] in self.multi_results:
                result = self.multi_results[node.args[0]][node.args[1]]
                self.value[node] = (result, self.version.get(self.aliases[node].root, 0))
                self.dead.append(node)
            else:
                self._visit(node)
            if node.name in self.call_graph_names:
                self.boundary[node.name] = self.resolve(node)

    def _visit(self, node: Node) -> None:
        if node in self.refused_metadata:
            raise UnsupportedMutationError(node, self.refused_metadata[node], "relayout")
        writes = written_arguments(node)
        if writes:
            check_write(node, [w for _, w in writes], self.aliases, self.states)
            self._remap(node)
            self._rewrite(node, writes)
        else:
            check_opaque(node, self.opaque.get(node), self.aliases, self.roots, self.states)
            target = target_of(node)
            if target in METADATA_QUERIES:
                self._layout_query(node)
            elif target in STORAGE_VIEWS or target in STORAGE_READERS:
                if not self._storage_reader(node):
                    self._remap(node)
            else:
                self._remap(node)
        alias = self.aliases.get(node)
        if alias is not None and alias.root in self.roots:
            self._track(node, alias.root)

    def _rewrite(self, node: Node, writes: list[tuple[int, Node]]) -> None:
        written = writes[0][1]  # an original node (the arguments are current values)
        if target_of(node) is aten.copy_.default and not self.aliases[written].chain and (
            fresh_like(node.args[1], written)
        ):  # a whole tensor overwritten by a fresh value: it now is that value
            self._write(node, written, node.args[1])
            root = self.aliases[written].root
            self.value[node] = (self.cur[root], self.version[root])
            self.dead.append(node)
            return
        variant = functional_variant(target_of(node))
        if isinstance(variant, str):
            raise UnsupportedMutationError(node, variant, "no-variant")
        op = getattr(node.target, "overloadpacket", node.target)
        self.statistics[f"in-place ops rewritten: {op}"] += 1
        if variant.expand is not None:
            results = variant.expand(
                lambda target, *a, **kw: self.emit(node, target, *a, **kw), node)
            n_returns = len(node.target._schema.returns)
            if n_returns:
                self.value[node] = (results[0], 0)
            for (_, w), new in zip(writes, results[n_returns:], strict=True):
                self._write(node, w, self._conform(node, w, new))
            self.dead.append(node)
            return
        if variant.functional is None:
            (_, written), = writes
            root = self.aliases[written].root
            self.value[node] = (self.resolve(node.args[0]), self.version[root])
            self.dead.append(node)
            return
        n_returns, ret_of = _returns_of(node.target)
        if variant.arguments is not None:
            args, kwargs = variant.arguments(node)
        else:
            args = node.args
            kwargs = {k: v for k, v in node.kwargs.items() if k not in variant.out_args}
        call = self.emit(node, variant.functional, *args, **kwargs)
        n_results = n_returns + (0 if variant.returns_written else len(writes))
        single = variant.picks is None and (isinstance(call.meta.get("val"), torch.Tensor) or (
            "val" not in call.meta and n_results == 1))

        def result(i: int) -> Node:
            if single:
                return call
            return self.emit(node, operator.getitem, call, variant.picks[i] if variant.picks else i)

        if variant.returns_written:
            results = [result(j) for j in range(n_returns)]
            for i, w in writes:
                results[ret_of[i]] = self._conform(node, w, results[ret_of[i]])
            new_values = [results[ret_of[i]] for i, _ in writes]
            if n_returns > 1:
                self.multi_results[node] = results
        else:
            new_values = [result(n_returns + k) for k in range(len(writes))]
            if n_returns == 1:
                self.value[node] = (result(0), 0)
            elif n_returns:
                self.value[node] = (call, 0)
            new_values = [
                self._conform(node, w, new)
                for (_, w), new in zip(writes, new_values, strict=True)
            ]
        for (_, w), new in zip(writes, new_values, strict=True):
            self._write(node, w, new)
        if variant.returns_written and n_returns == 1:
            alias = self.aliases[node]  # the written view, with eager's layout
            self.value[node] = (self._view_values(alias.root, alias.chain)[-1],
                                self.version[alias.root])
        self.dead.append(node)

    def _conform(self, node: Node, written: Node, new: Node) -> Node:
        """Cast the functional result to the written tensor's dtype, as the in-place op does."""
        old, val = written.meta.get("val"), new.meta.get("val")
        if not isinstance(old, torch.Tensor) or not isinstance(val, torch.Tensor):
            # No fake values to compare dtypes with: copy casts (and broadcasts) the result
            # into the written tensor's dtype and shape, exactly as the in-place op stores it.
            return self.emit(node, aten.copy.default, self.resolve(written), new)
        if old.shape != val.shape:
            # out= resizes its destination: a rename to the result for a fresh tensor.
            self._check_relayout(node, written, "an out= resize")
        if old.dtype != val.dtype:
            return self.emit(node, aten._to_copy.default, new, dtype=old.dtype)
        return new

    def _write(self, writer: Node, written: Node, new: Node) -> None:
        """``written`` (a view of its root, or the root) now holds ``new``."""
        alias = self.aliases[written]
        root, chain = alias.root, alias.chain
        view_value = None
        if chain:  # view_value: None when ``new`` is not the view's value (overlapping_writes)
            new, view_value = self._write_back(writer, written, new)
        if not same_strides(new, root) and is_contiguous(root):
            # Eager keeps the root's memory layout, and reductions over a differently laid
            # out copy round differently: restore the layout so results stay bit-exact.
            new = self.emit(writer, aten.clone.default, new,
                            memory_format=torch.contiguous_format)
        self.cur[root] = new
        self.version[root] += 1
        self.last_writer[root] = writer
        if view_value is not None and same_strides(view_value, written):
            self.memo[(root, chain, self.version[root])] = view_value

@functools.cache
def _returns_of(op: Any) -> tuple[int, dict[int, int]]:
    """An op's number of results, and which result aliases each argument it aliases (read
    once per op: a schema's argument list is rebuilt on every access)."""
    schema = op._schema
    ret_of = {}
    for j, ret in enumerate(schema.returns):
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info and ret.alias_info and (
                arg.alias_info.before_set & ret.alias_info.before_set
            ):
                ret_of[i] = j
    return len(schema.returns), ret_of


def _resolved(value: Any, resolve: Any) -> Any:
    """``map_arg(value, resolve)``, or ``value`` itself when no node in it resolves to
    another one (so the caller can tell an unchanged argument by identity)."""
    changed = False

    def step(node: Node) -> Node:
        nonlocal changed
        new = resolve(node)
        changed = changed or new is not node
        return new

    new = map_arg(value, step)
    return new if changed else value
