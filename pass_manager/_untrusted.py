"""What a file from someone else may hold for this library to read it without trust.

``torch.load(weights_only=True)`` runs no code (:func:`plain_data` says what it rebuilds);
``torch.export.load`` is not safe by itself: it unpickles, ``sympify``-s (evals) shape
expressions, and fx turns names into Python source it executes. So
:func:`archive_refusals` checks the archive holds only what ``save_program`` writes, with
no string that could become code, before torch reads it; :func:`graph_refusals` checks the
loaded graphs call only operators and export's own Python functions; and a replay imports
only :func:`library_module` s.
"""

from __future__ import annotations

import collections
import io
import json
import math
import operator
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.utils._sympy.functions as sympy_functions
from torch._export.serde.serialize import _SYM_OPS
from torch._export.verifier import Verifier
from torch.export import ExportedProgram
from torch.export.pt2_archive import PT2ArchiveReader
from torch.export.pt2_archive import constants as pt2

__all__ = ["LIBRARY_PACKAGES", "archive_refusals", "graph_refusals", "library_module", "plain_data"]

MODEL = "model"  # torch.export.save's name for its one program
# The packages of this distribution (setup.cfg): a replay imports their modules untrusted.
LIBRARY_PACKAGES = ("pass_manager", "passes")

_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_data(value: Any, _seen: frozenset[int] = frozenset()) -> bool:
    """Whether ``torch.load(weights_only=True)`` rebuilds ``value`` as it is: None, bools,
    numbers, strings, bytes, dtypes, devices, dense tensors and parameters (no subclass,
    fake or quantized tensor; attributes set on them plain too), and lists, tuples and
    dicts of those (exact types: a namedtuple or dataclass is not plain)."""
    kind = type(value)
    if kind in _PLAIN_LEAVES or kind is torch.Size:
        return True
    if id(value) in _seen:
        return False  # a cycle
    seen = _seen | {id(value)}
    if kind in _PLAIN_TENSORS:
        return (value.layout == torch.strided and not value.is_quantized
                and type(value.data) is torch.Tensor and plain_data(value.__dict__, seen))
    if kind in (list, tuple):
        return all(plain_data(v, seen) for v in value)
    if kind in (dict, collections.OrderedDict):
        return all(type(k) in (str, int) and plain_data(v, seen) for k, v in value.items())
    return False


# Entries torch.export.save writes for one program whose tensors are all plain.
_FIXED_ENTRIES = frozenset({
    pt2.ARCHIVE_FORMAT_PATH, pt2.ARCHIVE_VERSION_PATH, ".data/version",
    ".data/serialization_id", "byteorder", pt2.MODELS_FILENAME_FORMAT.format(MODEL),
    pt2.WEIGHTS_CONFIG_FILENAME_FORMAT.format(MODEL),
    pt2.CONSTANTS_CONFIG_FILENAME_FORMAT.format(MODEL),
    pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(MODEL),
})
_PAYLOADS = {
    pt2.WEIGHTS_CONFIG_FILENAME_FORMAT.format(MODEL):
        re.compile(re.escape(pt2.WEIGHT_FILENAME_PREFIX) + r"\d+"),
    pt2.CONSTANTS_CONFIG_FILENAME_FORMAT.format(MODEL):
        re.compile(re.escape(pt2.TENSOR_CONSTANT_FILENAME_PREFIX) + r"\d+"),
}
_DATA_ENTRY = re.compile(
    "(?:" + re.escape(pt2.WEIGHTS_DIR + pt2.WEIGHT_FILENAME_PREFIX) + "|"
    + re.escape(pt2.CONSTANTS_DIR + pt2.TENSOR_CONSTANT_FILENAME_PREFIX) + r")\d+")

# Strings of the program's JSON that never become code: node metadata (stack traces,
# module stacks; fx prints them only in readable listings) and string constants (written
# as literals). A pytree spec is JSON in a string, its dict keys JSON in a string again:
# the keys of the inputs' spec become keyword names in ``ep.module()``'s generated code.
_FREE_TEXT_KEYS = frozenset({"metadata", "as_string", "as_strings"})
_SPEC_KEYS = frozenset({"in_spec", "out_spec", "context"})
# Every other string: an identifier, a dotted path (a fully-qualified name, an operator),
# or a number torch writes as text ("-Infinity").
_TOKEN = re.compile(r"[A-Za-z0-9_.+\-]*", re.ASCII)
_SYMBOL = re.compile(r"[a-z]+[0-9]+", re.ASCII)
# What str() of a shape expression holds: torch's and sympy's math functions, and symbols
# with their assumptions (``Symbol('s77', positive=True, integer=True)``).
_SYMPY_NAMES = frozenset(
    {name for name, value in vars(sympy_functions).items()
     if isinstance(value, type) and issubclass(value, sympy.Basic)}
    | {"Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Abs", "Mod",
       "floor", "ceiling", "sqrt", "Piecewise", "ITE", "Integer", "Rational", "Float", "oo",
       "zoo", "nan", "pi", "E", "true", "false", "True", "False", "Symbol", "Add", "Mul",
       "Pow", "Equality", "Unequality", "LessThan", "StrictLessThan", "GreaterThan",
       "StrictGreaterThan", "BooleanTrue", "BooleanFalse", "Infinity", "NegativeInfinity",
       "NaN", "Zero", "One", "NegativeOne", "Half"}
    | {"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
       "infinite", "zero", "nonzero", "even", "odd", "rational", "extended_real",
       "commutative"}
)
_SYMPY_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<symbol>'[a-z]+[0-9]+'|\"[a-z]+[0-9]+\")|\*\*|//|<=|>=|==|!=|[-+*/%<>(),&|~=])",
    re.ASCII)


def _safe_expression(text: str) -> bool:
    """Numbers, shape symbols (``s0``, ``u1``, quoted as a ``Symbol``'s name), arithmetic,
    sympy's math functions and assumption keywords only: no attribute, subscript, other
    string or other name ``sympify`` could evaluate."""
    position = 0
    while position < len(text):
        token = _SYMPY_TOKEN.match(text, position)
        if token is None or token.end() == position:
            return not text[position:].strip()
        name = token.group("name")
        if name is not None and not (_SYMBOL.fullmatch(name) or name in _SYMPY_NAMES):
            return False
        position = token.end()
    return True


def _code_strings(value: Any, path: str) -> Iterator[str]:
    """The places in the program's JSON holding a string that could become code."""
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}"
            if not _TOKEN.fullmatch(str(key)):
                yield f"{path}: key {str(key)[:80]!r}"
            elif key in _FREE_TEXT_KEYS:
                continue
            elif key == "expr_str":
                if not (isinstance(item, str) and _safe_expression(item)):
                    yield f"{where}: symbolic expression {str(item)[:80]!r}"
            elif key in _SPEC_KEYS and isinstance(item, str):
                try:
                    parsed = json.loads(item)
                except ValueError:
                    yield f"{where}: {item[:80]!r} is not JSON"
                else:
                    yield from _code_strings(parsed, where)
            else:
                yield from _code_strings(item, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _code_strings(item, f"{path}[{i}]")
    elif isinstance(value, str) and not _TOKEN.fullmatch(value):
        yield f"{path}: {value[:80]!r}"


def archive_refusals(path: str | Path) -> list[str]:
    """Why the ``torch.export.save`` archive at ``path`` is not read without trust ([] if
    it is)."""
    try:
        with PT2ArchiveReader(str(path)) as reader:
            return _refusals(reader)
    except Exception as e:  # noqa: BLE001 - what cannot be checked is not read untrusted
        return [f"it cannot be checked as a torch.export archive ({type(e).__name__}: {e})"]


def _refusals(reader: PT2ArchiveReader) -> list[str]:
    names = set(reader.get_file_names())
    refusals = [f"it holds entry {name!r}, which save_program does not write (pickled "
                "objects, compiled code or files of another tool)"
                for name in sorted(names - _FIXED_ENTRIES) if not _DATA_ENTRY.fullmatch(name)]
    missing = sorted(_FIXED_ENTRIES - names - {".data/serialization_id", "byteorder"})
    if missing:
        refusals.append(f"it lacks the entries {missing}")
    if refusals:
        return refusals
    for config_name, payload in _PAYLOADS.items():
        config = json.loads(reader.read_string(config_name)).get("config", {})
        for fqn, entry in config.items():
            if entry.get("use_pickle") or not payload.fullmatch(str(entry.get("path_name"))):
                refusals.append(f"tensor {fqn!r} is stored as a pickle ({config_name})")
    try:
        torch.load(io.BytesIO(reader.read_bytes(pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(MODEL))),
                   weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.export.load would retry with weights_only=False
        refusals.append(f"its example inputs do not load with weights_only=True ({e})")
    program = json.loads(reader.read_string(pt2.MODELS_FILENAME_FORMAT.format(MODEL)))
    refusals += [f"the graph holds a string that could become code at {where}"
                 for where in _code_strings(program, "program")]
    return refusals


# The Python functions export writes: those torch's verifier and serializer list, and a few more.
_PYTHON_TARGETS = frozenset([
    *Verifier().allowed_builtin_ops(), *_SYM_OPS, operator.xor, operator.invert, math.sqrt,
    torch.sym_sum, torch._assert, torch._C._set_grad_enabled,
    torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast])
_OPERATORS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)


def graph_refusals(ep: ExportedProgram) -> list[str]:
    """Why a loaded program would run code the file chose, were it run ([] if it would not)."""
    refusals = []
    for path, module in ep.graph_module.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            refusals.append(f"submodule {path!r} is a {type(module).__name__}, not a graph")
            continue
        for node in module.graph.nodes:
            where = f"node {node.name}" + (f" of {path}" if path else "")
            if node.op == "call_function":
                if not (isinstance(node.target, _OPERATORS) or node.target in _PYTHON_TARGETS):
                    refusals.append(f"{where} calls {node.target!r}, not an operator")
            elif node.op not in ("placeholder", "get_attr", "output"):
                refusals.append(f"{where} is a {node.op} node")
    return refusals


def library_module(name: str) -> bool:
    """Whether ``name`` is a module of this library's own packages."""
    return any(name == package or name.startswith(f"{package}.") for package in LIBRARY_PACKAGES)
