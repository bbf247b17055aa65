"""The calibration calls of :func:`~passes.quantization.quantize_program` and
:func:`~passes.quantization.quantize_methods`, checked against the program before anything
is prepared, and run so that a call the prepared program raises on says which call it was.

A wrong calibration input otherwise surfaces as torch's own error from deep inside the
prepared program (``index_copy_(): Expected a long tensor for index``, ``Guard failed:
x.size()[1] == 1``), without the call's index or the input's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, TensorArgument
from torch.fx import Node
from torch.utils import _pytree as pytree

from pass_manager.call_signature import signature_of, tensor_wanted
from pass_manager.validation import Call, call_inputs

from .._analysis.buffers import USER_INPUT, find_mutations
from ..errors import CalibrationInputError, QuantizationInputError

__all__ = ["calibration_calls", "callers_state_restored", "check_calibration_call",
           "described", "keywords_bound", "run_calibration_call", "sequence_of_calls"]


def sequence_of_calls(calls: Any, helper: str, argument: str, example: str) -> list[Any]:
    """``calls`` as a list, or a :class:`QuantizationInputError` of ``helper`` naming
    ``argument`` when it is no sequence of calls: ``None``, a string, a mapping or a tensor
    (iterated, a tensor's rows would each pass for one call) or anything not iterable.
    ``example`` shows the list to pass instead."""
    if isinstance(calls, (torch.Tensor, Mapping)):
        given = described(calls)
    elif isinstance(calls, (str, bytes)) or calls is None or not isinstance(calls, Iterable):
        given = f"{type(calls).__name__} {calls!r:.60}"
    else:
        return list(calls)
    raise QuantizationInputError(helper, argument, f"is {given}, not a sequence of calls: "
                                 f"pass a list with one entry per call, e.g. {example}")


def calibration_calls(program: ExportedProgram, calibration: Any, helper: str) -> list[Call]:
    """``quantize_program``'s ``calibration``, one ``(args, kwargs)`` pair per call, or a
    :class:`QuantizationInputError` (``argument`` ``"calibration"``) when it is no sequence
    of calls or is empty. A tuple of tensors as many as the program's positional inputs
    (more than one) is one call's arguments, not calls: it is refused, saying so."""
    calls = sequence_of_calls(calibration, helper, "calibration", "[(x, pos), ...]")
    if not calls:
        raise QuantizationInputError(helper, "calibration", "needs at least one calibration "
                                     "call: the observers measure nothing otherwise")
    positional = signature_of(program).positional
    if isinstance(calibration, tuple) and len(positional) > 1 and \
            len(calls) == len(positional) and \
            all(isinstance(value, torch.Tensor) for value in calls):
        names = ", ".join(positional)
        raise QuantizationInputError(helper, "calibration", f"is one call's arguments "
                                     f"({names}), not a sequence of calls: pass a list of "
                                     f"calls, e.g. [({names})]")
    return call_inputs(calls)


def _input_name(path: tuple, positional: tuple[str, ...]) -> str:
    """``x``, ``kwargs['cache_position']`` or ``past[0]``: a leaf's place in ``(args, kwargs)``."""
    where, key, *rest = path
    if where.idx == 0:  # a positional argument
        name = positional[key.idx] if key.idx < len(positional) else f"args[{key.idx}]"
    else:
        name = str(key.key)
    return name + pytree.keystr(tuple(rest))


def keywords_bound(positional: tuple[str, ...], args: tuple, kwargs: Mapping[str, Any],
                   ) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the keyword arguments naming positional inputs moved into
    ``args``, as a prepared graph module binds them when it is called: every helper that
    reads a call's inputs by position binds them so, or a cache passed as ``cache=`` is not
    found where the calibration passes it."""
    kwargs = dict(kwargs)
    args = list(args)
    for name in positional[len(args):]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    return tuple(args), kwargs


def _describe(value: torch.Tensor) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"


def described(value: Any, depth: int = 1) -> str:
    """A calibration value in a few words, never its data: ``a Tensor float32[1, 4, 32]``,
    ``a tuple of 2 (Tensor float32[1, 4], Tensor int64[4])``, ``a dict {'x': Tensor
    float32[1, 4]}``. A tensor's repr runs to hundreds of lines in an error message and
    hides what was wrong: its place and kind."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor {_describe(value)}"
    if isinstance(value, (tuple, list, Mapping)) and depth >= 0:
        items = list(value.items()) if isinstance(value, Mapping) else list(value)
        shown = [described(item, depth - 1).removeprefix("a ") if not isinstance(value, Mapping)
                 else f"{item[0]!r}: {described(item[1], depth - 1).removeprefix('a ')}"
                 for item in items[:4]]
        more = ", ..." if len(items) > 4 else ""
        inside = "{" + ", ".join(shown) + more + "}" if isinstance(value, Mapping) \
            else "(" + ", ".join(shown) + more + ")"
        count = f" of {len(items)}" if not isinstance(value, Mapping) else ""
        return f"a {type(value).__name__}{count} {inside}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _constants(program: ExportedProgram) -> list[Any]:
    """The value each user input that is a constant of the call spec (a number or ``None``
    the program was specialized to) was exported with, in the order of :func:`_placeholders`
    (``None`` for a tensor input)."""
    from torch.export.graph_signature import ConstantArgument

    return [spec_.arg.value if isinstance(spec_.arg, ConstantArgument) else None
            for spec_ in program.graph_signature.input_specs
            if spec_.kind == InputKind.USER_INPUT]


def _check_constant(value: Any, constant: Any, helper: str, step: int, name: str,
                    method: str | None) -> None:
    """A number the program was exported with is a constant of it (``torch.export``
    specializes it): another number fails the prepared program's guard (``Guard failed:
    n == 3``) after prepare. Refused before, naming the input and the value."""
    numbers = (bool, int, float)
    if isinstance(value, numbers) and isinstance(constant, numbers) and value != constant:
        raise CalibrationInputError(
            helper, step, f"is {value!r}; the program was exported with the constant "
            f"{constant!r} (torch.export specializes a Python number): pass {constant!r}, or "
            "export with the value as a tensor", input=name, method=method)


def _placeholders(program: ExportedProgram) -> list[Node | None]:
    """The placeholder each user input is bound to, in the call spec's flat order (``None``
    for a constant input such as a ``None`` mask: a leaf of the call spec, no tensor)."""
    by_name = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    return [by_name.get(spec_.arg.name) if isinstance(spec_.arg, TensorArgument) else None
            for spec_ in program.graph_signature.input_specs
            if spec_.kind == InputKind.USER_INPUT]


def check_calibration_call(program: ExportedProgram, args: tuple, kwargs: Mapping[str, Any],
                           helper: str, step: int, method: str | None = None) -> None:
    """Raise :class:`CalibrationInputError` naming the call and the input when
    ``(args, kwargs)`` does not fit ``program``: a keyword naming no input, another
    structure, something other than a tensor (a numpy array, a number) for a tensor input,
    a tensor input of another dtype, a size other than a static size the program was
    exported with (symbolic sizes are the program's guards' to check, when the call runs),
    or another number than one the program was specialized to."""
    signature = signature_of(program)
    args, kwargs = keywords_bound(signature.positional, tuple(args), dict(kwargs))
    unknown = [key for key in kwargs if key not in signature.keywords]
    if signature.spec is not None and unknown:
        # Checked first: a misspelt input's keyword leaves its positional place empty, and
        # "it gives 1 positional argument" would hide which name was wrong.
        inputs = ", ".join(map(repr, [*signature.positional, *signature.keywords]))
        raise CalibrationInputError(
            helper, step, f"the program takes no input named "
            f"{', '.join(map(repr, unknown))}; its inputs are {inputs}", method=method)
    mismatch = signature.mismatch(args, kwargs)
    if mismatch is not None:
        raise CalibrationInputError(helper, step, mismatch, method=method)
    leaves = signature.leaves(args, kwargs)
    for (path, value), node, constant in zip(leaves, _placeholders(program),
                                             _constants(program), strict=True):
        name = _input_name(path, signature.positional)
        if node is None:  # a constant input (None, a number): no placeholder to check
            _check_constant(value, constant, helper, step, name, method)
            continue
        expected = node.meta.get("val")
        if isinstance(expected, torch.Tensor) and not isinstance(value, torch.Tensor):
            raise CalibrationInputError(
                helper, step, f"{tensor_wanted(value)}; the program was exported with a "
                f"tensor there ({_describe(expected)})", input=name, method=method)
        if not isinstance(value, torch.Tensor) or not isinstance(expected, torch.Tensor):
            continue
        if value.dtype != expected.dtype:
            raise CalibrationInputError(
                helper, step, f"is {_describe(value)}; the program was exported with "
                f"{str(expected.dtype).removeprefix('torch.')}: pass that dtype",
                input=name, method=method)
        static = [size if isinstance(size, int) else None for size in expected.shape]
        if value.dim() != len(static) or any(
                want is not None and got != want for got, want in zip(value.shape, static,
                                                                      strict=True)):
            shape = ", ".join("*" if size is None else str(size) for size in static)
            raise CalibrationInputError(
                helper, step, f"is {_describe(value)}; the program was exported for shape "
                f"[{shape}] (* a dynamic size)", input=name, method=method)


def run_calibration_call(call: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any],
                         helper: str, step: int, method: str | None = None) -> Any:
    """``call(*args, **kwargs)``; an error it raises becomes a :class:`CalibrationInputError`
    naming the call, chained to the original."""
    try:
        return call(*args, **kwargs)
    except CalibrationInputError:
        raise
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CalibrationInputError(
            helper, step, f"the prepared program raised {type(error).__name__}: {first}",
            method=method) from error


@contextmanager
def callers_state_restored(programs: Mapping[str, ExportedProgram],
                           calls: Iterable[tuple[str, tuple, Mapping[str, Any]]],
                           ) -> Iterator[None]:
    """Calibration leaves the caller's tensors as it found them: each tensor a call
    ``(method, args, kwargs)`` passes for an input its program writes in place (a cache or
    a position the caller carries) is put back, bit for bit, when the block ends, as
    :func:`passes.reset_mutable_buffers` puts back the buffers. A tensor several calls pass
    is saved once, before the first of them: the calls inside still thread it, as
    deployment does."""
    written = {method: {state.name for state in find_mutations(program).writers
                        if state.kind == USER_INPUT} for method, program in programs.items()}
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for method, args, kwargs in calls:
        if not written[method]:
            continue
        signature = signature_of(programs[method])
        args, kwargs = keywords_bound(signature.positional, tuple(args), dict(kwargs))
        for (_, value), node in zip(signature.leaves(args, kwargs),
                                    _placeholders(programs[method]), strict=True):
            if node is not None and node.name in written[method] \
                    and isinstance(value, torch.Tensor):
                saved.setdefault(id(value), (value, value.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in saved.values():
                tensor.copy_(value)
