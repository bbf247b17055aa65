"""UnfreezeMutableBuffer: a converted program reads its mutable buffers' current values again."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from pass_manager import GRAPH_MODULE, Effects, Pass, PassResult
from pass_manager._rollback import transaction

from ._analysis.buffers import (
    INITIAL_META,
    MUTABLE_BUFFER_META,
    buffer_nodes,
    buffer_tensor,
    replace_buffer_tensor,
)
from ._analysis.data_movement import DATA_MOVEMENT_OPS, buffer_of
from ._analysis.folded_writes import folded_state_writes
from ._analysis.frozen_reads import (
    FrozenRead,
    NoFrozenMutableBuffers,
    frozen_buffer_reads,
    frozen_nodes,
)
from ._analysis.marked_state import initial_values
from ._analysis.op_schema import may_write, written_arguments
from ._analysis.quantize_ops import is_dequantize, is_quantize
from .errors import FoldedStateWriteError

__all__ = ["UnfreezeMutableBuffer"]

_QUANTIZE = torch.ops.quantized_decomposed.quantize_per_tensor.default
_BUFFER_META = (MUTABLE_BUFFER_META, INITIAL_META, "tensor_meta", "val")


def _buffer_attr_nodes(gm: GraphModule) -> dict[str, Node]:
    """The first ``get_attr`` node of each buffer, by FQN."""
    found: dict[str, Node] = {}
    for node, fqn in buffer_nodes(gm).items():
        found.setdefault(fqn, node)
    return found


@dataclass(frozen=True, repr=False)
class UnfreezeMutableBuffer(Pass):
    """Replace each frozen quantized read of a mutable buffer by a live read.

    ``convert_pt2e(fold_quantize=True)`` constant-folds ``quantize(buffer)`` into a
    ``_frozen_param`` attribute unless torchao recognises the buffer as mutable (it looks
    for ``copy_`` / ``put_`` in op names, so a buffer updated by ``add_`` is missed). The
    converted program then reads a stale copy forever. This pass puts back the buffer
    read, the ops on the way (views, a ``getitem`` of ``chunk``, pure ops of the buffer
    alone such as ``flip``, ops joining several reads of mutable buffers such as
    ``torch.stack([s[0], s[0]])``), and a ``quantize_per_tensor`` with the qparams the
    frozen value was made with. A frozen read whose dequantized value is the destination of a
    data-movement op (``index_put``, ``index_copy``, ``copy_``) is re-wired to the buffer
    itself: data movement is not quantized.

    Folding also *runs* each in-place write of state that reads buffers and constants alone
    (a step counter's ``pos.add_(1)``, a decay's ``state.mul_(0.9)``) once, on the
    program's own buffers: the converted program would start one step ahead of the
    prepared one. When the program holds folded constants, each buffer such a write
    advanced is put back to the value ``MarkMutableBuffers`` recorded (what
    ``reset_mutable_buffers`` restores before ``convert_pt2e``); a note names it.

    In a program quantized in place (``PassQuantizer(transform=[MarkMutableBuffers()])``,
    not functionalized), an in-place write chained on another (``s.add_(x).clamp_(-1, 1)``)
    writes the first one's result, an alias of the buffer, which the quantizer observed:
    converted, it writes the dequantized copy, and the buffer never gets it (off eager by
    1.08). Each such write whose copy nothing reads after it is re-wired to write the
    buffer's alias again, as eager does; a note names it.

    Provenance: exact when the program was quantized with ``PassQuantizer`` after
    ``MarkMutableBuffers`` (the observer of each buffer read is recorded on the buffer's
    node). Otherwise each frozen constant is matched against the live mutable buffers
    (the marked ones, or every buffer the graph writes) and its qparams: quantizing the
    buffer's current value must give the constant exactly, so run this right after
    ``convert_pt2e``. A constant matching several buffers raises
    ``AmbiguousFrozenBufferError`` listing them; the program is left unchanged. It
    accepts the GraphModule form only: what ``convert_pt2e`` returns.

    Example::

        before:  %q = get_attr[_frozen_param1]
                 %dq = dequantize_per_tensor(%q, 0.0077, 27, -128, 127, torch.int8)
        after:   %acc = get_attr[acc]
                 %q = quantize_per_tensor(%acc, 0.0077, 27, -128, 127, torch.int8)
                 %dq = dequantize_per_tensor(%q, 0.0077, 27, -128, 127, torch.int8)

    Raises:
        ProgramFormError: an ExportedProgram (pass the GraphModule ``convert_pt2e``
            returned, or the program's ``.module()``), or no program at all.
        PassFailedError: run by a PassManager or called as ``pass_(program)``, in place
            of the errors below (its ``__cause__``); the program is left as it was.
        AmbiguousFrozenBufferError: raised by ``call`` when a frozen constant matches the
            reads of several mutable buffers and no provenance was recorded.
        UnreplayableFrozenReadError: raised by ``call`` when a frozen constant stands for
            a value recorded (``PassQuantizer``) as computed from mutable buffers and
            constants through ops no read replays (``index_select`` by a constant index):
            quantize a functional program instead (``quantize_program``).
        FoldedStateWriteError: raised by ``call`` when folding ran a write of a buffer no
            ``MarkMutableBuffers`` mark gives a starting value for (the program was
            prepared straight from ``torch.export.export(...).module()``).
    """

    provides = frozenset({NoFrozenMutableBuffers})
    accepts = (GRAPH_MODULE,)
    # Only the new nodes' meta is filled. A buffer folding advanced is replaced by a fresh
    # tensor, not written: declaring ``writes_state`` would copy every buffer (a whole KV
    # cache) before each run for a case most programs never meet.
    effects = Effects.rewrite(meta_keys=())

    def call(self, program: GraphModule) -> PassResult:
        # A failure after a buffer was put back restores it too: the manager's rollback
        # record, or, when ``call`` is called directly, the one the transaction takes.
        with transaction(program, self.effects):
            notes = self._put_back_folded_writes(program)
            restored = len(notes)
            into_copies = _writes_into_copies_rewired(program)
            notes += into_copies
            found = frozen_buffer_reads(program, self.name)
            buffers = _buffer_attr_nodes(program)
            rewired = 0
            for frozen in found:
                note, count = self._unfreeze(program, frozen, buffers)
                notes.append(note)
                rewired += count
            statistics = {"frozen buffer reads unfrozen": len(found)} if found else {}
            if rewired:
                statistics["data-movement writes re-wired into the buffer"] = rewired
            if restored:
                statistics["buffers put back after folding ran their writes"] = restored
            if into_copies:
                statistics["in-place writes of state re-wired from a dequantized copy"] = \
                    len(into_copies)
            if found:
                program.graph.lint()
                _drop_unused_frozen(program, {str(f.node.target) for f in found})
            if into_copies:
                program.recompile()
        return PassResult(program, bool(found) or bool(restored) or bool(into_copies), notes,
                          statistics)

    def _put_back_folded_writes(self, gm: GraphModule) -> list[str]:
        """Put each buffer torchao's folding wrote back to its marked starting value, as a
        fresh tensor in its place (the advanced one, which the program it was prepared from
        may share, is left as it is); one note per buffer changed. Nothing to do when
        nothing was folded (``fold_quantize`` off): then no write ran."""
        if not frozen_nodes(gm):
            return []
        advanced = folded_state_writes(gm)
        if not advanced:
            return []
        initial = initial_values(gm)
        unknown = sorted(fqn for fqn in advanced if fqn not in initial)
        if unknown:
            raise FoldedStateWriteError(self.name, advanced[unknown[0]][0].name, unknown)
        notes = []
        fresh: dict[int, torch.Tensor] = {}  # by the advanced tensor: tied names stay tied
        for fqn, writes in advanced.items():
            tensor = buffer_tensor(gm, fqn)
            if torch.equal(tensor, initial[fqn]):
                continue
            if id(tensor) not in fresh:
                value = initial[fqn].clone()
                fresh[id(tensor)] = (torch.nn.Parameter(value, tensor.requires_grad)
                                     if isinstance(tensor, torch.nn.Parameter) else value)
            replace_buffer_tensor(gm, fqn, fresh[id(tensor)])
            notes.append(f"{fqn}: put back to its marked starting value; convert_pt2e's "
                         f"constant folding had run {', '.join(w.name for w in writes)} on it")
        return notes

    @staticmethod
    def _unfreeze(gm: GraphModule, frozen: FrozenRead, known: dict[str, Node]
                  ) -> tuple[str, int]:
        graph, node, read = gm.graph, frozen.node, frozen.read

        def read_buffer(fqn: str) -> Node:
            buffer = graph.get_attr(fqn)
            if fqn in known:
                buffer.meta.update({k: v for k, v in known[fqn].meta.items()
                                    if k in _BUFFER_META})
            return buffer

        with graph.inserting_before(node):
            value = read.emit(graph, read_buffer)
            quantize = graph.call_function(_QUANTIZE, (value, *frozen.qparams))
        quantize.meta.update({k: v for k, v in node.meta.items() if k not in _BUFFER_META})
        rewired = []
        if not read.chain:  # ``value`` is the buffer's own node
            for dequantize in list(node.users):
                for user in list(dequantize.users):
                    packet = getattr(user.target, "overloadpacket", None)
                    writes = DATA_MOVEMENT_OPS.get(packet) is not None
                    if writes and user.args[0] is dequantize:
                        user.replace_input_with(dequantize, value)
                        rewired.append(user.name)
        node.replace_all_uses_with(quantize)
        graph.erase_node(node)
        for dequantize in list(quantize.users):
            if not dequantize.users:
                graph.erase_node(dequantize)
        if not quantize.users:
            graph.erase_node(quantize)
        note = f"{node.name}: {node.target} -> live quantized read of {read.describe()}"
        if rewired:
            note += f"; {', '.join(rewired)} now write(s) into the buffer itself"
        return note, len(rewired)


def _writes_into_copies_rewired(gm: GraphModule) -> list[str]:
    """Make each in-place write of a mutable buffer's alias that ``convert_pt2e`` turned
    into a write of a dequantized copy (``clamp_(dequantize(quantize(add_)))``, the
    ``add_`` an in-place result on the buffer) write the alias again; one note per write.

    Eager writes the buffer there. Left when the copy has a reader after the write (it
    would read the write in the copy, and the unwritten value once re-wired)."""
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    memo: dict[Node, str | None] = {}
    notes = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not may_write(node):
            continue
        for _, copy in written_arguments(node):
            if not (is_dequantize(copy) and copy.args
                    and isinstance(quantize := copy.args[0], Node) and is_quantize(quantize)
                    and isinstance(alias := quantize.args[0], Node)):
                continue
            fqn = buffer_of(alias, memo)
            if fqn is None or any(order[user] > order[node] for user in copy.users
                                  if user is not node):
                continue
            node.replace_input_with(copy, alias)
            notes.append(f"{node.name}: wrote a dequantized copy of {alias.name} (buffer "
                         f"{fqn!r}); now writes {alias.name}, the buffer, as eager does")
    return notes


def _drop_unused_frozen(gm: GraphModule, targets: set[str]) -> None:
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets - used:
        owner_path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if leaf in owner._buffers:
            del owner._buffers[leaf]
        elif hasattr(owner, leaf):
            delattr(owner, leaf)
