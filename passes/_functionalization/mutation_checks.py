"""What InplaceToFunctional refuses to rewrite, and the typed error that says so.

Refused: a write to a lifted constant (torch refuses it too), a write through a view with
no write-back, a written tensor that may partially overlap another argument of the same
op, an operand sharing elements with (or being) the tensor written by an op whose eager
result then is not its functional form's (a matrix product, ``masked_scatter_``) or that
eager refuses then (index and scatter ops), an opaque node (no schema, or a higher-order
op writing inside its subgraph) that receives mutable state, and written state sharing its
storage with other state or with itself (a buffer registered expanded), and a random
write laid out so that eager draws other numbers than its functional form
(``random_writes``). Each is an
:class:`~passes.errors.UnsupportedMutationError` naming the node and the reason. A write
through a view addressing an element twice is checked where it is written back
(``overlapping_writes``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.fx import Node
from torch.multiprocessing.reductions import StorageWeakRef

from .._analysis.aliasing import Alias
from .._analysis.buffers import BUFFER, CONSTANT, USER_INPUT, State, buffer_tensor
from .._analysis.op_schema import argument_value, target_of
from ..errors import UnsupportedMutationError
from .element_overlap import addresses_twice, may_overlap, may_share, tensors_may_share
from .overlapping_writes import stores_aliased_positions
from .random_writes import check_random_layout
from .view_inverse import write_back_reason

__all__ = ["check_opaque", "check_shared_storage", "check_write"]

aten = torch.ops.aten


def check_opaque(node: Node, reason: str | None, aliases: dict[Node, Alias], roots: set[Node],
                 states: dict[Node, State]) -> None:
    """An opaque node (no schema) must neither write nor receive mutable state."""
    if reason is None:
        return
    if "writes" in reason or str(node.target).endswith("_"):
        raise UnsupportedMutationError(node, reason, "opaque")
    touched = [a for a in node.all_input_nodes
               if a in aliases and (aliases[a].root in roots or aliases[a].root in states)]
    if touched:
        names = ", ".join(a.name for a in touched)
        raise UnsupportedMutationError(
            node, f"{reason}, so it may write the mutable state it receives ({names})", "opaque")


def _storage(tensor: object) -> StorageWeakRef | None:
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return None
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a subclass without one storage
        return None


def _buffer_holding(program: object, states: dict[Node, State], constant: str) -> str | None:
    """The buffer of ``program`` whose storage the constant ``constant`` shares: non-strict
    export lifts a tensor reached through a plain Python object as a constant even when the
    module registers it, or the tensor it views, as a buffer. A constant that is exactly a
    buffer's tensor (transformers' ``StaticCache`` layers) never gets here: it is read and
    written as that buffer (``buffer_constants``)."""
    storage = _storage(buffer_tensor(program, constant))
    if storage is None:
        return None
    return next((s.name for s in states.values()
                 if s.kind == BUFFER and _storage(buffer_tensor(program, s.name)) == storage),
                None)


def _constant_write_reason(program: object | None, states: dict[Node, State],
                           constant: str) -> str:
    buffer = None if program is None else _buffer_holding(program, states, constant)
    if buffer is None:
        return f"it writes the constant {constant!r}; register it as a buffer"
    return (f"it writes the constant {constant!r}, which shares the storage of the "
            f"registered buffer {buffer!r} without being that buffer's tensor (non-strict "
            "export lifts a tensor reached through a plain Python object as a constant; one "
            "that is exactly a buffer's tensor is read and written as the buffer); export "
            "strict (torch.export.export(..., strict=True)), which reads and writes the "
            "buffer, or register the tensor the program writes as the buffer")


def check_write(node: Node, written: list[Node], aliases: dict[Node, Alias],
                states: dict[Node, State], program: object | None = None) -> None:
    """A write the rewrite can express exactly, or an UnsupportedMutationError
    (``program``: to name the buffer a written constant is the tensor of)."""
    inputs = [a for a in node.all_input_nodes if a in aliases]
    _check_written_once(node, written, aliases)
    _check_operands_read_while_written(node, written, aliases)
    check_random_layout(node, written)
    for w in written:
        alias = aliases[w]
        state = states.get(alias.root)
        if state is not None and state.kind == CONSTANT:
            # A constant is not program state: a write to it cannot be an output of the
            # program (torch's functionalization refuses it too: "register it as buffer").
            raise UnsupportedMutationError(
                node, _constant_write_reason(program, states, state.name), "writes-constant")
        if state is not None and state.kind != USER_INPUT and _laid_out_overlapping(
                alias.root) and target_of(node) is not aten.copy_.default and (
                stores_aliased_positions(node, w)):
            raise UnsupportedMutationError(
                node, f"it writes {w.name}, which addresses some storage elements of the "
                      f"{state.kind} {state.name!r} more than once (the {state.kind} is "
                      "registered with overlapping strides), and it is not proven to give "
                      "each of them one value; register it with .contiguous()", "overlap")
        for view in alias.chain:
            reason = write_back_reason(view)
            if reason is not None:
                raise UnsupportedMutationError(node, reason, "no-write-back")
        for other in inputs:
            same = aliases[other]
            if other is not w and same.root is alias.root and same != alias and (
                may_overlap(w, other)
            ):
                raise UnsupportedMutationError(
                    node, f"the written {w.name} and the argument {other.name} are views of "
                          "one storage that may partially overlap", "overlap")


def _operand_table(names: dict[str, tuple[str, ...]]) -> dict[Any, tuple[str, ...]]:
    """Every writing overload (in place or ``out=``) of each named op, with the operands
    among its arguments (``scatter_.value`` has no ``src``)."""
    table = {}
    for name, operands in names.items():
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            arguments = [a.name for a in op._schema.arguments]
            present = tuple(o for o in operands if o in arguments)
            if op._schema.is_mutable and present:
                table[op] = present
    return table


_PRODUCTS = _operand_table({
    "mm": ("self", "mat2"), "bmm": ("self", "mat2"), "matmul": ("self", "other"),
    "mv": ("self", "vec"), "addmm": ("mat1", "mat2"), "addmm_": ("mat1", "mat2"),
    "_addmm_activation": ("mat1", "mat2"), "baddbmm": ("batch1", "batch2"),
    "baddbmm_": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"),
    "addbmm_": ("batch1", "batch2"), "addmv": ("mat", "vec"), "addmv_": ("mat", "vec"),
    "kron": ("self", "other"), "linalg_matrix_power": ("self",),
    "linear": ("input", "weight", "bias"),
})
"""Matrix products, ``out=`` and in place, whose CPU kernels (BLAS gemm / gemv) write the
tensor they write while still reading these operands: given one sharing an element with
it, eager's result is whatever the kernel's order leaves (``torch.mm(a, b, out=a)`` is off
the product by 5.7 on a 4x4 probe, ``b.addmm_(b, x)`` by 1.2 on a 3x3 one), while a
functional form computes the product. (``addmm``'s own ``self`` is read first, as BLAS's
``C``: an out tensor that is ``self`` is exact.)"""

_ORDER_DEPENDENT = _operand_table({"masked_scatter_": ("source",),
                                   "masked_scatter": ("source",)})
"""Ops eager runs element after element with no overlap check, reading an operand that
earlier elements may have written: ``b.masked_scatter_(mask, b)`` takes the k-th source
element after the first k-1 positions were written (off the functional form by 2.0 on a
3x3 probe)."""

_INITIALIZES_OUT = _operand_table({
    name: ("self",) for name in ("sum", "nansum", "mean", "prod", "amax", "amin", "all",
                                 "any", "histc")})
"""``out=`` reductions whose CPU kernels first fill the out tensor with the reduction's
identity (0, 1, -inf, True, ...) and then read the input: given an out tensor sharing an
element with the input (``torch.sum(b, 1, keepdim=True, out=b)`` of a (4, 1) ``b``), eager
reduces the values it has just overwritten (``0.0`` where the functional sum gives 2.54;
``amax`` gives ``-inf``). Measured against eager on torch 2.13 for every ``out=`` op tagged
``reduction`` and for ``histc``: ``logsumexp``, ``max`` / ``min`` along a dim, ``aminmax``,
``norm``, ``std``, ``var``, ``median``, ``mode`` and the scans read their input first and
are exact, so they are not listed."""

_READS_WHAT_IT_WROTE = _operand_table({
    "avg_pool2d": ("self",), "avg_pool3d": ("self",), "max_pool2d_with_indices": ("self",),
    "max_pool3d_with_indices": ("self",), "linalg_solve_triangular": ("self",),
    "ormqr": ("self",), "linalg_ldl_solve": ("LD",), "normal": ("mean", "std"),
    "searchsorted": ("sorted_sequence", "sorter"), "bucketize": ("boundaries",),
})
"""``out=`` ops whose kernels read input elements after they wrote the out tensor's: a
pooling window reaches positions written before it (``avg_pool2d(b, 3, 1, 1, out=b)``
off the functional pool by 0.35, ``max_pool2d`` by 1.6), a triangular solve or
``ormqr`` reads the matrix rows it has already replaced (0.84 and 1.46), ``normal``
draws into the out tensor before it scales and shifts by ``std`` and ``mean``
(``torch.normal(b, zeros, out=b)`` gives 0 where the functional form gives ``b``), and
``searchsorted`` / ``bucketize`` search a sequence whose first elements they already
replaced (``[1, 3, 4, 1, 5]`` where the functional search gives ``[1, 3, 4, 2, 5]``); measured on
torch 2.13, where the adaptive pools, upsampling, padding, ``triangular_solve`` and the
other ``linalg`` ``out=`` ops given their input are exact."""

_EAGER_REFUSES = _operand_table({
    name: operands for names, operands in (
        (("index_copy_", "index_copy", "index_add_", "index_add", "index_reduce_",
          "index_reduce", "put_", "put"), ("index", "source")),
        (("scatter_", "scatter", "scatter_add_", "scatter_add", "scatter_reduce_",
          "scatter_reduce"), ("index", "src")),
        (("index_put_", "index_put", "_index_put_impl_", "_index_put_impl"),
         ("indices", "values")),
        (("index_select", "gather", "take"), ("self", "index")),
        (("linalg_cross",), ("self", "other")),
    ) for name in names
})
"""Ops whose eager kernels refuse an operand sharing an element with the tensor they write
(``at::assert_no_overlap``: "some elements of the input tensor and the written-to tensor
refer to a single memory location"), the very same tensor included
(``b.index_copy_(0, i, b)``, ``torch.take(b, i, out=b)``): fake tensors do not check it,
so export keeps such a call, and its functional form would return a value where eager
raises. (An operand eager cannot tell, an expanded one, is checked by nothing in eager.)"""


def _custom_op_operands(op: Any) -> dict[Any, tuple[str, ...]]:
    """A custom op writing an argument: each tensor argument it only reads, since nothing
    says in which order its body reads them and writes (``mutates_args``'s op given
    ``b`` to write and to read). Aten ops' kernels are known: the tables below."""
    schema = getattr(op, "_schema", None)
    if schema is None or getattr(op, "namespace", "aten") in ("aten", "prims") or (
            not schema.is_mutable):
        return {}
    read = tuple(a.name for a in schema.arguments
                 if not (a.alias_info is not None and a.alias_info.is_write))
    return {op: read} if read else {}


_WHY = {
    "custom": "the op's body may read it after it wrote {w}, so eager's result depends on "
              "its order; pass a clone",
    "product": "its kernel still reads it while it writes {w}: eager's result depends on "
               "that order; compute the product, then copy_ it",
    "order": "eager reads it element after element while it writes {w}, so its result "
             "depends on that order; pass a clone",
    "initializes": "its kernel fills {w} with the reduction's initial value before it "
                   "reads the operand, so eager reduces the values it has just overwritten; "
                   "reduce into a fresh tensor, then copy_ it",
    "reread": "its kernel reads elements of it after it wrote them into {w}, so eager's "
              "result depends on that order; compute into a fresh tensor, then copy_ it",
    "refused": "eager refuses such a call where it can tell (\"some elements of the input "
               "tensor and the written-to tensor refer to a single memory location\"), and "
               "its result otherwise depends on the kernel's order; pass a clone",
}


@functools.cache
def _operands_read_while_written(op: Any) -> tuple[tuple[str, int, str], ...]:
    """``op``'s operands that must share no element with the tensor it writes, as
    ``(argument name, position, why)``; once per op (every write asks)."""
    found = []
    for table, why in ((_custom_op_operands(op), "custom"), (_PRODUCTS, "product"),
                       (_ORDER_DEPENDENT, "order"), (_INITIALIZES_OUT, "initializes"),
                       (_READS_WHAT_IT_WROTE, "reread"), (_EAGER_REFUSES, "refused")):
        names = [a.name for a in op._schema.arguments] if op in table else []
        found += [(name, names.index(name), _WHY[why]) for name in table.get(op, ())]
    return tuple(found)


def _check_operands_read_while_written(node: Node, written: list[Node],
                                       aliases: dict[Node, Alias]) -> None:
    """Refuse an op whose operand shares an element with the tensor it writes, the same
    tensor included (views that partially overlap are refused for every op in
    :func:`check_write`), when that op's eager result is not its functional form's."""
    op = target_of(node)
    checks = _operands_read_while_written(op) if isinstance(op, torch._ops.OpOverload) else ()
    for name, position, why in checks:
        value = argument_value(node, op._schema, position)
        for operand in value if isinstance(value, (list, tuple)) else (value,):
            for w in written:
                if isinstance(operand, Node) and operand in aliases and w in aliases and (
                    aliases[operand].root is aliases[w].root and may_share(w, operand)
                ):
                    raise UnsupportedMutationError(
                        node, f"the tensor it writes, {w.name}, shares elements with its "
                              f"operand {name}={operand.name}: " + why.format(w=w.name),
                        "overlap")


def _laid_out_overlapping(root: Node) -> bool:
    """Whether program state is itself laid out addressing an element twice (registered as
    ``x.as_strided((3, 4), (1, 1))``). Writes through its views that address each element
    once are exact, and so is a ``copy_`` (``copy`` and the scatter ops write into a clone
    of its layout, position after position as eager does), but an op writing positions
    that share an element computes each position from the values the positions before
    stored in eager (``add_`` of the whole buffer), from the old values in its functional
    form: refused (torch's ``run_decompositions({})`` gives the wrong values there)."""
    val = root.meta.get("val")
    return isinstance(val, torch.Tensor) and val.layout == torch.strided and addresses_twice(val)


def _check_written_once(node: Node, written: list[Node], aliases: dict[Node, Alias]) -> None:
    """Refuse an op writing one element through two of its written arguments (a custom
    op ``two(a, b)`` given one buffer for both): eager's result is whatever order the
    op's body writes them in, while its functional form computes each new value from the
    old one and the second write-back drops the first. (List ops run one position after
    the other; those whose positions share tensors were split before: ``list_writes``.)"""
    for k, w in enumerate(written):
        for other in written[k + 1:]:
            if w in aliases and other in aliases and (
                aliases[w].root is aliases[other].root and may_share(w, other)
            ):
                what = (f"{w.name} is given for two of its written arguments" if w is other
                        else f"its written arguments {w.name} and {other.name} may share "
                             "an element")
                raise UnsupportedMutationError(
                    node, f"{what}: the order in which the op writes them decides eager's "
                          "result, and its functional form keeps only one of the two new "
                          "values; pass tensors that share no element", "overlap")


def check_shared_storage(program: object, states: dict[Node, State], written: set[State],
                         is_ep: bool) -> None:
    """Refuse a written piece of state that shares its storage with another one the
    program reads (``register_buffer("head", whole[:4])``): the graph names them as two
    inputs, so a functional program would read the other one's old value where eager
    reads the new one. Tied state (one tensor, two names) is one input and passes.

    Refuse too written state that is an expanded tensor (a buffer registered as
    ``torch.arange(4.).expand(3, 4)``: a dim of stride 0 holding several elements): its
    new value, computed whole, cannot be stored back, as ``copy_`` refuses such a
    destination (so the functional program would fail when called, as torch's
    ``run_decompositions({})`` does), and eager's write to one position changes every
    position sharing its element.

    User inputs are checked by the values they were traced with (``meta["val"]``), which
    keep the aliasing of the inputs export was given: a cache written in place passed
    beside a view of it (``f(cache, cache[0])``) reads the old value through the view in
    the functional program, where the program as exported reads the new one (torch's
    ``run_decompositions({})`` fails on it with an ``AssertionError``). One tensor given
    twice is one placeholder to export (the other has no users) and passes."""
    seen: dict[StorageWeakRef, list[tuple[Node, State, torch.Tensor]]] = {}
    for node, state in states.items():
        if not node.users and state not in written:
            continue
        tensor = (node.meta.get("val") if is_ep or state.kind == USER_INPUT
                  else buffer_tensor(program, state.name))
        storage = _storage(tensor)
        if storage is None:
            continue
        if state in written and state.kind not in (CONSTANT, USER_INPUT):
            _refuse_expanded(node, state, buffer_tensor(program, state.name))
        before = seen.setdefault(storage, [])
        # Pieces of one storage sharing no element (a stacked cache's rows registered as
        # buffers of their own) are independent state: neither sees the other's writes.
        first, other = next(((n, s) for n, s, t in before if s != state and (
            state in written or s in written) and tensors_may_share(t, tensor)), (None, None))
        before.append((node, state, tensor))
        if other is not None:
            writer, shared = (node, other) if state in written else (first, state)
            raise UnsupportedMutationError(
                writer, f"the written {states[writer].kind} {states[writer].name!r} shares "
                f"its storage with {shared.kind} {shared.name!r}: the graph takes them as "
                "two inputs, so a functional program would not see one's write in the "
                "other; " + ("pass one tensor and take the other as a view of it in forward"
                             if USER_INPUT in (states[writer].kind, shared.kind) else
                             "register one buffer and take the other as a view of it in "
                             "forward"), "shared-storage")


def _refuse_expanded(node: Node, state: State, tensor: torch.Tensor) -> None:
    """Refuse written state with a dim of stride 0 holding several elements: exactly the
    destinations ``copy_`` refuses (``at::has_internal_overlap`` says YES), the store of a
    functional program's new state included."""
    if torch._debug_has_internal_overlap(tensor) == 1:
        raise UnsupportedMutationError(
            node, f"the written {state.kind} {state.name!r} is an expanded tensor (size "
            f"{tuple(tensor.shape)}, stride {tensor.stride()}): its elements share memory, so "
            "its new value cannot be stored back into it; register it with .contiguous()",
            "overlap")
