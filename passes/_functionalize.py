"""The rewrite behind InplaceToFunctional: one walk over the graph with an undo log.

Every tensor has a storage root and a chain of views from it (``_aliasing``). Each
written root has a *current value* node and a version; a write replaces the op by its
functional variant and writes the new value back through the view chain into the root
(``_view_inverse``); a read of a view whose root has moved on replays the chain on the
current value. At the output, each mutated buffer / input gets its final value as a
mutation output (ExportedProgram) or a trailing ``copy_`` (GraphModule).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Node, map_arg

from pass_manager import graph_module_of

from ._aliasing import (
    MAYBE_VIEWS,
    METADATA_QUERIES,
    STORAGE_READERS,
    STORAGE_VIEWS,
    argument_value,
    schema_of,
    view_base_index,
    written_arguments,
)
from ._buffers import (
    BUFFER,
    INITIAL_META,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    USER_INPUT,
    State,
    call_graph_names,
    find_mutations,
    named_input_specs,
    rename_call_graph,
    trailing_write_backs,
)
from ._fake_values import FakeValues
from ._mutation_checks import UnsupportedMutationError, check_opaque, check_write
from ._view_inverse import view_steps, write_back_chain
from .functional_variants import functional_variant

__all__ = ["Rewrite"]

aten = torch.ops.aten
_MUTATION_OUTPUTS = {OutputKind.BUFFER_MUTATION: BUFFER, OutputKind.USER_INPUT_MUTATION: USER_INPUT}
# Meta describing a node's value, or marking a state node: never copied onto new nodes.
_VALUE_META = frozenset({"val", "tensor_meta", MUTABLE_BUFFER_META, MUTABLE_INPUT_META,
                         INITIAL_META})


class Rewrite:
    """One functionalization of one program: analysis, rewrite with an undo log, commit."""

    def __init__(self, program: Any):
        self.program = program
        self.is_ep = isinstance(program, ExportedProgram)
        self.gm = graph_module_of(program)
        self.graph = self.gm.graph
        scan = find_mutations(program)
        self.states = scan.states
        self.state_root: dict[State, Node] = {}
        for node, state in self.states.items():
            self.state_root.setdefault(state, node)
        self.aliases = scan.aliases
        self.opaque = {o.node: o.reason for o in scan.opaque}
        self.output = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        self.mutation_outputs: list[tuple[State, Any]] = []
        self.other_outputs: list[tuple[OutputSpec, Any]] = []
        if self.is_ep:
            for spec, arg in zip(program.graph_signature.output_specs, self.output.args[0]):
                if spec.kind in _MUTATION_OUTPUTS:
                    state = State(_MUTATION_OUTPUTS[spec.kind], spec.target)
                    self.mutation_outputs.append((state, arg))
                else:
                    self.other_outputs.append((spec, arg))
        # A program whose only writes are trailing write-backs is functional already.
        write_backs = set() if self.is_ep else set(trailing_write_backs(program))
        self.roots = {self.state_root[s] for s, _ in self.mutation_outputs} | scan.written_roots
        self.has_writes = any(str(n.target).endswith("_") or "writes" in reason
                              for n, reason in self.opaque.items())
        self.has_writes |= any(n not in write_backs for n in scan.writing_nodes)
        self.fake = FakeValues(self.graph)
        self.cur: dict[Node, Node] = {}
        self.version: dict[Node, int] = {}
        self.value: dict[Node, tuple[Node, int]] = {}
        self.memo: dict[tuple, Node] = {}
        self.last_writer: dict[Node, Node] = {}
        self.multi_results: dict[Node, list[Node | None]] = {}
        self.new_nodes: list[Node] = []
        self.arg_changes: list[tuple[Node, tuple, dict]] = []
        self.fake_changes: list[tuple[Node, Any]] = []
        self.dead: list[Node] = []
        self.stale: list[Node] = []  # original nodes whose users now read a new node
        self.cursor: Node = self.output
        self.new_signature: ExportGraphSignature | None = None
        # Values named by preserved module call signatures: their new node, per old name.
        self.call_graph_names = call_graph_names(program) if self.is_ep else set()
        self.boundary: dict[str, Node] = {}
        self.notes: list[str] = []

    # -- building blocks --------------------------------------------------------------
    def emit(self, like: Node, target: Any, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.cursor):
            node = self.graph.call_function(target, args, kwargs)
        self.new_nodes.append(node)
        node.meta.update((k, v) for k, v in like.meta.items() if k not in _VALUE_META)
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
        if view.target in STORAGE_VIEWS:  # ``base`` is the storage root's current value
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

    def _storage_offset(self, node: Node, view: Node, val: Any) -> int:
        """``val``'s offset in the storage of ``view``'s root, whose current value then
        stands for that storage: refused when the root is not exactly its own storage."""
        root = self.aliases[view].root
        cur = self.cur.get(root, root)
        for tensor in (root.meta.get("val"), cur.meta.get("val")):
            if not _whole_storage(tensor):
                raise UnsupportedMutationError(
                    node, f"it reads the storage of {root.name} (sizes, strides, offset) after "
                          f"a write, and {root.name} is not a contiguous tensor owning all of "
                          "its storage with static sizes", "storage")
        offset = val.storage_offset() if isinstance(val, torch.Tensor) else None
        if not isinstance(offset, int):
            raise UnsupportedMutationError(
                node, f"it reads the storage of {root.name} at an offset that is not static",
                "storage")
        return offset

    def _storage_reader(self, node: Node) -> bool:
        """Re-address an op reading a written tensor's storage in the root's new value.

        A written view's new value is a fresh tensor with its own storage: ``as_strided``
        of it would read the wrong elements (eager reads the base's storage).
        """
        source = node.args[0]
        alias = self.aliases.get(source)
        if alias is None or self.cur.get(alias.root, alias.root) is alias.root:
            return False
        if node.target in STORAGE_VIEWS:
            ver = self.version[alias.root]
            self.value[node] = (self._view_values(alias.root, (node,))[-1], ver)
            self.stale.append(node)
            return True
        # as_strided_copy(input, size, stride, offset=input's offset)
        schema = node.target._schema
        offset = argument_value(node, schema, 3)
        if offset is None:
            offset = self._storage_offset(node, source, source.meta.get("val"))
        else:
            self._storage_offset(node, source, source.meta.get("val"))
        size, stride = argument_value(node, schema, 1), argument_value(node, schema, 2)
        self._set_args(node, (self.cur[alias.root], size, stride, offset), {})
        return True

    def _layout_query(self, node: Node) -> None:
        """A stride / storage-offset query reads the layout of an original node (a write
        never changes it), never the layout of a fresh functional value."""
        def twin(arg: Node) -> Node:
            alias = self.aliases.get(arg)
            if alias is None or arg not in self.value:
                return arg
            return alias.chain[-1] if alias.chain else alias.root

        self._set_args(node, *map_arg((node.args, node.kwargs), twin))

    def _set_args(self, node: Node, args: tuple, kwargs: dict) -> None:
        self.arg_changes.append((node, node.args, node.kwargs))
        node.args, node.kwargs = args, kwargs

    def _remap(self, node: Node) -> None:
        if not any(a in self.value for a in node.all_input_nodes):
            return
        args, kwargs = map_arg((node.args, node.kwargs), self.resolve)
        self._set_args(node, args, kwargs)
        if node.target in MAYBE_VIEWS and "val" in node.meta:
            # Whether it is a view is read from storage sharing: keep that true of its new input.
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
    def run(self) -> None:
        for node in list(self.graph.nodes):
            self.cursor = node
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
        writes = written_arguments(node)
        if writes:
            check_write(node, [w for _, w in writes], self.aliases, self.states)
            self._remap(node)
            self._rewrite(node, writes)
        else:
            check_opaque(node, self.opaque.get(node), self.aliases, self.roots, self.states)
            if node.target in METADATA_QUERIES:
                self._layout_query(node)
            elif node.target in STORAGE_VIEWS or node.target in STORAGE_READERS:
                if not self._storage_reader(node):
                    self._remap(node)
            else:
                self._remap(node)
        alias = self.aliases.get(node)
        if alias is not None and alias.root in self.roots:
            self._track(node, alias.root)

    def _rewrite(self, node: Node, writes: list[tuple[int, Node]]) -> None:
        variant = functional_variant(node.target)
        if isinstance(variant, str):
            raise UnsupportedMutationError(node, variant, "no-variant")
        if variant.functional is None:
            (_, written), = writes
            root = self.aliases[written].root
            self.value[node] = (self.resolve(node.args[0]), self.version[root])
            self.dead.append(node)
            return
        schema = node.target._schema
        if variant.arguments is not None:
            args, kwargs = variant.arguments(node)
        else:
            args = node.args
            kwargs = {k: v for k, v in node.kwargs.items() if k not in variant.out_args}
        call = self.emit(node, variant.functional, *args, **kwargs)
        returns = schema.returns
        n_results = len(returns) + (0 if variant.returns_written else len(writes))
        single = variant.picks is None and (isinstance(call.meta.get("val"), torch.Tensor) or (
            "val" not in call.meta and n_results == 1))

        def result(i: int) -> Node:
            if single:
                return call
            return self.emit(node, operator.getitem, call, variant.picks[i] if variant.picks else i)

        if variant.returns_written:
            ret_of = {}
            for j, ret in enumerate(returns):
                for i, arg in enumerate(schema.arguments):
                    if arg.alias_info and ret.alias_info and (
                        arg.alias_info.before_set & ret.alias_info.before_set
                    ):
                        ret_of[i] = j
            results = [result(j) for j in range(len(returns))]
            for i, w in writes:
                results[ret_of[i]] = self._conform(node, w, results[ret_of[i]])
            new_values = [results[ret_of[i]] for i, _ in writes]
            if len(returns) > 1:
                self.multi_results[node] = results
        else:
            new_values = [result(len(returns) + k) for k in range(len(writes))]
            if len(returns) == 1:
                self.value[node] = (result(0), 0)
            elif returns:
                self.value[node] = (call, 0)
            new_values = [self._conform(node, w, new) for (_, w), new in zip(writes, new_values)]
        for (_, w), new in zip(writes, new_values):
            self._write(node, w, new)
        if variant.returns_written and len(returns) == 1:
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
            raise UnsupportedMutationError(
                node, f"its functional result has shape {tuple(val.shape)} but the written "
                      f"{written.name} has shape {tuple(old.shape)} (an out= resize)", "out-resize")
        if old.dtype != val.dtype:
            return self.emit(node, aten._to_copy.default, new, dtype=old.dtype)
        return new

    def _write(self, writer: Node, written: Node, new: Node) -> None:
        """``written`` (a view of its root, or the root) now holds ``new``."""
        alias = self.aliases[written]
        root, chain = alias.root, alias.chain
        view_value = new
        if chain:
            bases = self._view_values(root, chain[: -len(view_steps(chain)[-1])])
            new = write_back_chain(
                lambda target, *a, **kw: self.emit(writer, target, *a, **kw), chain, bases, new)
        if not _same_layout(new, root) and _is_contiguous(root):
            # Eager keeps the root's memory layout, and reductions over a differently laid
            # out copy round differently: restore the layout so results stay bit-exact.
            new = self.emit(writer, aten.clone.default, new,
                            memory_format=torch.contiguous_format)
        self.cur[root] = new
        self.version[root] += 1
        self.last_writer[root] = writer
        if chain and _same_layout(view_value, written):
            self.memo[(root, chain, self.version[root])] = view_value

    # -- the end of the program -------------------------------------------------------
    def _finish(self, output: Node) -> None:
        for state, arg in self.mutation_outputs:
            root = self.state_root[state]
            if isinstance(arg, Node) and self.resolve(arg) is not root:
                self.cur[root] = self.resolve(arg)
                self.version[root] += 1
                self.last_writer[root] = arg
        finals = []  # buffers, then user inputs, each in input order: run_decompositions' order
        for kind in (BUFFER, USER_INPUT):
            for root in self.state_root.values():
                state = self.states[root]
                if state.kind == kind and self.version.get(root, 0) > 0:
                    final = self.cur[root]
                    if final.op in ("placeholder", "get_attr"):
                        # The final value is another piece of state: copy it, or writing
                        # the states back one after another would read an updated one.
                        final = self.emit(self.last_writer[root], aten.clone.default, final)
                    finals.append((state, root, final))
        if self.is_ep:
            user = [(spec, map_arg(arg, self.resolve)) for spec, arg in self.other_outputs]
            for (_, old), (_, new) in zip(self.other_outputs, user):
                if isinstance(old, Node) and isinstance(new, Node):
                    self.boundary[old.name] = new
            outputs = [final for _, _, final in finals] + [arg for _, arg in user]
            specs = [OutputSpec(OutputKind.BUFFER_MUTATION if s.kind == BUFFER
                                else OutputKind.USER_INPUT_MUTATION,
                                TensorArgument(name=f.name), s.name) for s, _, f in finals]
            specs += [_respec(spec, arg) for spec, arg in user]
            self._set_args(output, (tuple(outputs),), {})
            self.new_signature = ExportGraphSignature(
                named_input_specs(self.program), specs)
            return
        # Returned views are replayed on the final values first: write-backs stay last.
        returned = map_arg(output.args, self.resolve)
        for state, root, final in finals:
            with self.graph.inserting_before(output):
                copy = self.graph.call_function(aten.copy_.default, (root, final))
            self.new_nodes.append(copy)
            copy.meta.update((k, v) for k, v in self.last_writer[root].meta.items()
                             if k not in _VALUE_META)
            if "val" in root.meta:  # copy_ returns its (unchanged-shape) destination
                copy.meta["val"] = root.meta["val"]
            self.notes.append(f"{state.kind} {state.name!r} written back by {copy.name}")
        self._set_args(output, returned, output.kwargs)

    def undo(self) -> None:
        for node, args, kwargs in reversed(self.arg_changes):
            node.args, node.kwargs = args, kwargs
        for node, val in self.fake_changes:
            node.meta["val"] = val
        for node in reversed(self.new_nodes):
            self.graph.erase_node(node)

    def commit(self) -> None:
        candidates = []
        for node in reversed(self.stale):  # before the dead nodes they may still read
            if not node.users:
                candidates.extend(node.all_input_nodes)
                self.graph.erase_node(node)
        for node in reversed(self.dead):
            candidates.extend(node.all_input_nodes)
            self.graph.erase_node(node)
        while candidates:
            node = candidates.pop()
            if node._erased or node.users or node.op != "call_function":
                continue
            if view_base_index(node) is not None or node.target is operator.getitem:
                candidates.extend(node.all_input_nodes)
                self.graph.erase_node(node)
        if self.new_signature is not None:
            self.program._graph_signature = self.new_signature
        renames = {old: new.name for old, new in self.boundary.items() if new.name != old}
        if renames:
            self.program._module_call_graph = rename_call_graph(
                self.program.module_call_graph, renames)


def _same_layout(a: Node, b: Node) -> bool:
    """Same strides (True when unknown: no fake values or symbolic strides)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return True
    strides = (*va.stride(), *vb.stride())
    return not all(isinstance(x, int) for x in strides) or va.stride() == vb.stride()


def _whole_storage(val: Any) -> bool:
    """A contiguous tensor with static sizes at offset 0 that owns all of its storage."""
    if not isinstance(val, torch.Tensor):
        return False
    sizes = (*val.shape, *val.stride(), val.storage_offset())
    if not all(isinstance(s, int) for s in sizes) or val.storage_offset() != 0:
        return False
    try:
        nbytes = val.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return val.is_contiguous() and nbytes == val.numel() * val.element_size()


def _is_contiguous(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _respec(spec: OutputSpec, arg: Any) -> OutputSpec:
    if isinstance(arg, Node) and isinstance(spec.arg, TensorArgument):
        return OutputSpec(spec.kind, TensorArgument(name=arg.name), spec.target)
    return spec
