"""What inputs a program takes, and why one call's inputs do not fit it.

Inputs are checked where they enter (``SemanticValidation(inputs)``, a runtime's decode
steps), so a wrong input tuple is reported naming the call and the inputs the program takes
(``signature_of(ep).mismatch((x,), {})`` -> ``'it gives 1 positional argument, the program
takes 2'``), not as a pytree ``TreeSpec`` mismatch from deep inside the first call.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export._unlift import eq_spec

__all__ = ["CallSignature", "describe_inputs", "signature_of", "tensor_wanted"]


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _structure(spec: pytree.TreeSpec) -> str:
    if spec.is_leaf():
        return "a single value"
    if spec.type is dict:
        return f"a dict with keys {list(spec.context)}"
    count = spec.num_children
    return f"a {spec.type.__name__} of {count} {'entry' if count == 1 else 'entries'}"


def _value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


def tensor_wanted(value: Any) -> str:
    """What to pass instead of ``value`` where a program takes a tensor, e.g. ``"is a
    numpy.ndarray: pass a torch.Tensor (torch.from_numpy(array))"``; ``""`` for a tensor.
    A NumPy array is the usual one: torch's ops refuse it deep inside the first call
    (``'numpy.ndarray' object has no attribute 'numel'``)."""
    if isinstance(value, torch.Tensor):
        return ""
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ == "ndarray":
        return "is a numpy.ndarray: pass a torch.Tensor (torch.from_numpy(array))"
    name = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" \
        else kind.__qualname__
    article = "an" if name[0] in "aeiou" else "a"
    return f"is {article} {name}: pass a torch.Tensor (torch.tensor(value))"


def describe_inputs(args: tuple, kwargs: Mapping[str, Any]) -> str:
    """One call's inputs in a line: ``2 positional arguments (Tensor[1, 4] float32, 3)``."""
    parts = []
    if args:
        parts.append(f"{_plural(len(args), 'positional argument')} "
                     f"({', '.join(_value(a) for a in args)})")
    if kwargs:
        named = ", ".join(f"{k}={_value(v)}" for k, v in kwargs.items())
        parts.append(f"keyword arguments {named}")
    return " and ".join(parts) or "no arguments"


@dataclass(frozen=True)
class CallSignature:
    """The inputs a program takes: the names of its ``positional`` and ``keywords`` inputs,
    and either the pytree ``spec`` of ``(args, kwargs)`` an exported program (or its
    ``ep.module()``) fixed, or the ``signature`` of any other module's ``forward``."""

    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    spec: pytree.TreeSpec | None = None
    signature: inspect.Signature | None = None

    def __str__(self) -> str:
        if self.signature is not None:
            return str(self.signature)
        names = list(self.positional)
        if self.keywords:
            names += ["*", *self.keywords]
        return f"({', '.join(names)})"

    def mismatch(self, args: tuple, kwargs: Mapping[str, Any]) -> str | None:
        """Why the program cannot be called with ``(args, kwargs)``, or None when it can."""
        if self.spec is not None:
            return self._spec_mismatch(tuple(args), dict(kwargs))
        if self.signature is not None:
            try:
                self.signature.bind(*args, **kwargs)
            except TypeError as e:
                return str(e)
        return None

    def leaves(self, args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[tuple, Any]]:
        """The leaves of a call that fits (``mismatch`` is None) with their pytree paths, in
        the order the program binds them: a mapping's entries in the exported key order,
        whatever order the caller wrote them in (torch matches a dict by its keys)."""
        call = (tuple(args), dict(kwargs))
        if self.spec is None:
            return pytree.tree_flatten_with_path(call)[0]
        ordered = pytree.tree_unflatten(self.spec.flatten_up_to(call), self.spec)
        return pytree.tree_flatten_with_path(ordered)[0]

    def _spec_mismatch(self, args: tuple, kwargs: dict[str, Any]) -> str | None:
        args_spec, kwargs_spec = self.spec.children()
        if len(args) != args_spec.num_children:
            return (f"it gives {_plural(len(args), 'positional argument')}, the program takes "
                    f"{args_spec.num_children}")
        expected = list(kwargs_spec.context or ())
        missing = [k for k in expected if k not in kwargs]
        unknown = [k for k in kwargs if k not in expected]
        if missing or unknown:
            said = []
            if missing:
                said.append(f"the keyword argument(s) {', '.join(map(repr, missing))} are missing")
            if unknown:
                said.append(f"the program takes no keyword argument(s) "
                            f"{', '.join(map(repr, unknown))}")
            return "; ".join(said)
        given = [*args, *(kwargs[k] for k in expected)]
        names = [*self.positional, *self.keywords]
        for position, (value, want) in enumerate(
            zip(given, [*args_spec.children(), *kwargs_spec.children()], strict=True)
        ):
            got = pytree.tree_structure(value)
            if not eq_spec(got, want):  # as torch matches a call: a dict's keys in any order
                name = names[position] if position < len(names) else f"#{position}"
                return (f"input {name!r} is {_structure(got)}, the program was exported with "
                        f"{_structure(want)}")
        return None


def _spec_signature(spec: pytree.TreeSpec, names: list[str]) -> CallSignature:
    args_spec, kwargs_spec = spec.children()
    count = args_spec.num_children
    keywords = tuple(kwargs_spec.context or ())
    positional = names[:count] if len(names) >= count else [f"arg{i}" for i in range(count)]
    return CallSignature(tuple(positional), keywords, spec=spec)


def signature_of(program: Any) -> CallSignature:
    """The inputs ``program`` takes (an ExportedProgram, ``ep.module()``, any ``nn.Module``;
    anything else gets a signature that accepts every call)."""
    if isinstance(program, ExportedProgram):
        entry = program.module_call_graph[0].signature if program.module_call_graph else None
        names = list(getattr(entry, "forward_arg_names", None) or ())
        return _spec_signature(program.call_spec.in_spec, names)
    if isinstance(program, torch.nn.Module):
        try:
            signature = inspect.signature(program.forward)
        except (TypeError, ValueError):
            return CallSignature()
        spec = getattr(program, "_in_spec", None)
        if isinstance(spec, pytree.TreeSpec) and spec.num_children == 2:
            return _spec_signature(spec, list(signature.parameters))
        return CallSignature(signature=signature)
    return CallSignature()
