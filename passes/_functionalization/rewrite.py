"""The rewrite behind InplaceToFunctional: one walk over the graph.

Before the walk, state-writing grad-mode regions are inlined (``grad_regions``), list
writes whose positions depend on one another are split into one op per position
(``list_writes``) and metadata mutations become views (``metadata_mutations``); the
program's state, the roots to functionalize and its mutation outputs are read from the
mutation scan.

Every tensor has a storage root and a chain of views from it (``aliasing``, built from
the op facts of ``op_schema``). Each written root has a *current value* node and a
version; a write replaces the op by its functional variant and writes the new value back
through the view chain into the root (``view_inverse``; through a view addressing an
element twice, only the positions the op writes: ``overlapping_writes``); a read of a
view whose root has moved on replays the chain on the current value. Ops reading a
written tensor's storage or layout, not only its values, are re-addressed in the root's
new value or read an original node's layout. At the output, each mutated buffer / input
gets its final value as a mutation output (ExportedProgram) or a trailing ``copy_``
(GraphModule); on success the replaced nodes go.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, OutputSpec, TensorArgument
from torch.fx import Node, map_arg

from pass_manager import graph_module_of

from .._analysis.buffers import (
    BUFFER,
    INITIAL_META,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    MUTATION_OUTPUT_KINDS,
    PARAMETER,
    USER_INPUT,
    State,
    call_graph_names,
    find_mutations,
    named_input_specs,
    rename_call_graph,
    trailing_write_backs,
)
from .._analysis.fake_values import FakeValues, is_contiguous, same_metadata, same_strides
from .._analysis.op_schema import (
    ELEMENT_VIEWS,
    METADATA_QUERIES,
    STORAGE_READERS,
    STORAGE_VIEWS,
    argument_value,
    in_dialect_of,
    is_maybe_view,
    schema_of,
    shared_input,
    target_of,
    view_base_index,
    written_arguments,
)
from ..errors import UnsupportedMutationError
from ..functional_variants import functional_variant
from .buffer_constants import merge_buffer_constants
from .element_overlap import overlaps_itself
from .grad_regions import inline_grad_regions
from .list_writes import split_order_dependent_list_writes
from .metadata_mutations import normalize_metadata_mutations
from .mutation_checks import check_opaque, check_shared_storage, check_write
from .overlapping_writes import needs_written_positions, written_positions
from .view_inverse import view_steps, write_back_chain

__all__ = ["Rewrite"]

aten = torch.ops.aten
_VALUE_META = frozenset({"val", "tensor_meta", MUTABLE_BUFFER_META, MUTABLE_INPUT_META,
                         INITIAL_META})
"""Meta describing a node's value, or marking a state node: never copied onto new nodes."""
_OUTPUT_KIND = {kind: output for output, kind in MUTATION_OUTPUT_KINDS.items()}
_PLURAL = {PARAMETER: "parameters", BUFFER: "buffers", USER_INPUT: "user inputs"}


class Rewrite:
    """One functionalization of one program: ``Rewrite(program)`` prepares it (and says
    whether it ``has_writes``), :meth:`run` rewrites it in place, :meth:`commit` erases
    the nodes it replaced and installs the new signature. Both change the program as they
    go: a failure leaves it half-rewritten, for the caller's rollback record to restore
    (InplaceToFunctional's ``call``)."""

    def __init__(self, program: Any):
        self.program = program
        self.is_ep = isinstance(program, ExportedProgram)
        self.gm = graph_module_of(program)
        self.graph = self.gm.graph
        inlined_dead, metadata_dead = self._prepare(program)
        self.cur: dict[Node, Node] = {}
        self.version: dict[Node, int] = {}
        self.value: dict[Node, tuple[Node, int]] = {}
        self.memo: dict[tuple, Node] = {}
        self.last_writer: dict[Node, Node] = {}
        self.multi_results: dict[Node, list[Node | None]] = {}
        self.dead: list[Node] = []
        # Erased first: they read nodes that die too.
        self.inlined_dead = inlined_dead + metadata_dead
        # Roots whose shape/strides a write changed: their storage order is not eager's.
        self.relaid: set[Node] = set(self.state_views)
        self.stale: list[Node] = []  # original nodes whose users now read a new node
        self.cursor: Node = self.output
        self.new_signature: ExportGraphSignature | None = None
        # Values named by preserved module call signatures: their new node, per old name.
        self.call_graph_names = call_graph_names(program) if self.is_ep else set()
        self.boundary: dict[str, Node] = {}
        self.notes: list[str] = list(self.merged_constants)
        self.statistics: Counter[str] = Counter()  # what the rewrite did, for the report
        if self.merged_constants:
            self.statistics["constants read as the buffer they are"] = len(self.merged_constants)
        self.statistics.update(f"metadata mutations as views or renames: {m.target}"
                               for m in metadata_dead)

    # -- before the walk ---------------------------------------------------------------
    def _prepare(self, program: Any) -> tuple[list[Node], list[Node]]:
        """Inline state-writing grad-mode regions, turn metadata mutations into views and
        read the program's state, roots and outputs from the mutation scan; the nodes the
        first two steps replaced are returned (erased on commit)."""
        _repair_use_lists(self.graph)
        # The scan MarkMutableBuffers made (cached), whose candidates (the nodes that may
        # write) are all the two steps below look at. It is taken again only after one of
        # them changed the graph.
        scan = find_mutations(program)
        # A lifted constant that is a written buffer's very tensor is that buffer.
        self.merged_constants = merge_buffer_constants(program, self.gm, scan)
        if self.merged_constants:
            scan = find_mutations(program)
        if scan.candidates:
            _check_one_fake_mode(self.graph)
        # no_grad regions that write state are inlined first.
        inlined = inline_grad_regions(self.gm, type(self), scan.candidates)
        if inlined.dead or inlined.functionalized:
            scan = find_mutations(program)
        # A list write whose positions read or write one another's tensors: one op each.
        if split_order_dependent_list_writes(self.gm, scan.candidates, scan.aliases):
            scan = find_mutations(program)
        self.fake = FakeValues(self.graph, tensor_meta=True)
        # Metadata mutations become views / renames first.
        metadata = normalize_metadata_mutations(program, self.gm, self.fake, scan.candidates)
        if metadata.dead:
            scan = find_mutations(program)
        self.refused_metadata = metadata.refused
        self.state_views = metadata.state_views
        self.skipped = set(inlined.dead) | set(metadata.dead)
        self.states = scan.states
        self.state_root: dict[State, Node] = {}
        for node, state in self.states.items():
            self.state_root.setdefault(state, node)
        self.aliases = scan.aliases
        self.opaque = {o.node: o.reason for o in scan.opaque}
        for region, error in inlined.refused.items():
            if region in self.opaque:  # why its body was not functionalized
                self.opaque[region] += (f"; its body cannot be functionalized: node "
                                        f"{error.node} ({error.kind}): {error.reason}")
        self.writing_nodes = scan.writing_nodes
        self.output = self.graph.output_node()
        self.mutation_outputs: list[tuple[State, Any]] = []
        self.other_outputs: list[tuple[OutputSpec, Any]] = []
        if self.is_ep:
            specs = program.graph_signature.output_specs
            for spec, arg in zip(specs, self.output.args[0], strict=True):
                if spec.kind in MUTATION_OUTPUT_KINDS:
                    state = State(MUTATION_OUTPUT_KINDS[spec.kind], spec.target)
                    self.mutation_outputs.append((state, arg))
                else:
                    self.other_outputs.append((spec, arg))
        # A program whose only writes are trailing write-backs is functional already.
        write_backs = set() if self.is_ep else set(trailing_write_backs(program))
        self.roots = {self.state_root[s] for s, _ in self.mutation_outputs} | scan.written_roots
        self.roots |= set(self.state_views)
        self.has_writes = bool(self.skipped) or bool(self.refused_metadata) or any(
            str(n.target).endswith("_") or "writes" in reason
            for n, reason in self.opaque.items() if n not in self.skipped)
        # A whole-state copy as a mutation output is a write to fold away, unless its
        # source is another output too: then it is that output's own value (``_finish``).
        returned = set(self.output.all_input_nodes)
        self.has_writes |= any(n not in write_backs for n in scan.writing_nodes) or any(
            isinstance(a, Node) and target_of(a) is aten.copy.default
            and _fresh_like(a.args[1], a) and a.args[1] not in returned
            for _, a in self.mutation_outputs)
        return inlined.dead, metadata.dead

    @functools.cached_property
    def order(self) -> dict[Node, int]:
        """Graph positions, asked only about a relayout: nodes inserted since keep the
        original nodes' relative order."""
        return {n: i for i, n in enumerate(self.graph.nodes)}

    # -- building blocks --------------------------------------------------------------
    def emit(self, like: Node, target: Any, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.cursor):
            node = self.graph.call_function(in_dialect_of(like, target), args, kwargs)
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
                following = chain[k + 1] if k + 1 < len(chain) else None
                self.memo[key] = self._replay(view, values[-1], following)
            values.append(self.memo[key])
        return values

    def _replay(self, view: Node, base: Node, following: Node | None = None) -> Node:
        if target_of(view) in ELEMENT_VIEWS:
            # Result i (taken by the ``following`` getitem) views input i only: the op
            # again, on ``base`` at i and the other inputs (their shapes) as they are now.
            tensors = list(argument_value(view, schema_of(view), 0))
            tensors[following.args[1]] = base
            tensors = [t if j == following.args[1] else self.resolve(t)
                       for j, t in enumerate(tensors)]
            return self.emit(view, view.target, tensors, *view.args[1:], **view.kwargs)
        if target_of(view) in STORAGE_VIEWS:  # ``base`` is the storage root's current value
            size, stride = view.args[1:3]
            offset = self._storage_offset(view, view, view.meta.get("val"))
            return self.emit(view, aten.as_strided.default, base, size, stride, offset)
        if view.target is operator.getitem:
            return self.emit(view, operator.getitem, base, view.args[1])
        schema = schema_of(view)
        index = view_base_index(view)
        args, kwargs = list(view.args), dict(view.kwargs)
        shared = shared_input(view)
        if shared is not None and shared[1] is not None:
            # A view of one element of a list argument (``einsum``'s operands): that
            # element is ``base``, the others their values now.
            base = [base if j == shared[1] else self.resolve(t) for j, t in enumerate(
                argument_value(view, schema, index))]
        if index < len(args):
            args[index] = base
        else:
            kwargs[schema.arguments[index].name] = base
        return self.emit(view, view.target, *args, **kwargs)

    def _set_args(self, node: Node, args: tuple, kwargs: dict) -> None:
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
        if is_maybe_view(node) and "val" in node.meta and not (
            self.aliases[node].root is node and same_metadata(old_inputs, node.all_input_nodes)
        ):
            # Whether it is a view is read from storage sharing: keep that true of its new input.
            # A copy (reshape of an expanded cache) of inputs with unchanged metadata stays a
            # copy with the same metadata, so its value needs no new fake dispatch.
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
            check_write(node, [w for _, w in writes], self.aliases, self.states, self.program)
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
            _fresh_like(node.args[1], written)
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
        if variant.out_args:
            args, kwargs = _in_out_dtype(variant.functional, args, kwargs, writes)
        call = self.emit(node, variant.functional, *args, **kwargs)
        # One new value per written argument: a written list's (``_foreach_add_``) is a list.
        written_args = list(dict.fromkeys(i for i, _ in writes))
        n_results = n_returns + (0 if variant.returns_written else len(written_args))
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
            new_values = self._new_values(node, writes, written_args, call, result,
                                          n_returns, n_results)
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

    def _new_values(self, node: Node, writes: list[tuple[int, Node]], written_args: list[int],
                    call: Node, result: Any, n_returns: int, n_results: int) -> list[Node]:
        """The new value of each written tensor among the functional call's results: the
        result of its argument, or that result's element when the argument is a list."""
        schema = target_of(node)._schema
        lists: dict[int, Node] = {}
        taken: Counter[int] = Counter()
        values = []
        for i, _ in writes:
            j = n_returns + written_args.index(i)
            if not isinstance(argument_value(node, schema, i), (list, tuple)):
                values.append(result(j))
                continue
            if i not in lists:
                lists[i] = call if n_results == 1 else result(j)
            values.append(self.emit(node, operator.getitem, lists[i], taken[i]))
            taken[i] += 1
        return values

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
            if torch.Tag.reduction in getattr(target_of(node), "tags", ()):
                # An out= reduction computes in its out tensor's dtype (std, var, logsumexp
                # into a float32 buffer from float16 differ from a cast of their result);
                # one with a dtype argument was given it (``_in_out_dtype``), these have none.
                raise UnsupportedMutationError(
                    node, f"it reduces into {written.name} of dtype {old.dtype}, computing in "
                          f"that dtype as torch's out= reductions do, and its functional form "
                          f"computes in {val.dtype} with no dtype argument: compute the value "
                          f"in {old.dtype} (from the input converted to it) and copy_ it",
                    "no-variant")
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
        self._hold(root, new, writer)
        if view_value is not None and same_strides(view_value, written):
            self.memo[(root, chain, self.version[root])] = view_value

    def _hold(self, root: Node, value: Node, writer: Node | None = None) -> None:
        """``root``'s storage now holds ``value``: its next version (written by ``writer``,
        whose meta a write-back copies)."""
        self.cur[root] = value
        self.version[root] = self.version.get(root, 0) + 1
        if writer is not None:
            self.last_writer[root] = writer

    # -- writes through a view ----------------------------------------------------------
    def _write_back(self, writer: Node, written: Node, new: Node) -> tuple[Node, Node | None]:
        """The root's new value once the view ``written`` holds ``new``, and the view's
        own new value when ``new`` is it (None: ``new`` holds stale values at aliased
        positions the op did not write, so the view must be read from the root)."""
        emit = functools.partial(self.emit, writer)
        alias = self.aliases[written]
        root, chain = alias.root, alias.chain
        self.statistics["writes through a view written back into their base"] += 1
        if needs_written_positions(chain, writer, written):
            selection = written_positions(writer, written, root)
            if selection is None:
                # Its plain write-back would store an aliased element once per position,
                # old and new values: refused.
                view = next(v for v in chain
                            if target_of(v) in STORAGE_VIEWS and overlaps_itself(v))
                raise UnsupportedMutationError(
                    writer, f"{written.name} is written through {view.name}, which addresses "
                            "some storage elements more than once (overlapping strides), and "
                            f"{target_of(writer)} is not proven to give each of them one "
                            "value", "overlap")
            target, args = selection
            val, root_val = written.meta["val"], root.meta["val"]
            # The map below numbers the root's elements in storage order: the root must be
            # a contiguous tensor owning its storage (else a "storage" refusal).
            self._storage_offset(writer, written, val)
            self.statistics["of which through an overlapping view, where the op wrote"] += 1
            storage = emit(aten.arange.start_step, 0, root_val.numel(), 1, dtype=torch.int64,
                           device=root_val.device)  # the core ATen overload (Edge programs)
            positions = emit(aten.as_strided.default, storage, list(val.shape),
                             list(val.stride()), val.storage_offset())
            picked = emit(aten.view.default, emit(target, positions, *args), [-1])
            values = emit(aten.view.default, emit(target, new, *args), [-1])
            flat = emit(aten.view.default, self.cur[root], [-1])
            put = emit(aten.index_put.default, flat, [picked], values)
            return emit(aten.view.default, put, list(root_val.shape)), None
        bases = self._view_values(root, chain[: -len(view_steps(chain)[-1])])
        return write_back_chain(emit, chain, bases, new), new

    # -- storage and layout readers ----------------------------------------------------
    def _check_relayout(self, node: Node, written: Node, what: str) -> None:
        """A tensor whose shape or strides change: fine for an intermediate no earlier view
        reads (later readers read the new value); refused for state and viewed tensors."""
        alias = self.aliases[written]
        earlier = [n for n, a in self.aliases.items() if a.root is alias.root and a.chain
                   and self.order[n] < self.order[node] and n.op == "call_function"
                   and view_base_index(n) is not None]
        if alias.chain or alias.root in self.states or earlier:
            why = (f"{written.name} is program state" if alias.root in self.states else
                   f"{alias.root.name} is read through views taken before" if not alias.chain
                   else f"{written.name} is a view of {alias.root.name}")
            raise UnsupportedMutationError(
                node, f"{what} changes the shape/strides of {written.name}, and {why}",
                "relayout")
        self.relaid.add(alias.root)

    def _storage_offset(self, node: Node, view: Node, val: Any) -> int:
        """``val``'s offset in the storage of ``view``'s root, whose current value then
        stands for that storage: refused when the root is not exactly its own storage."""
        root = self.aliases[view].root
        cur = self.cur.get(root, root)
        if root in self.relaid:
            raise UnsupportedMutationError(
                node, f"it reads the storage of {root.name}, whose shape/strides a write "
                      "changed", "storage")
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
        if alias is not None and alias.root in self.state_views:
            # Its storage is laid out as eager's only until the first call has ended.
            raise UnsupportedMutationError(
                node, f"it reads the storage of {alias.root.name}, whose strides a metadata "
                      "mutation changes, so its storage order is not eager's", "storage")
        if alias is None or self.cur.get(alias.root, alias.root) is alias.root:
            return False
        if target_of(node) in STORAGE_VIEWS:
            ver = self.version[alias.root]
            self.value[node] = (self._view_values(alias.root, (node,))[-1], ver)
            self.stale.append(node)
            return True
        # as_strided_copy(input, size, stride, offset=input's offset)
        schema = target_of(node)._schema
        offset = self._storage_offset(node, source, source.meta.get("val"))
        given = argument_value(node, schema, 3)
        if given is not None:
            offset = given
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

    # -- the output and commit ----------------------------------------------------------
    def _finish(self, output: Node) -> None:
        own = self._own_coordinates(output)
        for root, form in self.state_views.items():
            # State whose strides changed in place, not its shape: its caller reads the
            # object's logical value, which is written back (as torch's functionalization
            # does). Unwritten, that value still reads the state's own storage: copy it.
            final = self.resolve(form)
            if self.version.get(root, 0) == 0:
                final = self.emit(form, aten.clone.default, final)
            self._hold(root, final, form)
        for state, arg in self.mutation_outputs:
            root = self.state_root[state]
            if isinstance(arg, Node) and self.resolve(arg) is not root:
                self._hold(root, self.resolve(arg), arg)
        # Parameters, buffers, then user inputs, each in input order: run_decompositions'.
        finals = []
        for kind in (PARAMETER, BUFFER, USER_INPUT):
            for root in self.state_root.values():
                state = self.states[root]
                if state.kind == kind and self.version.get(root, 0) > 0:
                    final = self.cur[root]
                    if target_of(final) is aten.copy.default and _fresh_like(final.args[1], final):
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
            self._hold(root, value)
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
            copy.meta.update((k, v) for k, v in self.last_writer[root].meta.items()
                             if k not in _VALUE_META)
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


def _fresh_like(src: Any, dst: Node) -> bool:
    """Whether ``src`` is a fresh tensor (no view of anything) with ``dst``'s shape and
    dtype: then ``copy(dst, src)`` equals ``src``, and ``dst.copy_(src)`` makes ``dst``
    hold exactly ``src``. Re-exported programs keep one such whole-buffer copy per
    mutated buffer; ``run_decompositions`` drops them, and so does this pass."""
    if not isinstance(src, Node) or src.op != "call_function" or is_maybe_view(src):
        return False
    if view_base_index(src) is not None or (
        src.target is operator.getitem and isinstance(src.args[0], Node)
        and view_base_index(src.args[0]) is not None
    ):
        return False
    a, b = src.meta.get("val"), dst.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device)


def _in_out_dtype(functional: Any, args: tuple, kwargs: dict, writes: list[tuple[int, Node]]
                  ) -> tuple[tuple, dict]:
    """The functional call of an ``out=`` op given ``dtype=out.dtype`` when the op leaves
    its dtype unset and the functional op takes one.

    An ``out=`` reduction, scan or factory computes in its out tensor's dtype, not in the
    one it would return: ``torch.sum(x_half, 0, out=f32)`` sums in float32 and
    ``torch.cumsum(x, 0, out=int64)`` casts before it sums, so a cast of the functional
    result would differ from eager (checked against eager for sum, prod, mean, nansum,
    cumsum, cumprod, linspace, logspace, hann_window, randn, rand: the dtype argument
    matches it everywhere, the cast does not)."""
    schema = getattr(functional, "_schema", None)
    out = writes[0][1].meta.get("val") if len(writes) == 1 else None
    if schema is None or not isinstance(out, torch.Tensor):
        return args, kwargs
    for i, argument in enumerate(schema.arguments):
        if argument.name == "dtype" and isinstance(argument.type, torch.OptionalType):
            if i < len(args) and not argument.kwarg_only:
                if args[i] is None:
                    args = (*args[:i], out.dtype, *args[i + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": out.dtype}
            break
    return args, kwargs


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


def _check_one_fake_mode(graph: torch.fx.Graph) -> None:
    """Refuse a graph whose fake values come from several fake modes: ``make_fx``'s real
    tracing records each node's value alone, in a mode of its own, so a view's value has
    lost its base and storage offset (``as_strided(b, (2,), (4,), 1)`` records offset 0),
    and a rewrite reading them would write back at the wrong place."""
    first = None
    for node in graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, FakeTensor):
            continue
        if first is None:
            first = val.fake_mode
        elif val.fake_mode is not first:
            raise UnsupportedMutationError(
                node, "the graph's values were recorded in several fake modes (as "
                      "make_fx's real tracing records them), so views do not record their "
                      "base and storage offset; trace it with make_fx(..., "
                      "tracing_mode='fake') or torch.export.export", "fake-failure")


def _repair_use_lists(graph: torch.fx.Graph) -> None:
    """Record every use in its input's ``users``: torch.export can leave a graph where a
    node reads an input whose ``users`` misses it (seen around no_grad regions), and
    re-wiring such a node then fails inside FX. Adds bookkeeping only, no graph change."""
    for node in graph.nodes:
        for arg in node._input_nodes:  # all_input_nodes, without building a list per node
            if node not in arg.users:
                arg.users[node] = None


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


def _respec(spec: OutputSpec, arg: Any) -> OutputSpec:
    if isinstance(arg, Node) and isinstance(spec.arg, TensorArgument):
        return OutputSpec(spec.kind, TensorArgument(name=arg.name), spec.target)
    return spec
