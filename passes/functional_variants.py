"""Functional counterparts of operators that write to their arguments.

The rules, in order: a variant registered with :func:`register_functional_variant`; for
``op_`` the same overload of ``op`` (``aten.add_.Tensor`` -> ``aten.add.Tensor``,
``copy_`` -> ``aten.copy.default``); for an ``out=`` overload the overload of the same
op whose arguments are the non-out ones; for an op that writes arguments it does not
return (``_native_batch_norm_legit``) the same overload of ``op_functional``. Built in:
``batch_norm`` in training mode (it updates its running statistics without saying so in
its schema) becomes ``_native_batch_norm_legit_functional``; ``detach_`` changes no value
and becomes nothing.

A functional variant takes the op's arguments (without the ``out=`` ones) and returns:

* when every written argument is returned by the op (in-place and ``out=`` ops): the
  new values, in the order of the op's results;
* otherwise: the op's results followed by the new value of each written argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._ops import OpOverload
from torch.fx import Node

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
_VALUE_PRESERVING = frozenset({"detach_"})

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


def _signature(arguments) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in arguments]


def _is_functional(op: OpOverload | None) -> bool:
    return op is not None and not op._schema.is_mutable and not any(
        r.alias_info is not None for r in op._schema.returns
    )


def _overload(namespace: str, name: str, overload: str) -> OpOverload | None:
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None


def _default_variant(op: OpOverload) -> OpOverload | None:
    schema = op._schema
    namespace = schema.name.split("::")[0]
    name, overload = op._opname, op._overloadname
    out_args = [a for a in schema.arguments if a.is_out]
    if out_args:
        wanted = _signature(a for a in schema.arguments if not a.is_out)
        packet = getattr(getattr(torch.ops, namespace), name)
        for candidate in packet.overloads():
            found = getattr(packet, candidate)
            if _signature(found._schema.arguments) == wanted and _is_functional(found):
                return found
        return None
    if name.endswith("_") and not name.endswith("__"):
        found = _overload(namespace, name[:-1], overload)
        if _is_functional(found) and _signature(
            found._schema.arguments
        ) == _signature(schema.arguments):
            return found
        return None
    found = _overload(namespace, f"{name}_functional", overload)
    return found if _is_functional(found) else None


def _batch_norm_arguments(node: Node) -> tuple[tuple, dict]:
    schema = node.target._schema
    return tuple(argument_value(node, schema, i) for i in range(8)), {}


# Composite ops that write in training mode (see _aliasing): their functional form.
_BUILT_IN = {
    torch.ops.aten.batch_norm.default: FunctionalVariant(
        torch.ops.aten._native_batch_norm_legit_functional.default, (), False,
        _batch_norm_arguments, (0, 3, 4)),
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
