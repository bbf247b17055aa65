"""Writing a view's new value back into its base, one view op at a time.

``base.<view>(...)`` mutated to ``value`` makes the base ``<view>_scatter(base, value, ...)``
(slice, select, diagonal; as_strided and _reshape_alias address the storage root) or the
inverse view of ``value`` when the view is a pure re-indexing of every element (transpose,
permute, unsqueeze, view/reshape, alias, and the composite views export keeps: ``.T``,
``.mT``, ``moveaxis``, ``ravel``). ``real``/``imag`` scatter into the base's real view
(of a conjugated base, resolved first); a conjugating view (``conj``, ``.mH``,
``adjoint``) writes back the conjugate, a negating one (``_neg_view``) the negation; an
``expand`` (``expand_as``, ``broadcast_to``) that broadcasts nothing is a reshape; an
``unfold`` whose windows do not overlap places its windows with ``unfold_backward`` and
keeps the base where no window reaches. A view returned by an op declaring no alias
(``einsum("ij->ji", [b])``) laid out otherwise than its contiguous operand is placed back
at its storage positions (``as_strided_scatter`` into the operand's value).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._analysis.fake_values import same_metadata
from .._analysis.op_schema import (
    ELEMENT_VIEWS,
    STORAGE_VIEWS,
    argument_value,
    facts_of,
    shared_input,
    target_of,
)
from .element_overlap import overlaps_itself

__all__ = ["Emit", "write_back", "write_back_reason"]

aten = torch.ops.aten
Emit = Callable[..., Node]
"""``emit(target, *args, **kwargs) -> Node``: insert a call_function node."""


def _args(node: Node) -> list:
    """Arguments after ``self``, with kwargs and schema defaults filled in."""
    schema = target_of(node)._schema
    return [argument_value(node, schema, i) for i in range(1, len(schema.arguments))]


def _shape(node: Node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


_SCATTERS = {
    aten.slice.Tensor: aten.slice_scatter.default,
    aten.select.int: aten.select_scatter.default,
    aten.diagonal.default: aten.diagonal_scatter.default,
    aten.linalg_diagonal.default: aten.diagonal_scatter.default,  # (offset, dim1, dim2) too
}
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                       aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                       aten.flatten.using_ints, aten.unflatten.int, aten.view_as.default,
                       aten.reshape_as.default, aten.type_as.default, aten.sum_to_size.default,
                       aten.ravel.default,
                       aten.atleast_1d.default, aten.atleast_2d.default, aten.atleast_3d.default,
                       aten.dropout.default, aten.feature_dropout.default,
                       aten.alpha_dropout.default, aten.feature_alpha_dropout.default})
_IDENTITIES = frozenset({aten.alias.default, aten.detach.default, aten.to.dtype,
                         aten.to.device, aten.to.dtype_layout, aten.to.other,
                         aten.contiguous.default, aten.lift_fresh.default,
                         aten.positive.default, aten.resolve_conj.default,
                         aten.resolve_neg.default})
# hsplit / vsplit / dsplit are tensor_split along a fixed dim (hsplit: 0 for 1-D input).
_DIRECTIONAL_SPLITS = {
    aten.hsplit.int: (aten.tensor_split.sections, lambda ndim: 0 if ndim == 1 else 1),
    aten.hsplit.array: (aten.tensor_split.indices, lambda ndim: 0 if ndim == 1 else 1),
    aten.vsplit.int: (aten.tensor_split.sections, lambda ndim: 0),
    aten.vsplit.array: (aten.tensor_split.indices, lambda ndim: 0),
    aten.dsplit.int: (aten.tensor_split.sections, lambda ndim: 2),
    aten.dsplit.array: (aten.tensor_split.indices, lambda ndim: 2),
}
# The unsafe_ splits are the splits without autograd's view tracking: the same pieces.
_UNSAFE_SPLITS = {aten.unsafe_split.Tensor: aten.split.Tensor,
                  aten.unsafe_split_with_sizes.default: aten.split_with_sizes.default,
                  aten.unsafe_chunk.default: aten.chunk.default}
_LIST_VIEWS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
                         aten.chunk.default, aten.tensor_split.sections,
                         aten.tensor_split.indices, *_DIRECTIONAL_SPLITS, *_UNSAFE_SPLITS})
# List views whose pieces' bounds are sums of their (possibly symbolic) arguments alone.
_BOUNDS_FROM_ARGUMENTS = frozenset({aten.split_with_sizes.default,
                                    aten.unsafe_split_with_sizes.default,
                                    aten.tensor_split.indices})
# List views whose pieces' bounds depend on the split input's length.
_SIZED_BY_INPUT = frozenset({aten.chunk.default, aten.unsafe_chunk.default,
                             aten.tensor_split.sections, aten.hsplit.int, aten.vsplit.int,
                             aten.dsplit.int})
# Views that re-index every element: a write through one is written back by its inverse.
_INVERSES = {
    aten.movedim.int: lambda view, value, source, destination: (
        aten.movedim.int, value, destination, source),
    aten.movedim.intlist: lambda view, value, source, destination: (
        aten.movedim.intlist, value, destination, source),
    aten.swapaxes.default: lambda view, value, a, b: (aten.swapaxes.default, value, a, b),
    aten.swapdims.default: lambda view, value, a, b: (aten.swapdims.default, value, a, b),
    aten.moveaxis.int: lambda view, value, source, destination: (
        aten.movedim.int, value, destination, source),
    aten.moveaxis.intlist: lambda view, value, source, destination: (
        aten.movedim.intlist, value, destination, source),
    aten.view_as_real.default: lambda view, value: (aten.view_as_complex.default, value),
    aten.view_as_complex.default: lambda view, value: (aten.view_as_real.default, value),
    # Reversing all dims, or swapping the last two, twice is the identity.
    aten.numpy_T.default: lambda view, value: (aten.numpy_T.default, value),
    aten.mT.default: lambda view, value: (aten.mT.default, value),
}
# Views that conjugate (lazily, by the conjugate bit): their write-back conjugates the
# value back when it is complex, then undoes the view's transpose if it has one.
_CONJUGATING = {aten.conj.default: False, aten._conj.default: False,
                aten.adjoint.default: True, aten.mH.default: True,
                aten.matrix_H.default: True}
# Views that broadcast: writable only when they broadcast nothing (then a reshape).
_BROADCASTS = frozenset({aten.expand.default, aten.expand_as.default,
                         aten.broadcast_to.default})
_COMPLEX_PARTS = {aten.real.default: 0, aten.imag.default: 1}
_OTHERS = frozenset({aten.unfold.default, *_COMPLEX_PARTS, aten.narrow.default,
                     aten.transpose.int, aten.t.default, aten.permute.default,
                     aten.unsqueeze.default, aten.view.dtype, aten._neg_view.default,
                     *_BROADCASTS,
                     *_INVERSES, *_CONJUGATING})
_WRITABLE_VIEWS = STORAGE_VIEWS | _SCATTERS.keys() | _RESHAPES | _IDENTITIES | _OTHERS | _LIST_VIEWS


def write_back_reason(view: Node) -> str | None:
    """None if a write through ``view`` can be written back into its base, else why not."""
    target = target_of(view)
    if target is operator.getitem:
        source = view.args[0]
        if isinstance(source, Node) and target_of(source) in _LIST_VIEWS:
            flat = [x for a in _args(source) for x in (a if isinstance(a, (list, tuple)) else [a])]
            static = isinstance(view.args[1], int) and (
                target_of(source) in _BOUNDS_FROM_ARGUMENTS
                or not any(isinstance(x, Node) for x in flat))
            if target_of(source) in _SIZED_BY_INPUT:
                static = static and _shape(source.args[0]) is not None
            return None if static else f"writes through {view.name}, a symbolic split"
        if isinstance(source, Node) and target_of(source) in ELEMENT_VIEWS:
            # A result holding each element of its input once (no broadcasting) is that
            # input reshaped; one that broadcasts addresses an element twice.
            if _broadcasts_nothing(view, _element_input(source, view.args[1])):
                return None
            return (f"writes through {view.name}, a result of {source.name} = "
                    f"{target_of(source)} that broadcasts its input or has symbolic sizes")
        return f"writes through {source} (getitem of a non-view)"
    if target is aten.narrow.default:
        dim, start, _ = _args(view)
        shape = _shape(view.args[0])
        if _is_negative(start) is None and not (
                shape is not None and statically_known_true(shape[dim] >= 1)):
            return (f"writes through {view.name} = narrow from a symbolic start whose sign is "
                    "not known, of a dim that may be empty (narrow counts a negative start "
                    "from the end)")
        return None
    if target is aten.unfold.default:
        _, size, step = _args(view)
        shape = _shape(view.args[0])
        static = shape is not None and all(isinstance(s, int) for s in shape)
        if not (static and isinstance(size, int) and isinstance(step, int) and step >= size):
            return (f"writes through {view.name} = unfold with overlapping windows or "
                    f"symbolic sizes (size {size}, step {step})")
        return None
    if target in _BROADCASTS:
        # Eager refuses writes through a broadcasting expand (elements addressed twice); one
        # that only adds leading size-1 dims is a reshape.
        if _broadcasts_nothing(view, view.args[0]):
            return None
        return (f"writes through {view.name} = {target}, which broadcasts or has symbolic "
                "sizes")
    if target in _WRITABLE_VIEWS or target in ELEMENT_VIEWS:  # (their getitem decides)
        return None
    shared = shared_input(view)
    if shared is not None:
        # Read as a view because it shares an input's storage: writable when it is that
        # input (the same layout), or addresses elements of a contiguous input once each
        # (``einsum("ij->ji", [b])``: placed back by their storage positions).
        if same_metadata([view], [shared[2]]) or _placed_in(view, shared[2]) is not None:
            return None
        return (f"writes through {view.name} = {target}, a view of its input laid out "
                "otherwise (of a non-contiguous input, symbolic, or addressing an element "
                "twice), whose schema declares no alias")
    return (f"writes through the view {view.name} = {target}, which has no write-back into "
            f"its base (no *_scatter and no inverse view)")


def _broadcasts_nothing(view: Node, base: Node) -> bool:
    """Whether ``view`` holds each element of ``base`` once (static sizes, as many
    elements): a broadcasting view is then only a reshape of it."""
    shape, base_shape = _shape(view), _shape(base)
    return (shape is not None and base_shape is not None
            and all(isinstance(s, int) for s in (*shape, *base_shape))
            and math.prod(shape) == math.prod(base_shape))


def write_back(emit: Emit, view: Node, base: Node, value: Node) -> Node:
    """The new value of ``base`` after its view ``view`` (an original node) became ``value``.

    ``base`` is the current value of the view's base; for ``getitem`` of a split/unbind,
    ``base`` is the current value of the split's input.
    """
    target = target_of(view)
    if target is operator.getitem:
        return _write_back_item(emit, view.args[0], view.args[1], base, value)
    if target in _SCATTERS:
        return emit(_SCATTERS[target], base, value, *_args(view))
    if target in STORAGE_VIEWS:
        # ``base`` is the storage root's value (see op_schema.STORAGE_VIEWS), so the
        # offset is the view's own, absolute one.
        size, stride = _args(view)[:2]
        return emit(aten.as_strided_scatter.default, base, value, size, stride,
                    view.meta["val"].storage_offset())
    if target in _COMPLEX_PARTS and not _is_complex(view.args[0]):
        return value  # ``real`` of a real tensor is that tensor (``imag`` of one fails)
    if target in _COMPLEX_PARTS:
        base_val = base.meta.get("val")
        if isinstance(base_val, torch.Tensor) and base_val.is_conj():
            # A conjugated base (``b.conj().imag``): view_as_real refuses the conjugate bit.
            base = emit(aten.resolve_conj.default, base)
        parts = emit(aten.view_as_real.default, base)
        return emit(aten.view_as_complex.default, emit(
            aten.select_scatter.default, parts, value, -1, _COMPLEX_PARTS[target]))
    if target is aten.unfold.default:
        return _write_back_windows(emit, view, base, value)
    if target is aten.narrow.default:
        dim, start, length = _args(view)
        negative = _is_negative(start)
        if negative is not False:
            # narrow counts a negative start from the end; slice_scatter would take the end
            # ``start + length`` (0 for the last rows) as an absolute bound. A start of
            # unknown sign lies in [-size, size] (narrow checks it): (start + size) % size.
            size = _shape(view.args[0])[dim]
            if not isinstance(size, int):
                size = emit(aten.sym_size.int, base, dim)
            if isinstance(start, int) and isinstance(size, int):
                start = start + size
            else:
                start = emit(operator.add, start, size)
                if negative is None:
                    start = emit(operator.mod, start, size)
        end = start + length if isinstance(start, int) and isinstance(length, int) else emit(
            operator.add, start, length)
        return emit(aten.slice_scatter.default, base, value, dim, start, end)
    if target in _INVERSES:
        return emit(*_INVERSES[target](view, value, *_args(view)))
    if target is aten._neg_view.default:  # the view reads each element negated
        return emit(aten.neg.default, value)
    if target in _CONJUGATING:
        if view.meta["val"].is_complex():
            value = emit(aten.conj_physical.default, value)
        return emit(aten.mT.default, value) if _CONJUGATING[target] else value
    if target is aten.transpose.int:
        return emit(aten.transpose.int, value, *_args(view))
    if target is aten.t.default:
        return emit(aten.t.default, value)
    if target is aten.permute.default:
        (dims,) = _args(view)
        dims = [d % len(dims) for d in dims]
        return emit(aten.permute.default, value, sorted(range(len(dims)), key=dims.__getitem__))
    if target is aten.unsqueeze.default:
        (dim,) = _args(view)
        ndim = len(_shape(view)) if _shape(view) is not None else None
        if dim < 0 and ndim is not None:
            dim += ndim
        return emit(aten.squeeze.dim, value, dim)
    if target is aten.view.dtype:
        return emit(aten.view.dtype, value, base.meta["val"].dtype)
    shared = shared_input(view)
    if shared is not None and not same_metadata([view], [shared[2]]):
        # Eager's view addresses the storage of its contiguous input: place the value at
        # those positions of the input's value (made contiguous, as eager's input is).
        size, stride, offset = _placed_in(view, shared[2])
        contiguous = emit(aten.clone.default, base, memory_format=torch.contiguous_format)
        return emit(aten.as_strided_scatter.default, contiguous, value, size, stride, offset)
    if target in _IDENTITIES or facts_of(view).self_if_shared:
        return value
    if target in _BROADCASTS:
        return emit(aten.reshape.default, value, list(_shape(view.args[0])))
    shape = _shape(base)
    if shape is not None and all(isinstance(s, int) for s in shape):
        return emit(aten.reshape.default, value, list(shape))
    return emit(aten.reshape_as.default, value, base)


def _is_negative(start: object) -> bool | None:
    """Whether a view's start index (an int or a SymInt node) is negative; None when a
    symbolic start's sign is not known for every size."""
    if isinstance(start, Node):
        start = start.meta.get("val")
    if isinstance(start, int):
        return start < 0
    if isinstance(start, torch.SymInt):
        if statically_known_true(start >= 0):
            return False
        if statically_known_true(start < 0):
            return True
    return None


def _placed_in(view: Node, source: Node) -> tuple[list[int], list[int], int] | None:
    """``(size, stride, offset)`` of ``view`` in the storage of ``source`` counted from
    ``source``'s first element, when ``source`` is contiguous and static and ``view``
    addresses elements of it only, each once; else None."""
    val, src = view.meta.get("val"), source.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
        return None
    layout = (*val.shape, *val.stride(), val.storage_offset(), *src.shape,
              src.storage_offset())
    if not all(isinstance(x, int) for x in layout) or not src.is_contiguous() or (
            overlaps_itself(view)):
        return None
    offset = val.storage_offset() - src.storage_offset()
    last = offset + sum((n - 1) * st for n, st in zip(val.shape, val.stride(), strict=True))
    if val.numel() and (offset < 0 or last >= src.numel() or min(val.stride(), default=0) < 0):
        return None
    return list(val.shape), list(val.stride()), offset


def _is_complex(node: Node) -> bool:
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or val.is_complex()


def _write_back_windows(emit: Emit, view: Node, base: Node, value: Node) -> Node:
    # Windows do not overlap (write_back_reason), so unfold_backward only places values;
    # the same placement of ones marks which elements a window reaches.
    dim, size, step = _args(view)
    sizes = list(_shape(view.args[0]))
    placed = emit(aten.unfold_backward.default, value, sizes, dim, size, step)
    reached = emit(aten.unfold_backward.default, emit(aten.ones_like.default, value),
                   sizes, dim, size, step)
    return emit(aten.where.self, emit(aten.ne.Scalar, reached, 0), placed, base)


def _write_back_item(emit: Emit, split: Node, index: int, base: Node, value: Node) -> Node:
    target = target_of(split)
    if target in ELEMENT_VIEWS:  # a reshape of its input (write_back_reason)
        return emit(aten.reshape.default, value, list(_shape(_element_input(split, index))))
    args = _args(split)
    target = _UNSAFE_SPLITS.get(target, target)
    if target in _DIRECTIONAL_SPLITS:
        target, dim_of = _DIRECTIONAL_SPLITS[target]
        args = [*args, dim_of(len(_shape(base)))]
    if target is aten.unbind.int:
        return emit(aten.select_scatter.default, base, value, args[0], index)
    if target is aten.split.Tensor:
        size, dim = args
        sizes = None
    elif target is aten.split_with_sizes.default:
        sizes, dim = args
    elif target is aten.tensor_split.indices:
        # piece i is slice(indices[i-1], indices[i]) (torch's own definition): unsorted
        # indices give empty or overlapping pieces, so bounds come from the indices, not sizes
        indices, dim = args
        bounds = [0, *indices, None]
        return emit(aten.slice_scatter.default, base, value, dim, bounds[index],
                    bounds[index + 1])
    elif target is aten.tensor_split.sections:
        # the first (length % sections) pieces are one longer
        sections, dim = args
        short, longer = divmod(_shape(base)[dim], sections)
        sizes = [short + (i < longer) for i in range(sections)]
    else:
        chunks, dim = args
        length = _shape(base)[dim]
        size = -(-length // chunks)
        sizes = None
    if sizes is None:
        start, end = index * size, (index + 1) * size
    else:  # symbolic sizes (split_with_sizes) are SymInt nodes: their sums are too
        start = 0
        for piece in sizes[:index]:
            start = _plus(emit, start, piece)
        end = _plus(emit, start, sizes[index])
    return emit(aten.slice_scatter.default, base, value, dim, start, end)


def _plus(emit: Emit, a: int | Node, b: int | Node) -> int | Node:
    """``a + b`` of two ints, or a node computing it when one is a SymInt node."""
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if isinstance(a, int) and a == 0:
        return b
    return emit(operator.add, a, b)


def _element_input(node: Node, index: int) -> Node:
    """The input whose view is result ``index`` of an ELEMENT_VIEWS op."""
    return argument_value(node, target_of(node)._schema, 0)[index]


def view_steps(chain: tuple[Node, ...]) -> list[tuple[Node, ...]]:
    """The chain cut into write-back steps: one view, or a split/unbind and its getitem."""
    steps: list[tuple[Node, ...]] = []
    for view in chain:
        if view.target is operator.getitem and steps and steps[-1][-1] is view.args[0]:
            steps[-1] = (*steps[-1], view)
        else:
            steps.append((view,))
    return steps


def write_back_chain(emit: Emit, chain: tuple[Node, ...], bases: list[Node], value: Node) -> Node:
    """The root's new value once the end of ``chain`` became ``value``.

    ``bases[k]`` is the current value of ``chain[:k]`` (``bases[0]`` is the root's), for
    every ``k`` at which a step starts.
    """
    if any(target_of(v) in STORAGE_VIEWS and overlaps_itself(v) for v in chain[:-1]):
        # Step by step, the overlapping as_strided view would store an element once per
        # position it has there. The end of the chain addresses each element once
        # (mutation_checks): it is itself a strided view of the root, absolute like every
        # storage view, and is written back in one step from its own layout.
        final = chain[-1].meta["val"]
        return emit(aten.as_strided_scatter.default, bases[0], value, list(final.shape),
                    list(final.stride()), final.storage_offset())
    start = len(chain)
    for step in reversed(view_steps(chain)):
        start -= len(step)
        value = write_back(emit, step[-1], bases[start], value)
    return value
