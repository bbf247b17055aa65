"""Everything of a program outside its graph, as a rollback record holds it, in C loops.

``ep.module()`` has one submodule per level of every buffer's path (357 modules for a
32-layer decoder), so every record is a flat list built by ``map`` over all modules at once,
compared by identity (a new scalar tensor holding the same number is a change); names are
made only when a write is reported.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import operator
from collections.abc import Container, Iterable
from typing import Any

import torch
from torch.export import ExportedProgram

from ..analysis import equal
from ..program import modules_of

__all__ = ["TENSOR", "ObjectsRecord", "StateRecord"]

# Every tensor (parameters, fake and functional tensors) derives from the C base class;
# checking against it skips torch.Tensor's Python-level instance check (9x slower).
TENSOR = torch._C.TensorBase

_chain = itertools.chain.from_iterable
_values = dict.values
# A module's registries of named state: its buffers, parameters and submodules.
_REGISTRIES = tuple(map(operator.itemgetter, ("_buffers", "_parameters", "_modules")))
# A module's names of buffers left out of its state_dict: a set, edited in place.
_NON_PERSISTENT = operator.itemgetter("_non_persistent_buffers_set")
# An ExportedProgram's attributes recorded as copies (put back as copies of the copies).
_EXPORTED = ("_state_dict", "_constants", "_range_constraints", "_verifiers", "_example_inputs")


def _tensor_keys(attrs: dict) -> list[str]:
    return list(itertools.compress(attrs, map(isinstance, attrs.values(),
                                              itertools.repeat(TENSOR))))


def _same_dicts(now: list[dict], then: list[dict]) -> bool:
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
    """Per module (``named``: ``modules_of``'s list), shallow copies of its ``__dict__``,
    ``_buffers``, ``_parameters``, ``_modules`` and ``_non_persistent_buffers_set``."""

    def __init__(self, named: list[tuple[str, torch.nn.Module]]):
        self.named = named
        self.modules = list(map(operator.itemgetter(1), named))
        self.attrs = list(map(dict.copy, map(vars, self.modules)))
        self.registries = [list(map(dict.copy, map(get, self.attrs))) for get in _REGISTRIES]
        self.buffers, self.parameters, _ = self.registries
        self.non_persistent = list(map(set.copy, map(_NON_PERSISTENT, self.attrs)))
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
        for dicts, copyable, skipped in ((self.buffers, True, ()),
                                         (self.attrs, True, torch.nn.Parameter),
                                         (self.parameters, False, ())):
            for prefix, entries in zip(prefixes, dicts, strict=True):
                found += [(prefix + k, v, copyable) for k, v in entries.items()
                          if isinstance(v, TENSOR) and not isinstance(v, skipped)]
        return found

    def changed(self) -> bool:
        """A buffer, parameter, submodule or tensor attribute added, removed or replaced, or
        a buffer's persistence (in the state_dict or not) changed (a submodule added is
        registered in a recorded module's ``_modules``)."""
        now = list(map(vars, self.modules))
        if not all(_same_dicts(list(map(get, now)), recorded)
                   for get, recorded in zip(_REGISTRIES, self.registries, strict=True)):
            return True
        if list(map(_NON_PERSISTENT, now)) != self.non_persistent:
            return True
        if _same_dicts(now, self.attrs):
            return False
        # Other attributes replaced, added or removed (``_code`` by a recompile): only
        # tensors count, and only in the modules whose attributes differ.
        for attrs, recorded in zip(now, self.attrs, strict=True):
            if attrs is recorded or _same_dicts([attrs], [recorded]):
                continue
            keys = _tensor_keys(recorded)
            if _tensor_keys(attrs) != keys or not all(attrs[k] is recorded[k] for k in keys):
                return True
        return False

    def restore(self) -> None:
        for module, attrs, non_persistent, *registries in zip(
                self.modules, self.attrs, self.non_persistent, *self.registries, strict=True):
            module.__dict__.clear()
            module.__dict__.update(attrs)  # first: it holds the registries the module had
            for get, recorded in (*zip(_REGISTRIES, registries, strict=True),
                                  (_NON_PERSISTENT, non_persistent)):
                get(attrs).clear()
                get(attrs).update(recorded)


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # a fake tensor has no data_ptr
_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _mark(t: Any) -> tuple[int, int | None]:
    """What a write of a tensor's data changes: its version counter, and where its data lives
    (``t.data = other`` swaps the data under the same tensor with no version bump)."""
    return t._version, t.data_ptr() if type(t) in _PLAIN and t.layout == torch.strided else None


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself, -0.0 differs from 0.0)."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point() and a.element_size() in _BITS:
        with contextlib.suppress(RuntimeError):  # a layout with no dtype view (sparse)
            bits = _BITS[a.element_size()]
            return torch.equal(a.view(bits), b.view(bits))
    return torch.equal(a, b)


def _marks(tensors: list[Any]) -> list[tuple[int, int | None]]:
    if all(map(_PLAIN.__contains__, map(type, tensors))):
        with contextlib.suppress(RuntimeError):  # in C loops, unless one is sparse
            return list(zip(map(_VERSION, tensors), map(TENSOR.data_ptr, tensors), strict=True))
    return list(map(_mark, tensors))


class TensorsRecord:
    """Tensors' identities, version counters and data addresses, and copies of the data of
    those a pass may write (``copy``; a parameter's only with ``parameters``, as under
    ``strict``: parameters are the bulk of a model). ``named`` makes ``(name, tensor,
    copyable)`` for every entry of ``tensors``, in order, only when a write is reported or
    data must be copied (a tensor listed twice is named by its first listing)."""

    def __init__(self, tensors: list[Any], named: Any, copy: bool, parameters: bool = False):
        self.tensors = tensors
        self.marks = _marks(tensors)
        self.requires_grad = list(map(_REQUIRES_GRAD, tensors))
        self._named = named
        self._entries: list[tuple[str | None, Any, bool]] | None = None
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if copy:  # each tensor once, at its first listing: its data, and a copy of it
            self.data = {i: (tensor.detach(), tensor.detach().clone())
                         for i, (name, tensor, copyable) in enumerate(self.named())
                         if (copyable or parameters) and name is not None}

    def named(self) -> list[tuple[str | None, Any, bool]]:
        """``named``'s entries, made once; a tensor's later listings have the name None."""
        if self._entries is None:
            entries = self._named()
            assert len(entries) == len(self.tensors), "tensor names out of step with the record"
            seen: set[int] = set()
            self._entries = []
            for name, tensor, copyable in entries:
                self._entries.append((None if id(tensor) in seen else name, tensor, copyable))
                seen.add(id(tensor))
        return self._entries

    def written(self, skip: Container[int] = ()) -> list[str]:
        """Tensors whose data was written in place or swapped (``t.data = other``) since the
        record, but for the entries ``skip``; a copied one is also compared with its copy
        (``t.data.mul_(2)`` writes through a tensor with a version counter of its own)."""
        marks = _marks(self.tensors)
        changed = {i for i, (now, then) in enumerate(zip(marks, self.marks, strict=True))
                   if now != then}
        changed.update(i for i, (data, copied) in self.data.items()
                       if i not in changed and i not in skip and not _same_data(data, copied))
        names = self.named() if changed else []
        return sorted(names[i][0] for i in changed if names[i][0] is not None and i not in skip)

    def unrestorable(self) -> list[str]:
        """Tensors written in place whose old data was not copied, so cannot come back (a
        tensor's data is copied at its first listing, the one that names it)."""
        return self.written(skip=self.data)

    def flags_changed(self) -> bool:
        """A tensor's ``requires_grad`` set otherwise since the record."""
        return list(map(_REQUIRES_GRAD, self.tensors)) != self.requires_grad

    def restore(self) -> None:
        for tensor, flag in zip(self.tensors, self.requires_grad, strict=True):
            if tensor.requires_grad != flag:  # state is made of leaves: settable
                tensor.requires_grad_(flag)
        with torch.no_grad():  # every copy: a write through ``t.data`` leaves no mark
            for i, (data, copied) in self.data.items():
                self.tensors[i].data = data  # the very data it had, if the pass swapped it
                data.copy_(copied)


# Per type, whether its objects are recorded: lists and dataclass instances with a
# ``__dict__`` (signatures, specs, arguments, call-graph entries).
_KINDS: dict[type, type | None] = {}
_UNKNOWN = object()
_repeat = itertools.repeat


class ObjectsRecord:
    """Lists and dataclass instances (the graph signature, the module call graph) and what
    they hold to ``depth`` levels, each with a shallow copy of its contents: compared in C
    loops and restored in place, so that the objects other code holds stay the program's."""

    def __init__(self, roots: list, depth: int = 6):
        self.items: list[tuple[Any, Any]] = []
        level = [roots]
        while level and depth >= 0:  # level by level, in C loops (a shared object: twice)
            depth -= 1
            types = list(map(type, level))
            kinds = list(map(_KINDS.get, types, _repeat(_UNKNOWN)))
            if _UNKNOWN in kinds:  # a type met for the first time
                for cls in set(types) - _KINDS.keys():
                    _KINDS[cls] = (list if issubclass(cls, list) else object if hasattr(
                        cls, "__dataclass_fields__") and cls.__dictoffset__ else None)
                kinds = list(map(_KINDS.__getitem__, types))
            lists = list(itertools.compress(level, map(operator.is_, kinds, _repeat(list))))
            objects = list(itertools.compress(level, map(operator.is_, kinds, _repeat(object))))
            self.items += zip(lists, map(list.copy, lists), strict=True)
            contents = list(map(dict.copy, map(vars, objects)))
            self.items += zip(objects, contents, strict=True)
            level = [*_chain(lists), *_chain(map(_values, contents))]

    def changed(self) -> bool:
        now = [obj.copy() if isinstance(obj, list) else obj.__dict__ for obj, _ in self.items]
        return not equal(now, [contents for _, contents in self.items])

    def rebuilt(self, obj: Any) -> Any:
        """A copy of the recorded ``obj`` as recorded (the recorded objects in it copied too)."""
        clones = {id(o): [] if isinstance(o, list) else object.__new__(type(o))
                  for o, _ in self.items}
        for o, contents in self.items:
            clone = clones[id(o)]
            if isinstance(o, list):
                clone[:] = [clones.get(id(v), v) for v in contents]
            else:
                clone.__dict__.update((k, clones.get(id(v), v)) for k, v in contents.items())
        return clones[id(obj)]

    def restore(self) -> None:
        for obj, contents in self.items:
            if isinstance(obj, list):
                obj[:] = contents
            else:
                obj.__dict__.clear()
                obj.__dict__.update(contents)


class StateRecord:
    """A program outside its graph: every module's attributes and registered state, every
    tensor's identity and version (its data only with ``copy_data``, a parameter's only
    with ``copy_parameters`` too), and an
    ExportedProgram's signature, call graph, state, constants, range constraints,
    verifiers and example inputs."""

    def __init__(self, program: Any, gm: torch.fx.GraphModule, copy_data: bool,
                 copy_parameters: bool = False):
        self.program = program
        self.gm = gm
        self.modules = ModulesRecord(modules_of(gm))
        tensors = self.modules.tensors()
        named = self.modules.named_tensors
        self.exported: dict[str, Any] | None = None
        if isinstance(program, ExportedProgram):
            self.signature = program._graph_signature
            self.call_graph = program._module_call_graph
            self.objects = ObjectsRecord([self.signature, self.call_graph])
            self.exported = {key: copy.copy(getattr(program, key)) for key in _EXPORTED}
            # Its state (the tensors the graph module does not hold), after the modules'.
            extra = [(key, value, not isinstance(value, torch.nn.Parameter))
                     for mapping in (program._state_dict, program._constants)
                     for key, value in mapping.items() if isinstance(value, TENSOR)]
            tensors += [t for _, t, _ in extra]
            named = lambda modules=self.modules.named_tensors: modules() + extra  # noqa: E731
        self.tensors = TensorsRecord(tensors, named, copy_data, copy_parameters)

    def changed(self, program: Any, modules: bool = True) -> bool:
        """The modules (unless ``modules`` is False: known not to), a tensor's
        ``requires_grad``, or the ExportedProgram's attributes, or the program object
        changed."""
        if (modules and self.modules.changed()) or self.tensors.flags_changed():
            return True
        if self.exported is None:
            return program is not self.program
        recorded = self.exported
        signature = program._graph_signature
        return not (
            (signature is self.signature or equal(signature, self.signature_as_recorded()))
            and program._module_call_graph is self.call_graph
            and not self.objects.changed()
            and _same_dicts([program._state_dict, program._constants],
                            [recorded["_state_dict"], recorded["_constants"]])
            and program._range_constraints == recorded["_range_constraints"]
            and program._verifiers == recorded["_verifiers"]
            and program._example_inputs is recorded["_example_inputs"]  # a tuple: not copied
        )

    def signature_as_recorded(self) -> Any:
        return self.objects.rebuilt(self.signature) if self.exported is not None else None

    def restore(self) -> None:
        self.modules.restore()
        self.tensors.restore()
        if self.exported is not None:
            program = self.program
            self.objects.restore()
            program._graph_signature = self.signature
            program._module_call_graph = self.call_graph
            for key, value in self.exported.items():
                setattr(program, key, copy.copy(value))
            program._graph_module = self.gm
