"""The modules and tensors of a program as a snapshot records them, in C loops.

A graph module from ``ep.module()`` has one submodule per level of every buffer's path:
357 modules holding 354 buffers for a 32-layer decoder. Recording them module by module
(a tuple, a prefix string and a call per tensor) cost more than the pass a snapshot
guards. Here every record is a flat list built by ``map`` over all modules at once:

* per module, shallow copies of its ``__dict__``, ``buffers``, ``_parameters`` and
  ``_modules`` (what :meth:`ModulesRecord.restore` puts back);
* one list of every tensor it holds (buffers, tensor attributes, parameters, then the
  extra tensors the caller adds, e.g. an ExportedProgram's state) and their version
  counters. Names are only made when a write has to be reported.

Comparison is by identity, in C (``operator.is_`` over chained dict values): a value that
is merely equal (a new scalar tensor holding the same number) is a change.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["TENSOR", "ModulesRecord", "TensorsRecord", "same_dicts", "tensor_keys"]

# Every tensor (parameters, fake and functional tensors) derives from the C base class;
# checking against it skips torch.Tensor's Python-level instance check (9x slower).
TENSOR = torch._C.TensorBase

_chain = itertools.chain.from_iterable
_values = dict.values
_BUFFERS = operator.itemgetter("_buffers")
_PARAMETERS = operator.itemgetter("_parameters")
_MODULES = operator.itemgetter("_modules")


def tensor_keys(attrs: dict) -> list[str]:
    """The names of the tensor-valued entries of ``attrs`` (in C loops)."""
    return list(itertools.compress(attrs, map(isinstance, attrs.values(),
                                              itertools.repeat(TENSOR))))


def same_dicts(now: list[dict], then: list[dict]) -> bool:
    """Pairwise: the same keys in the same order, holding the very same objects."""
    return (
        len(now) == len(then)
        and list(map(len, now)) == list(map(len, then))
        and list(_chain(now)) == list(_chain(then))
        and all(map(operator.is_, _chain(map(_values, now)), _chain(map(_values, then))))
    )


def _tensors_in(dicts: Iterable[dict]) -> list[Any]:
    values = list(_chain(map(_values, dicts)))
    return list(itertools.compress(values, map(isinstance, values, itertools.repeat(TENSOR))))


class ModulesRecord:
    """Every module's attributes and registered state (``named``: ``modules_of``'s list)."""

    def __init__(self, named: list[tuple[str, torch.nn.Module]]):
        self.named = named
        self.modules = list(map(operator.itemgetter(1), named))
        self.attrs = list(map(dict.copy, map(vars, self.modules)))
        self.buffers = list(map(dict.copy, map(_BUFFERS, self.attrs)))
        self.parameters = list(map(dict.copy, map(_PARAMETERS, self.attrs)))
        self.submodules = list(map(dict.copy, map(_MODULES, self.attrs)))
        # Tensor attributes outside the registries (lifted constants of ``ep.module()``)
        # are rare: found in one C pass over every attribute value.
        self.attr_tensors = [t for t in _tensors_in(self.attrs)
                             if not isinstance(t, torch.nn.Parameter)]

    def tensors(self) -> list[Any]:
        """Buffers, tensor attributes, parameters (duplicates included), in that order."""
        return [*_tensors_in(self.buffers), *self.attr_tensors, *_tensors_in(self.parameters)]

    def named_tensors(self) -> list[tuple[str, Any, bool]]:
        """What :meth:`tensors` lists, in its order: ``(name, tensor, data may be copied)``
        (a parameter's never is: parameters are the bulk of a model)."""
        prefixes = [f"{name}." if name else "" for name, _ in self.named]
        found: list[tuple[str, Any, bool]] = []
        for prefix, entries in zip(prefixes, self.buffers, strict=True):
            found += [(prefix + k, v, True) for k, v in entries.items() if isinstance(v, TENSOR)]
        for prefix, entries in zip(prefixes, self.attrs, strict=True):
            found += [(prefix + k, v, True) for k, v in entries.items()
                      if isinstance(v, TENSOR) and not isinstance(v, torch.nn.Parameter)]
        for prefix, entries in zip(prefixes, self.parameters, strict=True):
            found += [(prefix + k, v, False) for k, v in entries.items()
                      if isinstance(v, TENSOR)]
        return found

    def changed(self) -> bool:
        """A buffer, parameter, submodule or tensor attribute added, removed or replaced.

        Every submodule added is registered in a recorded module's ``_modules``, so the
        recorded modules are all that needs looking at.
        """
        now = list(map(vars, self.modules))
        if not (
            same_dicts(list(map(_BUFFERS, now)), self.buffers)
            and same_dicts(list(map(_PARAMETERS, now)), self.parameters)
            and same_dicts(list(map(_MODULES, now)), self.submodules)
        ):
            return True
        if same_dicts(now, self.attrs):
            return False
        # Other attributes replaced, added or removed (``_code`` by a recompile): only
        # tensors count, and only in the modules whose attributes differ.
        for attrs, recorded in zip(now, self.attrs, strict=True):
            if attrs is recorded or same_dicts([attrs], [recorded]):
                continue
            keys = tensor_keys(recorded)
            if tensor_keys(attrs) != keys or not all(
                attrs[k] is recorded[k] for k in keys
            ):
                return True
        return False

    def restore(self) -> None:
        for module, attrs, buffers, params, modules in zip(
            self.modules, self.attrs, self.buffers, self.parameters, self.submodules,
            strict=True,
        ):
            module.__dict__.clear()
            module.__dict__.update(attrs)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._parameters.clear()
            module._parameters.update(params)
            module._modules.clear()
            module._modules.update(modules)


class TensorsRecord:
    """Tensors' identities and version counters, and copies of the data of those a pass
    may write (``copy``).

    ``named`` makes ``(name, tensor, copyable)`` for every entry of ``tensors``, in order,
    and is called only when a write is reported or data must be copied: the first name
    of a tensor listed twice is its name.
    """

    def __init__(self, tensors: list[Any], named: Any, copy: bool):
        self.tensors = tensors
        self.versions = [t._version for t in tensors]
        self._named = named
        self._names: list[str] | None = None
        self.data: dict[int, torch.Tensor] = {}
        if copy:
            seen: set[int] = set()
            for i, (_, tensor, copyable) in enumerate(self.named()):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    if copyable:
                        self.data[i] = tensor.detach().clone()

    def named(self) -> list[tuple[str, Any, bool]]:
        entries = self._named()
        assert len(entries) == len(self.tensors), "tensor names out of step with the record"
        return entries

    def _first_names(self) -> list[str | None]:
        """Per entry, its name, or None for a later listing of a tensor already named."""
        if self._names is None:
            seen: set[int] = set()
            names: list[Any] = []
            for name, tensor, _ in self.named():
                names.append(None if id(tensor) in seen else name)
                seen.add(id(tensor))
            self._names = names
        return self._names

    def written(self) -> list[str]:
        """Tensors whose data was written in place since the record (version counter)."""
        versions = [t._version for t in self.tensors]
        if versions == self.versions:
            return []
        names = self._first_names()
        return sorted(
            names[i] for i, (now, then) in enumerate(zip(versions, self.versions, strict=True))
            if now != then and names[i] is not None
        )

    def unrestorable(self) -> list[str]:
        """Tensors written in place whose old data was not copied, so cannot come back."""
        if [t._version for t in self.tensors] == self.versions:
            return []
        copied = {id(self.tensors[i]) for i in self.data}
        names = self._first_names()
        return sorted(
            names[i] for i, (tensor, version) in enumerate(zip(self.tensors, self.versions,
                                                                strict=True))
            if names[i] is not None and id(tensor) not in copied and tensor._version != version
        )

    def restore(self) -> None:
        for i, data in self.data.items():
            if self.tensors[i]._version != self.versions[i]:
                with torch.no_grad():
                    self.tensors[i].copy_(data)
