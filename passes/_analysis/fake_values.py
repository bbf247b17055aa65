"""Fake values (``meta["val"]``) for nodes that lack one or whose inputs changed: the one
helper of the functionalization engine (each node it creates), the lift (the nodes
torchao's convert inserts without one, and its frozen constants) and QuantizeMutableBuffers
(nodes whose buffer became integer).

A node's value is computed from its inputs' recorded values in the graph's fake mode (its
shape environment included): nothing else of the program runs again, which would be a
trace. :class:`FakeValues` tries two fast paths, then falls back to torch's
``FakeTensorProp`` (``run_node`` on that node alone).

A fresh-result op (torchao's quantize / dequantize, a functional cache update) has a result
whose layout its Meta kernel computes from its inputs' layouts and its other arguments
alone, so the kernel runs once per distinct such key (on the inputs' fake values, as the
fake mode runs it) and each node gets a new fake tensor of that layout, built as the fake
mode's converter wraps a kernel's result: about 0.01 ms a node, against 0.1 ms for a kernel
run per node and 0.4-1 ms through the mode's dispatch. The scale and zero point of a
per-tensor (de)quantize, different at every node, are left out of the key: its Meta kernel
never reads them. Other non-view ops on static shapes (layers of a model repeat the same
rewrite on the same shapes) are dispatched once per (op, input metadata) and later nodes
get a fresh fake tensor of that metadata.

Symbolic sizes (a dynamic token dimension) key by their expressions. Their new fake tensor
takes the kernel's storage size as it is instead of computing it again from the symbolic
sizes and strides (``empty_strided`` does, in Python ``SymNode`` arithmetic: 0.3 ms a
node against 0.03 ms), the way torch's nested tensors build theirs
(``_make_wrapper_subclass(..., storage_size=)``); each still gets a storage of its own.
A kernel run on symbolic sizes is itself torch's symbolic arithmetic (0.3-0.5 ms a key), so
the (de)quantize kernels, an ``empty_like`` of their input, are not run there: the layout
``empty_like`` gives is built from the order torch's own function picks on the sizes'
hints, reusing the input's sizes and strides wherever their expressions are the result's
(:class:`_EmptyLikeLayouts`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx.experimental._config
from torch._guards import detect_fake_mode
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    in_kernel_invocation_manager,
)
from torch.fx import Graph, GraphModule, Node, map_arg
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..errors import LiftError
from .op_schema import facts_of, is_maybe_view, view_base_index

__all__ = [
    "FakeValues",
    "fake_mode_of",
    "fake_state_value",
    "fill_missing_values",
    "graph_fake_mode",
    "is_contiguous",
    "same_metadata",
    "same_static_layout",
    "same_strides",
    "static_layout",
    "storage_key",
]

_UNKNOWN = object()


def graph_fake_mode(graph: Graph) -> FakeTensorMode | None:
    """The fake mode the graph's values were made in, None if it has no fake value: its
    first input's (placeholder or ``get_attr``; a graph's inputs share one, and come first,
    so the graph is not walked), else any other value's."""
    first = next((v for n in graph.nodes if n.op in ("placeholder", "get_attr")
                  and isinstance(v := n.meta.get("val"), FakeTensor)), None)
    if first is None:
        first = next((v for n in graph.nodes if isinstance(v := n.meta.get("val"), FakeTensor)),
                     None)
    return detect_fake_mode([first]) if first is not None else None


def fake_mode_of(gm: GraphModule) -> FakeTensorMode:
    """:func:`graph_fake_mode` of ``gm``'s graph, or a fresh mode (with a shape environment)
    when it has no fake value."""
    mode = graph_fake_mode(gm.graph)
    return mode if mode is not None else FakeTensorMode(shape_env=ShapeEnv())


class FakeValues:
    """Computes nodes' ``meta["val"]`` in the graph's fake mode from their inputs' values.

    ``mode`` is the graph's (:func:`graph_fake_mode`, found on first use) unless given.
    ``tensor_meta`` also sets ``meta["tensor_meta"]`` on every node given a tensor value;
    a node that had one gets it refreshed either way.
    """

    def __init__(self, graph: Graph, mode: Any = _UNKNOWN, *, tensor_meta: bool = False):
        self._graph = graph
        self._mode = mode
        self._tensor_meta = tensor_meta
        self._layouts: _ResultLayouts | None = None
        self._static: dict[tuple, tuple[Any, Any]] = {}
        self._prop: FakeTensorProp | None = None

    @property
    def mode(self) -> FakeTensorMode | None:
        """The fake mode values are computed in (None: the graph has no fake values)."""
        if self._mode is _UNKNOWN:
            self._mode = graph_fake_mode(self._graph)
        return self._mode

    def infer(self, node: Node) -> bool:
        """Set ``node``'s fake value from its inputs'; False (nothing set) when there is no
        fake mode or an input has no value (a subgraph ``get_attr`` needs none).

        Raises whatever the op raises on these fake inputs.
        """
        mode = self.mode
        if mode is None:
            return False
        if self._layouts is None:
            self._layouts = _ResultLayouts(mode)
        # The fast path first: it finds each input's value itself, and most nodes take it.
        val, tensor_meta = self._layouts.value_of(node), None
        if val is None:
            if not all("val" in arg.meta or self._subgraph(arg)
                       for arg in node.all_input_nodes):
                return False
            key = _static_key(node)
            if key is not None and key in self._static:
                like, tensor_meta = self._static[key]
                val = _fresh_fake(mode, like)
            else:
                val = self._propagate(node, mode)
                if key is not None:
                    # TensorMetadata is an immutable tuple: nodes with equal metadata share it.
                    tensor_meta = (_extract_tensor_metadata(val)
                                   if isinstance(val, torch.Tensor) else None)
                    self._static[key] = (val, tensor_meta)
        node.meta["val"] = val
        if isinstance(val, torch.Tensor) and (self._tensor_meta or "tensor_meta" in node.meta):
            node.meta["tensor_meta"] = tensor_meta or _extract_tensor_metadata(val)
        return True

    def _subgraph(self, node: Node) -> bool:
        owner = self._graph.owning_module
        return (node.op == "get_attr" and owner is not None
                and isinstance(getattr(owner, str(node.target), None), torch.nn.Module))

    def _propagate(self, node: Node, mode: FakeTensorMode) -> Any:
        """``FakeTensorProp.run_node`` on ``node`` alone, its inputs' values as the
        environment (a subgraph fetched from the graph's module)."""
        if self._prop is None:
            owner = self._graph.owning_module
            self._prop = FakeTensorProp(
                owner if isinstance(owner, GraphModule)
                else GraphModule(torch.nn.Module(), Graph()), mode)
        prop = self._prop
        prop.env = {arg: arg.meta["val"] if "val" in arg.meta else prop.fetch_attr(str(arg.target))
                    for arg in node.all_input_nodes}
        try:
            with mode:
                result = prop.run_node(node)
        finally:
            prop.env = {}
        return node.meta["val"] if result is not None else None


def fake_state_value(mode: FakeTensorMode, tensor: torch.Tensor, shares_storage: bool) -> Any:
    """A fake value for a lifted tensor that has none (a frozen constant): static shapes,
    as export gives parameters and buffers.

    A plain tensor owning its whole storage alone (``shares_storage`` False: no other
    lifted tensor uses it) is one new fake tensor of its layout, as the mode's converter
    would make it (0.01 ms against 0.12 ms: the converter describes every tensor for its
    memo of storages and views, which such a tensor does not need); any other tensor goes
    through ``from_tensor``, which keeps views and shared storages shared.
    """
    if not shares_storage and _plain(tensor):
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device="meta")
        if meta.untyped_storage().nbytes() == tensor.untyped_storage().nbytes():
            return FakeTensor(mode, meta, tensor.device)
    return mode.from_tensor(tensor, static_shapes=True)


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """What identifies ``tensor``'s storage among tensors on its device (None for a
    tensor subclass or a tensor without one: it is then taken as sharing)."""
    if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type == "meta"
            or tensor.layout != torch.strided or tensor.untyped_storage().nbytes() == 0):
        return None
    return tensor.device, tensor.untyped_storage().data_ptr()


def _plain(tensor: torch.Tensor) -> bool:
    """A dense tensor at the start of its own storage, with nothing the converter would
    carry over besides its layout (autograd, a subclass, a view's base, lazy bits)."""
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided
            and not tensor.requires_grad and not tensor.is_quantized
            and not tensor.is_inference() and not tensor.is_conj() and not tensor.is_neg()
            and tensor._base is None and tensor.storage_offset() == 0)


def fill_missing_values(missing: list[Node], gm: GraphModule, mode: FakeTensorMode) -> int:
    """Give each node of ``missing`` (call_function nodes without a ``val``, in graph order)
    one, from its inputs' (:class:`FakeValues` in ``mode``; the lift's step).

    ``gm`` holds the subgraphs the nodes' ``get_attr`` inputs name. Returns how many nodes
    were propagated.

    Raises:
        LiftError: naming the node, for an input without a fake value or an op that fails on
            the fake values.
    """
    values = FakeValues(gm.graph, mode)
    for node in missing:
        try:
            done = values.infer(node)
        except Exception as e:  # any failure of the op on fake values is this error
            raise LiftError(f"cannot compute its fake value ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})", node.name) from e
        if not done:
            arg = next(a for a in node.all_input_nodes if "val" not in a.meta)
            raise LiftError(f"its input {arg.name} has no fake value", node.name)
    return len(missing)


# Per-tensor (de)quantize ops whose Meta kernel reads neither the scale nor the zero point
# (torch/ao/quantization/fx/_decomposed.py: an ``empty_like`` of the input in the output
# dtype, after checks on dtypes and bounds only); by (qualified name, overload).
_UNREAD_BY_META = {
    ("quantized_decomposed::quantize_per_tensor", "default"): frozenset({"scale", "zero_point"}),
    ("quantized_decomposed::dequantize_per_tensor", "default"): frozenset(
        {"scale", "zero_point"}),
}

# Ops whose Meta kernel, after checks on dtypes and the other arguments alone, returns
# ``torch.empty_like(input, dtype=...)`` of its first argument (quantize's casts a half
# input to float first, which keeps a dense layout); by (qualified name, overload).
_EMPTY_LIKE_OF_INPUT = frozenset(_UNREAD_BY_META)

# op -> None (no fast path) or, per positional argument, whether the key leaves it out, and
# the keyword arguments it leaves out
_OP_PLANS: dict[Any, tuple[tuple[bool, ...], frozenset[str]] | None] = {}


def _plan(op: Any, node: Node) -> tuple[tuple[bool, ...], frozenset[str]] | None:
    if op in _OP_PLANS:
        return _OP_PLANS[op]
    plan = None
    if isinstance(op, torch._ops.OpOverload):
        facts = facts_of(node)
        if (facts is not None and facts.fresh and not facts.may_write and not facts.maybe_view
                and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")):
            unread = _UNREAD_BY_META.get((op.name(), op._overloadname), frozenset())
            plan = tuple(a.name in unread for a in op._schema.arguments), unread
    _OP_PLANS[op] = plan
    return plan


class _Unkeyable(Exception):
    """An argument the layout key cannot hold (a symbolic or foreign value)."""


class _Layout(NamedTuple):
    """A kernel result's layout; sizes are ints or SymInts of the graph's shape env."""

    shape: torch.Size
    stride: tuple[Any, ...]
    dtype: torch.dtype
    nbytes: Any  # its storage's size in bytes


class _ResultLayouts:
    """Fake values of fresh-result nodes, from their op's Meta kernel run once per (op,
    input layouts, other arguments)."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.known: dict[tuple, _Layout | None] = {}
        self._empty_like = _EmptyLikeLayouts(mode)

    def value_of(self, node: Node) -> FakeTensor | None:
        """``node``'s fake value, or None where the fast path does not apply."""
        keyed = self.key_of(node)
        if keyed is None:
            return None
        key, device = keyed
        try:
            layout = self.known[key]
        except KeyError:
            layout = self.known[key] = self._layout(node, key)
        except TypeError:  # an unhashable argument: the kernel runs for this node alone
            layout = _run_meta_kernel(node, self.mode)
        if layout is None:
            return None
        return _fresh_fake_tensor(self.mode, layout, device)

    def _layout(self, node: Node, key: tuple) -> _Layout | None:
        """The result layout of a node whose key is new: by :class:`_EmptyLikeLayouts` for
        an ``empty_like`` kernel on symbolic sizes, else by a run of its Meta kernel."""
        op = node.target
        if (op.name(), op._overloadname) in _EMPTY_LIKE_OF_INPUT:
            layout = self._empty_like.layout(node, key)
            if layout is not None:
                return layout
        return _run_meta_kernel(node, self.mode)

    def key_of(self, node: Node) -> tuple[tuple, torch.device] | None:
        """What ``node``'s result layout depends on (op, input layouts, other arguments)
        and the device of its inputs, or None where the fast path does not apply."""
        plan = _plan(node.target, node)
        if plan is None:
            return None
        left_out, unread = plan
        devices: set[torch.device] = set()
        key: list[Any] = [node.target]
        try:
            for i, arg in enumerate(node.args):
                key.append(None if i < len(left_out) and left_out[i]
                           else self._key(arg, devices))
            for name, arg in node.kwargs.items():
                key.append((name, None if name in unread else self._key(arg, devices)))
        except _Unkeyable:
            return None
        if len(devices) != 1:
            return None
        return tuple(key), devices.pop()

    def _key(self, value: Any, devices: set[torch.device]) -> Any:
        if isinstance(value, Node):
            v = value.meta.get("val")
            if not isinstance(v, FakeTensor) or v.fake_mode is not self.mode:
                raise _Unkeyable
            devices.add(v.fake_device)
            if not v._has_symbolic_sizes_strides:
                return v.shape, v.stride(), v.storage_offset(), v.dtype, v.fake_device
            return (tuple(map(_size_key, v.shape)), tuple(map(_size_key, v.stride())),
                    _size_key(v.storage_offset()), v.dtype, v.fake_device)
        if isinstance(value, (list, tuple)):
            return type(value), tuple(self._key(v, devices) for v in value)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
            raise _Unkeyable
        return type(value), value  # 1, 1.0 and True key apart


class _EmptyLikeLayouts:
    """Result layouts of ``empty_like`` kernels (:data:`_EMPTY_LIKE_OF_INPUT`) on symbolic
    sizes, without the kernel's symbolic arithmetic.

    torch's ``empty_like`` (``torch._refs.empty_like``, the fake mode's kernel) lays its
    result out densely in the order ``compute_elementwise_output_logical_to_physical_perm``
    picks from the input's strides, with ``make_contiguous_strides_for``'s strides in that
    order and a storage of ``numel * itemsize`` bytes. On symbolic sizes that is some 20
    ``SymNode`` operations with guards, 0.3-0.5 ms a layout. The order only depends on
    comparisons, which on a backed size evaluate on its hint, so here the same function
    picks it on a meta tensor of the hints; the strides in that order are then built as
    the kernel builds them, except that each stride whose expression the input's stride
    already has is the input's (a quantize's output, the dequantize after it, and every
    dense activation need no arithmetic at all). A size that is not a positive integer
    expression (whose ``sym_max(size, 1)`` is not itself), an unbacked or hintless size,
    and ``backed_size_oblivious`` (whose comparisons do not follow the hints) leave the
    layout to the kernel. The kernel's own checks (on dtypes and its other arguments)
    run once per op, input dtype, rank and arguments, on the meta tensor of the hints,
    which also gives the result's dtype.
    """

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.enabled = not torch.fx.experimental._config.backed_size_oblivious
        # by the input's (sizes, strides) expressions: (result strides, numel) or None
        self._dense: dict[tuple, tuple[tuple, Any] | None] = {}
        self._dtypes: dict[tuple, torch.dtype | None] = {}  # by key without the layout
        self._nbytes: dict[tuple, Any] = {}  # by (sizes expressions, itemsize)

    def layout(self, node: Node, key: tuple) -> _Layout | None:
        """The layout of ``node``'s result, or None where the kernel must run. ``key`` is
        the node's :meth:`_ResultLayouts.key_of` key (its second item the input's)."""
        source = node.args[0] if node.args else None
        x = source.meta.get("val") if isinstance(source, Node) else None
        if not self.enabled or not isinstance(x, FakeTensor) or not x._has_symbolic_sizes_strides:
            return None
        sizes, strides, _, dtype, device = key[1]
        if (sizes, strides) not in self._dense:
            self._dense[sizes, strides] = _empty_like_strides(x, sizes, strides)
        dense = self._dense[sizes, strides]
        if dense is None:
            return None
        checked = (key[0], dtype, device, len(sizes), key[2:])
        if checked not in self._dtypes:
            self._dtypes[checked] = self._checked_dtype(node, x)
        result_dtype = self._dtypes[checked]
        if result_dtype is None:
            return None
        result_strides, numel = dense
        itemsize = result_dtype.itemsize
        nbytes = self._nbytes.get((sizes, itemsize))
        if nbytes is None:
            nbytes = self._nbytes[sizes, itemsize] = numel if itemsize == 1 else numel * itemsize
        return _Layout(x.shape, result_strides, result_dtype, nbytes)

    def _checked_dtype(self, node: Node, x: FakeTensor) -> torch.dtype | None:
        """The result dtype of the op's Meta kernel run on a meta tensor of ``x``'s dtype
        and hints with the node's other arguments; None if it fails or gives no meta
        tensor of the input's shape (the kernel then runs on the node's own values, and
        the general path reports its failure)."""
        stand_in = _hinted(x)
        if stand_in is None:
            return None
        args, kwargs = map_arg((node.args[1:], node.kwargs), lambda arg: arg.meta["val"])
        try:
            with in_kernel_invocation_manager(self.mode):
                result = node.target(stand_in, *args, **kwargs)
        except Exception:  # noqa: BLE001 - the kernel run on the node's values reports it
            return None
        if (type(result) is not torch.Tensor or result.device.type != "meta"
                or result.shape != stand_in.shape):
            return None
        return result.dtype


def _hinted(x: FakeTensor) -> torch.Tensor | None:
    """A meta tensor of ``x``'s dtype with its sizes and strides at their hints (None if
    one has no hint)."""
    sizes = [_hint(d) for d in x.shape]
    strides = [_hint(d) for d in x.stride()]
    if None in sizes or None in strides:
        return None
    return torch.empty_strided(sizes, strides, dtype=x.dtype, device="meta")


def _hint(size: Any) -> int | None:
    if isinstance(size, int):
        return size
    node = size.node
    return node.hint if node.has_hint() and isinstance(node.hint, int) else None


def _empty_like_strides(x: FakeTensor, sizes: tuple, strides: tuple) -> tuple[tuple, Any] | None:
    """The strides torch's ``empty_like`` gives ``x``'s result, and its number of
    elements, built as :class:`_EmptyLikeLayouts` says; ``sizes`` and ``strides`` are
    ``x``'s as expressions. None where the kernel must run."""
    stand_in = _hinted(x)
    if stand_in is None:
        return None
    order, _ = compute_elementwise_output_logical_to_physical_perm(stand_in)
    x_sizes, x_strides = x.shape, x.stride()
    result: list[Any] = [None] * len(order)
    # make_contiguous_strides_for, innermost dimension first: the next stride as a value
    # times the factors not yet multiplied in, and as an expression
    value: Any = 1
    factors: list[Any] = []
    expected: Any = 1
    for dim in reversed(order):
        if strides[dim] == expected:
            value, factors = x_strides[dim], []
        else:
            for factor in factors:
                value = value * factor
            factors = []
        result[dim] = value
        size = sizes[dim]
        if isinstance(size, int):
            factors.append(max(size, 1))
            expected = expected * max(size, 1)
        elif size.is_integer and size.is_positive:  # its sym_max(size, 1) is itself
            factors.append(x_sizes[dim])
            expected = expected * size
        else:
            return None
    if any(size == 0 for size in sizes if isinstance(size, int)):
        return tuple(result), 0
    outer = order[0]  # numel: the outermost stride times its size
    numel = result[outer] if sizes[outer] == 1 else result[outer] * x_sizes[outer]
    return tuple(result), numel


def _size_key(size: Any) -> Any:
    """A size as a key: an int, or a symbolic size's expression (equal expressions are
    equal sizes)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _run_meta_kernel(node: Node, mode: FakeTensorMode) -> _Layout | None:
    """The layout of ``node``'s result as its op's Meta kernel gives it on the inputs'
    fake values (as the fake mode runs kernels), or None if the kernel fails or gives no
    single meta tensor at offset 0 (the general path then reports or handles it)."""
    args, kwargs = map_arg((node.args, node.kwargs), lambda arg: arg.meta["val"])
    try:
        with in_kernel_invocation_manager(mode):
            result = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the general path reports the failure
        return None
    # A view's offset can be data-dependent (a cache narrowed at ``input_pos[0].item()``):
    # asking whether it is 0 would guard on it, so only an offset known to be 0 passes.
    if (type(result) is not torch.Tensor or result.device.type != "meta"
            or not statically_known_true(result.storage_offset() == 0)):
        return None
    return _Layout(result.shape, result.stride(), result.dtype,
                   result.untyped_storage().nbytes())


class _MetaLayout(torch.Tensor):
    """The type ``_make_wrapper_subclass`` needs to build a meta tensor of a given layout
    and storage size; only ever wrapped at once into a FakeTensor."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        raise LiftError(f"{func} reached a layout carrier, which runs no op")


def _fresh_fake_tensor(mode: FakeTensorMode, layout: _Layout, device: torch.device
                       ) -> FakeTensor:
    """A new fake tensor of ``layout`` on a storage of its own, as the fake mode wraps a
    kernel's result. On static sizes ``empty_strided`` gives the meta tensor when its
    storage is the layout's size (2 us less than the carrier); otherwise the meta tensor is
    built with its storage size given, so symbolic sizes cost no arithmetic, then wrapped
    (its ``detach`` below the Python key: the carrier dispatches nothing)."""
    if isinstance(layout.nbytes, int):
        meta = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype,
                                   device="meta")
        if meta.untyped_storage().nbytes() == layout.nbytes:
            return FakeTensor(mode, meta, device)
    meta = torch.Tensor._make_wrapper_subclass(
        _MetaLayout, layout.shape, layout.stride, 0, dtype=layout.dtype, device="meta",
        storage_size=layout.nbytes)
    with torch._C._DisableTorchDispatch():
        return FakeTensor(mode, meta, device)


def _static_key(node: Node) -> tuple | None:
    """A key for the fake result of a non-view op with static shapes (the op and its inputs'
    metadata), else None. Views are never keyed: their result shares its input's storage;
    nor are ops that are views only sometimes, which only their dispatch tells."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or view_base_index(node) is not None or (
            is_maybe_view(node)):
        return None
    try:
        args, kwargs = map_arg((node.args, node.kwargs), lambda arg: arg.meta["val"])
        # The op by identity: an OpOverload hashes in Python, the rest of the key in C.
        key = (id(target), _key_of(args), _key_of(kwargs) if kwargs else ())
        hash(key)
    except (KeyError, TypeError, _Dynamic):
        return None
    return key


class _Dynamic(Exception):
    """A symbolic size, stride or scalar: no static key."""


def _key_of(value: Any) -> Any:
    # A hand-rolled flatten: pytree's generic one costs more than the dispatch it saves.
    if isinstance(value, torch.Tensor):
        shape, stride = value.shape, value.stride()
        for d in (*shape, *stride):
            if not isinstance(d, int):
                raise _Dynamic
        return (shape, stride, value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value), *(_key_of(v) for v in value))
    if isinstance(value, dict):
        return (dict, *((k, _key_of(v)) for k, v in value.items()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Dynamic
    return (type(value), value)


def _fresh_fake(mode: Any, like: Any) -> Any:
    """A new fake tensor (or tuple of them) with the metadata of ``like``."""
    if isinstance(like, (tuple, list)):
        return type(like)(_fresh_fake(mode, v) for v in like)
    if not isinstance(like, torch.Tensor):
        return like
    meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
    return FakeTensor(mode, meta, like.device)


# -- layouts of nodes' fake values -------------------------------------------------------
def static_layout(node: Node) -> tuple | None:
    """The shape, strides and storage offset of the node's fake tensor, flattened, when it
    has one and all are static integers (else None)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    layout = (*val.shape, *val.stride(), val.storage_offset())
    return layout if all(isinstance(x, int) for x in layout) else None


def same_static_layout(a: Node, b: Node) -> bool:
    """Whether both nodes' fake tensors are known to have one shape, strides and offset
    (False when either is unknown or symbolic)."""
    layout = static_layout(a)
    return layout is not None and layout == static_layout(b)


def same_strides(a: Node, b: Node) -> bool:
    """Same strides (True when unknown: no fake values or symbolic strides)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return True
    strides = (*va.stride(), *vb.stride())
    return not all(isinstance(x, int) for x in strides) or va.stride() == vb.stride()


def same_metadata(old: list[Node], new: list[Node]) -> bool:
    """Inputs whose fake values agree in everything but storage (static shapes only)."""
    return len(old) == len(new) and all(
        same_static_layout(a, b) and _dtype_device(a) == _dtype_device(b)
        for a, b in zip(old, new, strict=True))


def _dtype_device(node: Node) -> tuple:
    val = node.meta["val"]
    return val.dtype, val.device


def is_contiguous(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous()
