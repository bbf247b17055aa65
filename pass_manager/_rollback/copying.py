"""Copy and compare the values a pass may edit in place: node meta, signatures.

A snapshot copies mutable containers (dicts, lists, sets, mutable dataclasses such as a
quantization annotation) and keeps everything else by reference: immutable values,
tensors, nodes, frozen dataclasses (a quantization spec) and tree specs. ``same`` then
tells, identity first, whether a value still equals its copy.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..analysis import equal

__all__ = ["MISSING", "copy_value", "is_container", "meta_entries", "same", "shallow"]

MISSING = object()

# Kept by reference: immutable values, and objects a pass replaces but does not edit.
# (torch._C.TensorBase: every tensor, checked without torch.Tensor's slower Python instance check.)
_IMMUTABLE = (
    str, int, float, bool, tuple, frozenset, type(None), torch._C.TensorBase, torch.fx.Node,
    pytree.TreeSpec,
)


def _mutable_fields(value: Any) -> tuple[str, ...] | None:
    """The field names of a mutable dataclass instance; None for anything else (a frozen
    dataclass, such as a quantization spec, cannot be edited in place: kept by reference)."""
    cls = type(value)
    names = _FIELDS.get(cls, MISSING)
    if names is MISSING:
        params = getattr(cls, "__dataclass_params__", None)
        mutable = params is not None and not params.frozen and cls is not type
        names = tuple(f.name for f in dataclasses.fields(cls)) if mutable else None
        _FIELDS[cls] = names
    return names


_FIELDS: dict[type, Any] = {}


def _frozen(value: Any) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return params is not None and params.frozen


def is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, set)) or _mutable_fields(value) is not None


def copy_value(value: Any, depth: int = 0) -> Any:
    """Copy containers and mutable dataclasses; keep everything else by reference."""
    if depth > 4 or isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, dict):
        if all(isinstance(v, _IMMUTABLE) or _frozen(v) for v in value.values()):
            return value.copy()
        return type(value)((k, copy_value(v, depth + 1)) for k, v in value.items())
    if isinstance(value, list):
        return [copy_value(v, depth + 1) for v in value]
    if isinstance(value, set):
        return set(value)
    names = _mutable_fields(value)
    if names is not None:
        clone = copy.copy(value) if not hasattr(value, "__dict__") else shallow(value)
        for name in names:
            field_value = getattr(value, name, MISSING)
            if field_value is not MISSING and not isinstance(field_value, _IMMUTABLE):
                object.__setattr__(clone, name, copy_value(field_value, depth + 1))
        return clone
    return value


def same(value: Any, recorded: Any, depth: int = 0) -> bool:
    """Whether ``value`` still equals the copy ``recorded`` (identity first, then structure)."""
    if value is recorded:
        return True
    if type(value) is not type(recorded) or depth > 4:
        return False
    if isinstance(value, dict):
        if len(value) != len(recorded):
            return False
        # Fast path (C loops): same keys, same objects in the same order.
        if all(map(operator.is_, value.values(), recorded.values())):
            return list(value) == list(recorded)
        return all(same(v, recorded.get(k, MISSING), depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return len(value) == len(recorded) and all(
            same(a, b, depth + 1) for a, b in zip(value, recorded, strict=True)
        )
    if isinstance(value, set):
        return value == recorded
    names = _mutable_fields(value)
    if names is not None:
        return all(
            same(getattr(value, n, MISSING), getattr(recorded, n, MISSING), depth + 1)
            for n in names
        )
    if isinstance(value, (torch._C.TensorBase, torch.fx.Node)):
        return False
    return equal(value, recorded)  # an object that cannot compare counts as changed


def shallow(obj: Any) -> Any:
    """A shallow copy of a plain (``__dict__``) object, without ``copy.copy``'s overhead."""
    clone = object.__new__(type(obj))
    clone.__dict__.update(obj.__dict__)
    return clone


def meta_entries(metas: list[dict], key: str) -> list[Any]:
    """Each meta's entry ``key`` (MISSING where absent), by reference."""
    try:  # dict.get mapped in C: a third of methodcaller's cost, which looks the method up
        return list(map(dict.get, metas, itertools.repeat(key), itertools.repeat(MISSING)))
    except TypeError:  # a meta that is some other mapping
        return [meta.get(key, MISSING) for meta in metas]
