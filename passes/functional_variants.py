"""Functional counterparts of operators that write to their arguments.

The rules, in order: a variant registered with :func:`register_functional_variant`;
otherwise the counterpart is derived from the schema: the non-mutating overload of the
functional op (``add_`` / ``add.out`` -> ``add``, ``__ior__`` -> ``__or__``,
``_native_batch_norm_legit`` -> ``_native_batch_norm_legit_functional``) whose schema,
normalized by torchgen (no overload name, out= arguments or alias annotations), equals the
mutating op's: ``pow_.Scalar`` -> ``pow.Tensor_Scalar``, ``copy_`` -> ``copy``. Built in:
``batch_norm`` in training mode (it updates its running statistics without saying so in
its schema) becomes ``_native_batch_norm_legit_functional``; ``detach_`` changes no value
and becomes nothing. A custom op with ``(a!)`` arguments and no registered variant falls
back to torch's ``auto_functionalized`` higher-order op, as ``run_decompositions`` does.

A functional variant takes the op's arguments (without the ``out=`` ones) and returns:

* when every written argument is returned by the op (in-place and ``out=`` ops): the
  new values, in the order of the op's results;
* otherwise: the op's results followed by the new value of each written argument (for a
  written list of tensors, the list of their new values).
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._higher_order_ops.auto_functionalize import (
    auto_functionalized,
    can_auto_functionalize,
)
from torch._ops import OpOverload
from torch.fx import Node
from torchgen.model import FunctionSchema, OperatorName

from ._analysis.op_schema import argument_value
from .errors import UnsupportedMutationError

__all__ = [
    "METADATA_VIEWS",
    "FunctionalVariant",
    "functional_variant",
    "register_functional_variant",
    "unregister_functional_variant",
]

# Ops that change the shape, strides or storage of their argument rather than its values.
_METADATA_MUTATIONS = frozenset({"resize_", "resize_as_", "set_", "as_strided_", "t_",
                                 "transpose_", "squeeze_", "unsqueeze_", "swapdims_",
                                 "swapaxes_"})
_aten = torch.ops.aten
METADATA_VIEWS = {
    _aten.unsqueeze_.default: _aten.unsqueeze.default,
    _aten.squeeze_.default: _aten.squeeze.default,
    _aten.squeeze_.dim: _aten.squeeze.dim,
    _aten.squeeze_.dims: _aten.squeeze.dims,
    _aten.t_.default: _aten.t.default,
    _aten.transpose_.default: _aten.transpose.int,
    _aten.swapdims_.default: _aten.swapdims.default,
    _aten.swapaxes_.default: _aten.swapaxes.default,
}
"""Metadata mutations of an intermediate and the view op giving its new shape (a rename)."""
# In-place ops that change no value (only autograd metadata): they rewrite to nothing.
_VALUE_PRESERVING = frozenset({"detach_", "requires_grad_"})

_REGISTRY: dict[OpOverload, Callable] = {}
# functional_variant's answers: a model repeats a few ops per layer. Cleared when the
# registry changes, the only input besides the op.
_ANSWERS: dict[Any, FunctionalVariant | str] = {}


@dataclass(frozen=True)
class FunctionalVariant:
    """How to replace one mutating op.

    Attributes:
        functional: the call_function target to insert; None for an op that changes no
            value (``detach_``): its result is its argument.
        out_args: names of ``out=`` arguments to drop from the call.
        returns_written: True when the results are the written arguments' new values;
            False when they are the op's results followed by those new values.
        arguments: for a built-in variant with another signature, the call's
            ``(args, kwargs)`` built from the original node.
        picks: for such a variant, which of its results are (op results..., new values...).
        expand: for an op whose functional form takes several nodes, a function
            ``expand(emit, node) -> [op results..., new values...]`` building them with
            ``emit(target, *args, **kwargs)`` from the node (its arguments already current).
    """

    functional: Callable | None
    out_args: tuple[str, ...]
    returns_written: bool
    arguments: Callable[[Node], tuple[tuple, dict]] | None = None
    picks: tuple[int, ...] | None = None
    expand: Callable[[Callable[..., Node], Node], list[Node]] | None = None


def register_functional_variant(op: OpOverload, functional: Callable) -> None:
    """Declare ``functional`` as the functional counterpart of the mutating ``op``.

    ``functional`` follows the calling convention in this module's docstring; it may be an
    ``OpOverload`` (e.g. a ``torch.library`` custom op) or any function FX can call.

    Example:
        >>> register_functional_variant(torch.ops.mylib.scale_.default,
        ...                             torch.ops.mylib.scale.default)
    """
    if not isinstance(op, OpOverload):
        raise TypeError(f"register_functional_variant expects an OpOverload, got {op!r}")
    if not op._schema.is_mutable:
        raise ValueError(f"{op} writes none of its arguments; it needs no functional variant")
    _REGISTRY[op] = functional
    _ANSWERS.clear()


def unregister_functional_variant(op: OpOverload) -> None:
    _REGISTRY.pop(op, None)
    _ANSWERS.clear()


def _returns_written(schema: torch.FunctionSchema) -> bool:
    returned = set()
    for ret in schema.returns:
        if ret.alias_info is not None:
            returned |= set(ret.alias_info.before_set)
    # A written list (``Tensor(a!)[] self`` of the _foreach_ ops) has an empty alias set:
    # no op returns it, its functional version returns its new values as a list.
    return all(
        arg.alias_info.before_set and set(arg.alias_info.before_set) <= returned
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    )


@functools.cache
def _core_signature(op: OpOverload) -> tuple | None:
    """torchgen's normalization of a schema, equal across an op's in-place, out= and
    functional versions: no overload name, no out= arguments, no alias annotations, written
    arguments the op does not return turned into results."""
    # torchgen reads list defaults without spaces ("int[] dims=[0,1]"); torch prints them
    # with ("[0, 1]").
    text = re.sub(r"=\[[^\]]*\]", lambda m: m.group(0).replace(" ", ""), str(op._schema))
    try:
        sig = FunctionSchema.parse(text).signature()
    except Exception:  # noqa: BLE001 - a custom schema torchgen cannot read has no match
        return None
    return sig.arguments, sig.returns


def _named_signature(op: OpOverload) -> tuple | None:
    """The core signature's arguments as a set of (name, type), and its returns: equal
    for counterparts that order their arguments differently (``polygamma_(self, n)`` /
    ``polygamma(n, self)``), name the tensor ``input`` (``alpha_dropout``) or give an
    argument another default (``bernoulli_.float`` / ``bernoulli.p``)."""
    core = _core_signature(op)
    if core is None:
        return None
    arguments, returns = core
    names = frozenset(("self" if a.name == "input" else a.name, str(a.type))
                      for a in arguments.flat_all)
    return names, returns


def _is_functional(op: OpOverload | None) -> bool:
    return op is not None and not op._schema.is_mutable and not any(
        r.alias_info is not None for r in op._schema.returns
    )


@functools.cache
def _default_variant(op: OpOverload) -> tuple[OpOverload, bool] | None:
    """The overload, among the ops named like ``op``'s functional version (``add_`` ->
    ``add``, ``__iand__`` -> ``__and__``, ``add.out`` -> ``add``, ``_foo`` ->
    ``_foo_functional``), whose normalized schema equals ``op``'s, and False; else one
    whose arguments only differ in order, names or defaults (then bound by name), and True.
    Matching on the whole schema, not on the overload name, pairs ``pow_.Scalar`` with
    ``pow.Tensor_Scalar``."""
    wanted = _core_signature(op)
    if wanted is None:
        return None
    namespace = op._schema.name.split("::")[0]
    base = OperatorName.parse(op._schema.name.split("::")[-1]).name
    name = f"__{base.base}__" if base.dunder_method else base.base
    candidates = []
    for candidate_name in (name, f"{base.base}_functional"):
        packet = getattr(getattr(torch.ops, namespace), candidate_name, None)
        if packet is not None:
            candidates += [getattr(packet, o) for o in packet.overloads()]
    candidates = [c for c in candidates if c is not op and _is_functional(c)]
    for found in candidates:
        if _core_signature(found) == wanted:
            return found, False
    named = _named_signature(op)
    for found in candidates:
        if _named_signature(found) == named:
            return found, True
    return None


def _by_name(functional: OpOverload, out_args: tuple[str, ...]) -> Callable:
    """The call of ``functional`` with the mutating node's arguments bound by name."""
    def arguments(node: Node) -> tuple[tuple, dict]:
        schema = node.target._schema
        values = {("self" if a.name == "input" else a.name): argument_value(node, schema, i)
                  for i, a in enumerate(schema.arguments) if a.name not in out_args}
        args, kwargs = [], {}
        for a in functional._schema.arguments:
            value = values["self" if a.name == "input" else a.name]
            if a.kwarg_only:
                kwargs[a.name] = value
            else:
                args.append(value)
        return tuple(args), kwargs
    return arguments


def _batch_norm_arguments(node: Node) -> tuple[tuple, dict]:
    schema = node.target._schema
    return tuple(argument_value(node, schema, i) for i in range(8)), {}


def _positional_arguments(node: Node) -> tuple[tuple, dict]:
    schema = node.target._schema
    return tuple(argument_value(node, schema, i) for i in range(len(schema.arguments))), {}


def _instance_norm(emit: Callable[..., Node], node: Node) -> list[Node]:
    """instance_norm with running statistics, as torch's own implementation computes it:
    batch norm over the input seen as (1, batch * channels, ...) with the statistics
    repeated per batch element; the new statistics are their mean over the batch."""
    aten = torch.ops.aten
    x, weight, bias, mean, var, _, momentum, eps, _ = (
        argument_value(node, node.target._schema, i) for i in range(9))
    shape = list(x.meta["val"].shape) if "val" in x.meta else [None]
    if not all(isinstance(d, int) for d in shape):
        raise UnsupportedMutationError(
            node, "instance_norm with running statistics needs the input's static shape",
            "no-variant")
    batch, channels = shape[0], shape[1]
    flat = emit(aten.reshape.default, x, [1, batch * channels, *shape[2:]])
    weight, bias, mean, var = (
        None if t is None else emit(aten.repeat.default, t, [batch])
        for t in (weight, bias, mean, var))
    norm = emit(aten._native_batch_norm_legit_functional.default, flat, weight, bias, mean,
                var, True, momentum, eps)
    out, new_mean, new_var = (emit(operator.getitem, norm, i) for i in (0, 3, 4))
    return [emit(aten.reshape.default, out, shape),
            *(emit(aten.mean.dim, emit(aten.reshape.default, t, [batch, channels]), [0])
              for t in (new_mean, new_var))]


def _fill_diagonal(emit: Callable[..., Node], node: Node) -> list[Node]:
    """fill_diagonal_ (composite in eager, kept by export) as an index_fill of the
    flattened value: the main diagonal is every (sum of contiguous strides)-th element;
    wrap=True continues past the square in a tall contiguous matrix, as eager's storage
    walk does (refused for other layouts, whose storage walk leaves the logical diagonal)."""
    aten = torch.ops.aten
    x, value, wrap = (argument_value(node, node.target._schema, i) for i in range(3))
    val = x.meta.get("val")
    shape = list(val.shape) if isinstance(val, torch.Tensor) else [None]
    if not all(isinstance(d, int) for d in shape) or len(shape) < 2:
        raise UnsupportedMutationError(
            node, "fill_diagonal_ needs the tensor's static shape", "no-variant")
    step = sum(math.prod(shape[i + 1:]) for i in range(len(shape)))
    count = min(shape)
    if wrap and len(shape) == 2 and shape[0] > shape[1] + 1:
        if not val.is_contiguous():
            raise UnsupportedMutationError(
                node, "fill_diagonal_(wrap=True) of a non-contiguous tall matrix walks its "
                      "storage, not its logical elements", "no-variant")
        count = -(-math.prod(shape) // step)
    index = emit(aten.arange.start_step, 0, count * step, step, dtype=torch.long,
                 device=val.device)
    flat = emit(aten.index_fill.int_Scalar, emit(aten.reshape.default, x, [-1]), 0, index,
                value)
    new = emit(aten.reshape.default, flat, shape)
    return [new, new]


# Ops that write in training mode without saying so (see op_schema.HIDDEN_WRITES): their
# functional form returns (output, save_mean, save_invstd, new running_mean, new running_var).
_BUILT_IN = {
    torch.ops.aten.batch_norm.default: FunctionalVariant(
        torch.ops.aten._native_batch_norm_legit_functional.default, (), False,
        _batch_norm_arguments, (0, 3, 4)),
    torch.ops.aten.native_batch_norm.default: FunctionalVariant(
        torch.ops.aten._native_batch_norm_legit_functional.default, (), False,
        _batch_norm_arguments, (0, 1, 2, 3, 4)),
    torch.ops.aten.instance_norm.default: FunctionalVariant(
        None, (), False, expand=_instance_norm),
    # Its composite calls the helper, whose functional twin also returns the mask.
    torch.ops.aten.fused_moving_avg_obs_fake_quant.default: FunctionalVariant(
        torch.ops.aten._fused_moving_avg_obs_fq_helper_functional.default, (), False,
        _positional_arguments, (0, 2, 3, 4, 5)),
    torch.ops.aten.fill_diagonal_.default: FunctionalVariant(
        None, (), True, expand=_fill_diagonal),
    # In training mode (dropout_ with train=False writes nothing, see op_schema).
    torch.ops.aten.dropout_.default: FunctionalVariant(
        torch.ops.aten.dropout.default, (), True, _positional_arguments),
}


def _all_arguments(node: Node) -> tuple[tuple, dict]:
    schema = node.target._schema
    kwargs = {a.name: argument_value(node, schema, i) for i, a in enumerate(schema.arguments)}
    return (node.target,), kwargs


@functools.cache
def _auto_functionalized(op: OpOverload) -> FunctionalVariant | None:
    """torch's own fallback for a custom op with ``(a!)`` arguments and no registered
    variant, as ``run_decompositions`` uses it: ``auto_functionalized(op, **arguments)``
    returns the op's result (None when it has none), then each written argument's new
    value. Only for plain written ``Tensor`` arguments and results aliasing nothing, so
    every result has a fixed position."""
    if not can_auto_functionalize(op):
        return None
    schema = op._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if any(str(a.type) != "Tensor" for a in written) or any(
        r.alias_info is not None for r in schema.returns
    ):
        return None
    n_results = max(len(schema.returns), 1)
    picks = (*range(len(schema.returns)), *range(n_results, n_results + len(written)))
    return FunctionalVariant(auto_functionalized, (), False, _all_arguments, picks)


def functional_variant(op: Callable) -> FunctionalVariant | str:
    """The functional variant of a mutating op, or a string saying why there is none."""
    try:
        answer = _ANSWERS.get(op)
    except TypeError:  # an unhashable callable
        return _functional_variant(op)
    if answer is None:
        answer = _ANSWERS[op] = _functional_variant(op)
    return answer


def _functional_variant(op: Callable) -> FunctionalVariant | str:
    if not isinstance(op, OpOverload):
        return f"{op!r} is not an operator with a schema"
    schema = op._schema
    if op._opname in _METADATA_MUTATIONS:
        return f"{op} changes the shape/strides/storage of its argument, not only its values"
    out_args = tuple(a.name for a in schema.arguments if a.is_out)
    if op._opname in _VALUE_PRESERVING and op not in _REGISTRY:
        return FunctionalVariant(None, out_args, True)
    if op in _BUILT_IN and op not in _REGISTRY:
        return _BUILT_IN[op]
    functional = _REGISTRY.get(op)
    derived = None if functional is not None else _default_variant(op)
    if derived is not None:
        functional, by_name = derived
        if by_name:
            return FunctionalVariant(functional, out_args, _returns_written(schema),
                                     _by_name(functional, out_args))
    if functional is None:
        fallback = _auto_functionalized(op)
        if fallback is not None:
            return fallback
        return (f"no functional variant of {op} is known; register one with "
                f"passes.register_functional_variant({op}, functional_op)")
    return FunctionalVariant(functional, out_args, _returns_written(schema))
