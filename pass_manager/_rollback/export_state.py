"""What a snapshot records of an ExportedProgram besides its graph and state.

The graph signature and the module call graph are small trees of dataclass instances that
passes edit in place (a spec's ``kind`` or ``target`` changed, a spec appended). They are
recorded as shallow copies of each object's fields, compared in C loops and put back in
place, so that the objects other code holds stay the program's own after a rollback.
"""

from __future__ import annotations

from typing import Any

from torch.export.graph_signature import ExportGraphSignature

from ..analysis import equal
from .copying import same

__all__ = ["ObjectsRecord", "SignatureRecord"]


class SignatureRecord:
    """A graph signature: its spec lists, and each spec's and argument's fields, copied
    shallowly (C dict copies); compared and restored in place, copied only for a diff."""

    def __init__(self, signature: ExportGraphSignature):
        self.signature = signature
        self.inputs = list(signature.input_specs)
        self.outputs = list(signature.output_specs)
        specs = self.inputs + self.outputs
        self.fields = list(map(dict.copy, map(vars, specs)))
        self.args = [s.arg for s in specs]
        self.arg_fields = list(map(dict.copy, map(vars, self.args)))

    def changed(self, signature: ExportGraphSignature) -> bool:
        if signature is not self.signature:  # a new signature: compare by value
            return not same(signature, self.rebuilt())
        specs = [*signature.input_specs, *signature.output_specs]
        return not (
            len(signature.input_specs) == len(self.inputs)
            and equal(specs, self.inputs + self.outputs)
            and equal(list(map(vars, specs)), self.fields)
            and equal([vars(s.arg) for s in specs], self.arg_fields)
        )

    def rebuilt(self) -> ExportGraphSignature:
        """A copy of the signature as recorded."""
        args = {}
        for arg, fields in zip(self.args, self.arg_fields, strict=True):
            clone = object.__new__(type(arg))
            clone.__dict__.update(fields)
            args[id(arg)] = clone
        specs = []
        for spec, fields in zip(self.inputs + self.outputs, self.fields, strict=True):
            clone = object.__new__(type(spec))
            clone.__dict__.update(fields)
            clone.arg = args[id(fields["arg"])]
            specs.append(clone)
        return ExportGraphSignature(specs[: len(self.inputs)], specs[len(self.inputs):])

    def restore(self) -> ExportGraphSignature:
        """The recorded signature object, its lists, specs and arguments as recorded."""
        for obj, fields in (*zip(self.inputs + self.outputs, self.fields, strict=True),
                            *zip(self.args, self.arg_fields, strict=True)):
            obj.__dict__.clear()
            obj.__dict__.update(fields)
        self.signature.input_specs = list(self.inputs)
        self.signature.output_specs = list(self.outputs)
        return self.signature


_LEAVES = (str, int, float, bool, type(None))


def _walked(obj: Any) -> bool:
    """A dataclass instance with a ``__dict__`` (argument specs, call signatures)."""
    return hasattr(type(obj), "__dataclass_fields__") and hasattr(obj, "__dict__")


class ObjectsRecord:
    """A list of dataclass instances and the lists and dataclass instances they hold (to
    ``depth`` levels), each with a shallow copy of its contents: compared in C loops and
    restored in place.

    Used for the module call graph: one entry per module of the exported model, whose
    signature holds lists of argument dataclasses.
    """

    def __init__(self, roots: list, depth: int = 3):
        # The roots (module call entries) first, in one C-speed pass: most of them hold
        # nothing more to walk (a signature only at the top module).
        self.items: list[tuple[Any, Any]] = [(roots, roots.copy())]
        self.items += [(root, root.__dict__.copy()) for root in roots]
        seen = {id(obj) for obj, _ in self.items}
        stack = [(value, depth) for _, contents in self.items[1:]
                 for value in contents.values() if not isinstance(value, _LEAVES)]
        while stack:
            obj, left = stack.pop()
            if id(obj) in seen:
                continue
            if isinstance(obj, list):
                contents: Any = obj.copy()
                children = obj
            elif _walked(obj):
                contents = obj.__dict__.copy()
                children = contents.values()
            else:
                continue
            seen.add(id(obj))
            self.items.append((obj, contents))
            if left:
                stack.extend((child, left - 1) for child in children)

    def changed(self) -> bool:
        now = [obj.copy() if isinstance(obj, list) else obj.__dict__ for obj, _ in self.items]
        return not equal(now, [contents for _, contents in self.items])

    def restore(self) -> None:
        for obj, contents in self.items:
            if isinstance(obj, list):
                obj[:] = contents
            else:
                obj.__dict__.clear()
                obj.__dict__.update(contents)
