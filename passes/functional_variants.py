"""Functional counterparts of operators that write to their arguments.

The rules, in order: a variant registered with :func:`register_functional_variant`;
otherwise the counterpart is derived from the schema: the non-mutating overload of the
functional op (``add_`` / ``add.out`` -> ``add``, ``__ior__`` -> ``__or__``,
``_native_batch_norm_legit`` -> ``_native_batch_norm_legit_functional``) whose schema,
normalized by torchgen (no overload name, out= arguments or alias annotations), equals the
mutating op's: ``pow_.Scalar`` -> ``pow.Tensor_Scalar``, ``copy_`` -> ``copy``. Built in:
``batch_norm`` in training mode (it updates its running statistics without saying so in
its schema) becomes ``_native_batch_norm_legit_functional``; ``detach_`` changes no value
and becomes nothing.

A functional variant takes the op's arguments (without the ``out=`` ones) and returns:

* when every written argument is returned by the op (in-place and ``out=`` ops): the
  new values, in the order of the op's results;
* otherwise: the op's results followed by the new value of each written argument.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._ops import OpOverload
from torch.fx import Node
from torchgen.model import FunctionSchema

from ._aliasing import argument_value

__all__ = [
    "FunctionalVariant",
    "functional_variant",
    "register_functional_variant",
    "unregister_functional_variant",
]

# Ops that change the shape, strides or storage of their argument rather than its values.
_METADATA_MUTATIONS = frozenset({"resize_", "resize_as_", "set_", "as_strided_", "t_",
                                 "transpose_", "squeeze_", "unsqueeze_", "swapdims_",
                                 "swapaxes_"})
# In-place ops that change no value (only autograd metadata): they rewrite to nothing.
_VALUE_PRESERVING = frozenset({"detach_", "requires_grad_"})

_REGISTRY: dict[OpOverload, Callable] = {}


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
    """

    functional: Callable | None
    out_args: tuple[str, ...]
    returns_written: bool
    arguments: Callable[[Node], tuple[tuple, dict]] | None = None
    picks: tuple[int, ...] | None = None


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


def unregister_functional_variant(op: OpOverload) -> None:
    _REGISTRY.pop(op, None)


def _returns_written(schema: torch.FunctionSchema) -> bool:
    returned = set()
    for ret in schema.returns:
        if ret.alias_info is not None:
            returned |= set(ret.alias_info.before_set)
    return all(
        set(arg.alias_info.before_set) <= returned
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    )


@functools.cache
def _core_signature(op: OpOverload) -> tuple | None:
    """torchgen's normalization of a schema, equal across an op's in-place, out= and
    functional versions: no overload name, no out= arguments, no alias annotations, written
    arguments the op does not return turned into results."""
    try:
        sig = FunctionSchema.parse(str(op._schema)).signature()
    except Exception:  # noqa: BLE001 - a custom schema torchgen cannot read has no match
        return None
    return sig.arguments, sig.returns


def _is_functional(op: OpOverload | None) -> bool:
    return op is not None and not op._schema.is_mutable and not any(
        r.alias_info is not None for r in op._schema.returns
    )


@functools.cache
def _default_variant(op: OpOverload) -> OpOverload | None:
    """The overload, among the ops named like ``op``'s functional version (``add_`` ->
    ``add``, ``__iand__`` -> ``__and__``, ``add.out`` -> ``add``, ``_foo`` ->
    ``_foo_functional``), whose normalized schema equals ``op``'s. Matching on the whole
    schema, not on the overload name, pairs ``pow_.Scalar`` with ``pow.Tensor_Scalar``."""
    wanted = _core_signature(op)
    if wanted is None:
        return None
    namespace = op._schema.name.split("::")[0]
    base = FunctionSchema.parse(str(op._schema)).name.name
    name = f"__{base.base}__" if base.dunder_method else base.base
    for candidate_name in (name, f"{base.base}_functional"):
        packet = getattr(getattr(torch.ops, namespace), candidate_name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            found = getattr(packet, overload)
            if found is not op and _is_functional(found) and _core_signature(found) == wanted:
                return found
    return None


def _batch_norm_arguments(node: Node) -> tuple[tuple, dict]:
    schema = node.target._schema
    return tuple(argument_value(node, schema, i) for i in range(8)), {}


# Ops that write in training mode without saying so (see _aliasing.HIDDEN_WRITES): their
# functional form returns (output, save_mean, save_invstd, new running_mean, new running_var).
_BUILT_IN = {
    torch.ops.aten.batch_norm.default: FunctionalVariant(
        torch.ops.aten._native_batch_norm_legit_functional.default, (), False,
        _batch_norm_arguments, (0, 3, 4)),
    torch.ops.aten.native_batch_norm.default: FunctionalVariant(
        torch.ops.aten._native_batch_norm_legit_functional.default, (), False,
        _batch_norm_arguments, (0, 1, 2, 3, 4)),
}


def functional_variant(op: Callable) -> FunctionalVariant | str:
    """The functional variant of a mutating op, or a string saying why there is none."""
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
    functional = _REGISTRY.get(op) or _default_variant(op)
    if functional is None:
        return (f"no functional variant of {op} is known; register one with "
                f"passes.register_functional_variant({op}, functional_op)")
    return FunctionalVariant(functional, out_args, _returns_written(schema))
