"""The end of a functionalization: the mutated state's final values become mutation
outputs (ExportedProgram) or trailing ``copy_`` write-backs (GraphModule); on success the
replaced nodes go, on failure the new ones. Part of
:class:`~.rewrite.Rewrite`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Node, map_arg

from .._analysis.buffers import (
    BUFFER,
    INITIAL_META,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    MUTATION_OUTPUT_KINDS,
    PARAMETER,
    USER_INPUT,
    named_input_specs,
    rename_call_graph,
)
from .._analysis.op_schema import MAYBE_VIEWS, target_of, view_base_index

__all__ = ["VALUE_META", "ProgramEnd", "fresh_like"]

aten = torch.ops.aten
VALUE_META = frozenset({"val", "tensor_meta", MUTABLE_BUFFER_META, MUTABLE_INPUT_META,
                        INITIAL_META})
"""Meta describing a node's value, or marking a state node: never copied onto new nodes."""
_OUTPUT_KIND = {kind: output for output, kind in MUTATION_OUTPUT_KINDS.items()}
_PLURAL = {PARAMETER: "parameters", BUFFER: "buffers", USER_INPUT: "user inputs"}


def fresh_like(src: Any, dst: Node) -> bool:
    """Whether ``src`` is a fresh tensor (no view of anything) with ``dst``'s shape and
    dtype: then ``copy(dst, src)`` equals ``src``, and ``dst.copy_(src)`` makes ``dst``
    hold exactly ``src``. Re-exported programs keep one such whole-buffer copy per
    mutated buffer; ``run_decompositions`` drops them, and so does this pass."""
    if not isinstance(src, Node) or src.op != "call_function" or target_of(src) in MAYBE_VIEWS:
        return False
    if view_base_index(src) is not None or (
        src.target is operator.getitem and isinstance(src.args[0], Node)
        and view_base_index(src.args[0]) is not None
    ):
        return False
    a, b = src.meta.get("val"), dst.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device)


class ProgramEnd:
    """The output, undo and commit of a Rewrite (mixed into Rewrite)."""

    def _finish(self, output: Node) -> None:
        own = self._own_coordinates(output)
        for root, form in self.state_views.items():
            # State whose strides changed in place, not its shape: its caller reads the
            # object's logical value, which is written back (as torch's functionalization
            # does). Unwritten, that value still reads the state's own storage: copy it.
            final = self.resolve(form)
            if self.version.get(root, 0) == 0:
                final = self.emit(form, aten.clone.default, final)
            self.cur[root] = final
            self.version[root] = self.version.get(root, 0) + 1
            self.last_writer[root] = form
        for state, arg in self.mutation_outputs:
            root = self.state_root[state]
            if isinstance(arg, Node) and self.resolve(arg) is not root:
                self.cur[root] = self.resolve(arg)
                self.version[root] += 1
                self.last_writer[root] = arg
        # Parameters, buffers, then user inputs, each in input order: run_decompositions'.
        finals = []
        for kind in (PARAMETER, BUFFER, USER_INPUT):
            for root in self.state_root.values():
                state = self.states[root]
                if state.kind == kind and self.version.get(root, 0) > 0:
                    final = self.cur[root]
                    if target_of(final) is aten.copy.default and fresh_like(final.args[1], final):
                        final = final.args[1]  # a whole-state copy: hand on its source
                    if final.op in ("placeholder", "get_attr"):
                        # The final value is another piece of state: copy it, or writing
                        # the states back one after another would read an updated one.
                        final = self.emit(self.last_writer[root], aten.clone.default, final)
                    finals.append((state, root, final))
                    self.statistics[f"mutated {_PLURAL[kind]} written back"] += 1
        for root, value in own.items():
            # Returned aliases of that state replay chains that start from the state in
            # its own coordinates (through the metadata view), not from its logical value.
            self.cur[root] = value
            self.version[root] += 1
        if self.is_ep:
            user = [(spec, map_arg(arg, self.resolve)) for spec, arg in self.other_outputs]
            for (_, old), (_, new) in zip(self.other_outputs, user, strict=True):
                if isinstance(old, Node) and isinstance(new, Node):
                    self.boundary[old.name] = new
            finals = self._own_values(finals, [arg for _, arg in user])
            outputs = [final for _, _, final in finals] + [arg for _, arg in user]
            specs = [OutputSpec(_OUTPUT_KIND[s.kind], TensorArgument(name=f.name), s.name)
                     for s, _, f in finals]
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
                             if k not in VALUE_META)
            if "val" in root.meta:  # copy_ returns its (unchanged-shape) destination
                copy.meta["val"] = root.meta["val"]
            self.notes.append(f"{state.kind} {state.name!r} written back by {copy.name}")
        self._set_args(output, returned, output.kwargs)

    def _own_values(self, finals: list[tuple[Any, Node, Node]], user: list[Any]
                    ) -> list[tuple[Any, Node, Node]]:
        """Each mutation output its own value: one that is also a user output, or another
        piece of state's final value, becomes ``aten.copy(state, value)`` (a copy of its
        own, as torch's functionalization writes ``state.copy_(value)``).

        torch's signature keys mutations by output name (``buffers_to_mutate``), so two
        mutation outputs on one node collapse into one and the verifier rejects the
        program; a backend owning the state (Core ML) refuses a mutation output that is
        also a user output. ``clone`` would do for torch, not for XNNPACK, which drops it
        and then refuses the delegate output it leaves as a pass-through; ``copy`` stays
        a copy (a portable kernel) in every lowering tried."""
        taken = {arg for arg in pytree.tree_leaves(user) if isinstance(arg, Node)}
        owned = []
        for state, root, final in finals:
            if final in taken:
                final = self.emit(self.last_writer[root], aten.copy.default, root, final)
                self.statistics["mutation outputs given their own copy"] += 1
                self.notes.append(f"{state.kind} {state.name!r} gets its own value "
                                  f"{final.name}: its new value is also another output")
            taken.add(final)
            owned.append((state, root, final))
        return owned

    def _own_coordinates(self, output: Node) -> dict[Node, Node]:
        """For state whose strides a metadata mutation changed and that a user output
        aliases: its current value in its own coordinates (a copy when unwritten, since the
        GraphModule form writes the logical value back into it)."""
        returned = {self.aliases[a].root for a in output.all_input_nodes if a in self.aliases}
        own = {}
        for root in self.state_views.keys() & returned:
            if self.version.get(root, 0):
                own[root] = self.cur[root]
            else:
                own[root] = self.emit(root, aten.clone.default, root)
        return own

    def undo(self) -> None:
        for node, args, kwargs in reversed(self.arg_changes):
            node.args, node.kwargs = args, kwargs
        for node, val in self.fake_changes:
            node.meta["val"] = val
        for node in reversed(self.new_nodes):
            self.graph.erase_node(node)
        self.inlined.undo_bodies(self.gm)  # regions given a functional body

    def commit(self) -> None:
        candidates = []
        for node in reversed(self.inlined_dead):
            self.graph.erase_node(node)
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


def _respec(spec: OutputSpec, arg: Any) -> OutputSpec:
    if isinstance(arg, Node) and isinstance(spec.arg, TensorArgument):
        return OutputSpec(spec.kind, TensorArgument(name=arg.name), spec.target)
    return spec
