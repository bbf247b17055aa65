"""A pipeline as text: ``MarkMutableBuffers,InplaceToFunctional,Consume{strict=true}``.

Passes are named by their class name (every Pass subclass registers itself here),
comma-separated; options follow in braces as ``name=value`` pairs: a Python literal,
``true`` / ``false``, ``inf`` / ``nan``, a dtype (``torch.bfloat16``), an operator name
(``aten.clone.default``, or the packet ``aten.clone``), a ``frozenset({...})`` or a member of
an Enum the pass's fields are annotated with (``Mode.FAST``: looked up in that class, so
nothing is imported or run to read it). Only options that differ from the defaults are
printed.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import enum
import functools
import gc
import inspect
import math
import types
import typing
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .errors import PipelineError

__all__ = [
    "did_you_mean",
    "format_pass",
    "format_pipeline",
    "format_value",
    "parse_passes",
    "pass_options",
    "register",
    "registered_passes",
]

# Weak: a class defined in a function (a test, ``function_pass``) leaves when collected.
_classes: weakref.WeakSet = weakref.WeakSet()


def register(cls: type) -> None:
    """Make a pass class nameable in pipeline text (``Pass.__init_subclass__`` calls it)."""
    _classes.add(cls)


def registered_passes(*, collect: bool = False) -> list[type]:
    """Every registered pass class still alive, in a stable order (module, then name).

    A class only a reference cycle keeps (every class is in one: its ``__mro__``), such as
    a class of a finished function or of a notebook cell run again, stays until the
    garbage collector runs; ``collect=True`` runs it first, for answers that must not
    name such a class.
    """
    if collect:
        gc.collect()
    return sorted(
        (cls for cls in _classes if not cls.__dict__.get("_unregistered", False)),
        key=lambda cls: (cls.__module__, cls.__qualname__),
    )


_OPERATORS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def pass_options(pass_: Any) -> dict[str, Any]:
    """The options of a pass: its dataclass fields (no fields: no options)."""
    if not dataclasses.is_dataclass(pass_):
        return {}
    return {f.name: getattr(pass_, f.name) for f in dataclasses.fields(pass_) if f.init}


def _constructor_only(pass_: Any) -> list[str]:
    """The constructor's parameters of a pass that is not a dataclass: options its
    pipeline text could not carry (text naming the class alone would rebuild it without
    them, or with their defaults)."""
    if dataclasses.is_dataclass(pass_):
        return []
    try:
        return list(inspect.signature(type(pass_)).parameters)
    except (TypeError, ValueError):  # no signature to read: nothing known to be lost
        return []


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of one type all the way down, so that text rebuilds the very value a pass
    ran with: ``-0.0`` is not ``0.0``, ``True`` not ``1``, ``1`` not ``1.0``; ``nan`` is
    itself (a value that cannot say, a tensor, differs)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (a != a and b != b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same_value, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(map(_same_value, a.values(), b.values()))
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # a tensor of several elements
        return False


def _differs_from_default(pass_: Any, option: str, value: Any) -> bool:
    """Whether ``value`` is not the option's default (an option without one always is)."""
    f = pass_.__dataclass_fields__[option]
    if f.default_factory is not dataclasses.MISSING:
        return not _same_value(f.default_factory(), value)
    return f.default is dataclasses.MISSING or not _same_value(f.default, value)


def format_value(value: Any, *, python: bool = False) -> str:
    """An option value as text; ``python=True`` spells booleans True/False (for repr)."""
    if isinstance(value, bool):
        return str(value) if python else str(value).lower()
    if isinstance(value, _OPERATORS):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    text = functools.partial(format_value, python=python)
    if isinstance(value, frozenset):  # sorted by text: one value, one text
        return f"frozenset({{{', '.join(sorted(map(text, value)))}}})" if value else "frozenset()"
    if isinstance(value, tuple):
        return f"({', '.join(map(text, value))}{',' if len(value) == 1 else ''})"
    if isinstance(value, list):
        return f"[{', '.join(map(text, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{text(k)}: {text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def format_pass(pass_: Any) -> str:
    """One pass as pipeline text: its name, and its non-default options in braces."""
    if type(pass_).__dict__.get("_unregistered", False):
        raise PipelineError(
            f"{pass_.name} has no pipeline text: only registered Pass classes do "
            "(not plain functions, torch PassBase objects or nested PassManagers)"
        )
    if hidden := _constructor_only(pass_):
        raise PipelineError(
            f"{pass_.name} has no pipeline text: its constructor takes {', '.join(hidden)}, "
            "which are not dataclass fields, so text naming the pass could not rebuild it; "
            "declare it @dataclass(frozen=True) with those options as fields"
        )
    options = [
        f"{key}={_read_back(pass_, key, value)}"
        for key, value in pass_options(pass_).items()
        if _differs_from_default(pass_, key, value)
    ]
    return type(pass_).__name__ + ("{" + ",".join(options) + "}" if options else "")


def _read_back(pass_: Any, key: str, value: Any) -> str:
    """An option's text, which must parse back to the value (a tensor, an enum, a function
    print as text no parse gives back: the pass would be rebuilt without them)."""
    text = format_value(value)
    with contextlib.suppress(PipelineError):
        if _same_value(_parse_value(text, _enums(type(pass_))), value):
            return text
    raise PipelineError(f"{pass_.name} has no pipeline text: its option {key}={text} does not "
                        "read back (text holds Python literals, true/false, inf/nan, dtypes, "
                        "operator names, frozensets and members of the Enums its fields are "
                        "annotated with)")


def format_pipeline(passes: Sequence[Any]) -> str:
    return ",".join(format_pass(p) for p in passes)


def _split(text: str, separator: str) -> list[str]:
    """Split at ``separator`` outside brackets and string literals."""
    parts, depth, quote, start, escaped = [], 0, "", 0, False
    for i, char in enumerate(text):
        if escaped:  # in a string, a backslash escapes the next character (even one: 'a\\')
            escaped = False
        elif quote:
            escaped, quote = char == "\\", "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth < 0:
                raise PipelineError(f"unbalanced {char!r} at column {i} of {text!r}")
        elif char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise PipelineError(f"unbalanced brackets or quotes in {text!r}")
    parts.append(text[start:])
    return parts


def _operator(dotted: str) -> Any:
    """The operator (or ``torch.<dtype>``) a dotted name names."""
    parts = dotted.split(".")
    if len(parts) == 2 and parts[0] == "torch" and isinstance(getattr(torch, parts[1], None),
                                                              torch.dtype):
        return getattr(torch, parts[1])
    if parts[:2] == ["torch", "ops"]:
        parts = parts[2:]
    value: Any = torch.ops
    try:
        for part in parts:
            value = getattr(value, part)
    except (AttributeError, RuntimeError) as e:
        raise PipelineError(f"{dotted!r} names no operator: {e}") from e
    if not isinstance(value, _OPERATORS):
        raise PipelineError(f"{dotted!r} is not an operator (got {type(value).__name__})")
    return value


_NAMES = {"true": True, "false": False, "True": True, "False": False, "None": None, "none": None,
          "inf": math.inf, "nan": math.nan}


def _enums(cls: type) -> dict[str, type[enum.Enum]]:
    """The Enum classes a pass class's fields are annotated with (also inside ``X | None``,
    ``tuple[X, ...]``), by name: the members its pipeline text may name."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation naming what its module lacks: none known
        return {}
    found, todo = {}, list(hints.values())
    while todo:
        hint = todo.pop()
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            found[hint.__name__] = hint
        todo += typing.get_args(hint)
    return found


class _Names(ast.NodeTransformer):
    """true/false/none, inf/nan, dtypes, operator names, ``frozenset({...})`` and members of
    ``enums`` as the constants they stand for (the rest is left to ``ast.literal_eval``,
    which reads Python literals and refuses anything else)."""

    def __init__(self, enums: dict[str, type[enum.Enum]]):
        self.enums = enums

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(_NAMES[node.id]) if node.id in _NAMES else node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        owner, member = ast.unparse(node.value), node.attr
        if owner in self.enums:
            members = self.enums[owner].__members__
            if member not in members:
                raise PipelineError(f"{owner} has no member {member!r}"
                                    f"{did_you_mean(member, list(members))}; its members: "
                                    f"{', '.join(members)}")
            return ast.Constant(members[member])
        return ast.Constant(_operator(ast.unparse(node)))

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if (isinstance(node.func, ast.Name) and node.func.id == "frozenset" and not node.keywords
                and len(node.args) <= 1):
            items = ast.literal_eval(self.visit(node.args[0])) if node.args else ()
            return ast.Constant(frozenset(items))
        return node  # refused by literal_eval


def _parse_value(text: str, enums: dict[str, type[enum.Enum]]) -> Any:
    """An option's value; ``enums``: the Enum classes (by name) its members may come from."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise PipelineError(f"option value {text!r} does not parse: {e.msg}") from e
    try:
        return ast.literal_eval(_Names(enums).visit(tree))
    except (ValueError, TypeError) as e:  # TypeError: an unhashable dict key or set item
        raise PipelineError(f"option value {text!r}: expected a Python literal, true/false, "
                            "inf/nan, a dtype, an operator name, a frozenset or a member of "
                            f"an Enum the pass's fields are annotated with "
                            f"({', '.join(enums) or 'none'})") from e


def _pass_class(name: str) -> type:
    """The one live pass class named ``name``; two live classes of one name are ambiguous."""
    def named(collect: bool) -> list[type]:
        return [cls for cls in registered_passes(collect=collect) if cls.__name__ == name]

    found = named(collect=False)
    if len(found) > 1:
        found.clear()  # its references would keep the dead classes alive
        found = named(collect=True)
    if len(found) == 1:
        return found[0]
    if found:
        where = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in found)
        raise PipelineError(f"pass name {name!r} is ambiguous: {where}")
    known = sorted({c.__name__ for c in registered_passes()})
    raise PipelineError(
        f"no registered pass is named {name!r}{did_you_mean(name, known)} (import the module "
        f"that defines it); known: {', '.join(known)}"
    )


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """`` (did you mean 'X'?)`` for the one of ``known`` closest to a misspelt ``name``, or
    "" when none is close."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _option_kind(annotation: Any) -> tuple[type | None, bool]:
    """The bool, int, float or str an option is annotated with (None: another type), and
    whether it may be None too (``int | None``, ``Optional[int]``); the annotation may be
    the type or its text (``from __future__ import annotations``)."""
    if isinstance(annotation, str):
        inner = annotation.removeprefix("Optional[").removesuffix("]")
        parts = [part.strip() for part in inner.split("|")]
        optional = inner != annotation or "None" in parts
    else:
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        parts = [a.__name__ for a in typing.get_args(annotation)] if union else [
            getattr(annotation, "__name__", None)]
        optional = "NoneType" in parts
    named = [part for part in parts if part not in ("None", "NoneType")]
    return next((t for t in (bool, int, float, str) if named == [t.__name__]), None), optional


def _parse_pass(text: str) -> Any:
    text = text.strip()
    name, brace, rest = text.partition("{")
    name = name.strip()
    if not name.isidentifier():
        raise PipelineError(f"{text!r} is not a pass name with optional {{options}}")
    options: dict[str, Any] = {}
    if brace:
        if not rest.endswith("}"):
            raise PipelineError(f"{text!r}: options must end with '}}'")
        body = rest[:-1].strip()
        for item in _split(body, ",") if body else []:
            key, equals, value = item.partition("=")
            key = key.strip()
            if not equals or not key.isidentifier():
                raise PipelineError(f"{name}: option {item.strip()!r} is not key=value")
            if key in options:
                raise PipelineError(f"{name}: option {key!r} given twice")
            options[key] = value
    cls = _pass_class(name)  # first: its fields name the Enums a value may be a member of
    enums = _enums(cls) if options else {}
    options = {key: _parse_value(value, enums) for key, value in options.items()}
    if dataclasses.is_dataclass(cls):
        fields = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(options.keys() - set(fields))
        if unknown:
            raise PipelineError(
                f"{name}: no option {unknown[0]!r}{did_you_mean(unknown[0], fields)}; "
                + (f"its options: {', '.join(fields)}" if fields else "it takes no options"))
    for field in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        # An int/float/bool/str option (or one that may be None too) given a value of another
        # type fails here, not deep in the pass.
        kind, optional = _option_kind(field.type)
        value = options.get(field.name, field.default)
        if kind and value is not field.default and not (value is None and optional) and not (
                isinstance(value, bool) == (kind is bool)
                and isinstance(value, (kind, int) if kind is float else kind)):
            raise PipelineError(f"{name}: option {field.name}={value!r}: expected "
                                f"{kind.__name__}{' or None' * optional}, got "
                                f"{type(value).__name__}")
    try:
        return cls(**options)
    except TypeError as e:
        raise PipelineError(f"{name}{{...}}: {e}") from e


def parse_passes(text: str) -> list[Any]:
    """Pipeline text -> pass instances, in the order written."""
    if not text.strip():
        return []
    return [_parse_pass(part) for part in _split(text, ",")]
