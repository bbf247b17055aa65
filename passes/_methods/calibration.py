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

from .._analysis.buffers import USER_INPUT, find_mutations
from ..errors import CalibrationInputError

__all__ = ["callers_state_restored", "check_calibration_call", "keywords_bound",
           "run_calibration_call"]


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
    ``(args, kwargs)`` does not fit ``program``: another structure, a tensor input of
    another dtype, or a size other than a static size the program was exported with
    (symbolic sizes are the program's guards' to check, when the call runs)."""
    signature = signature_of(program)
    args, kwargs = keywords_bound(signature.positional, tuple(args), dict(kwargs))
    mismatch = signature.mismatch(args, kwargs)
    if mismatch is not None:
        raise CalibrationInputError(helper, step, mismatch, method=method)
    leaves = signature.leaves(args, kwargs)
    for (path, value), node in zip(leaves, _placeholders(program), strict=True):
        if node is None:  # a constant input (None, a number): no placeholder to check
            continue
        expected = node.meta.get("val")
        if not isinstance(expected, torch.Tensor):
            continue
        name = _input_name(path, signature.positional)
        if not isinstance(value, torch.Tensor):  # a NumPy array: refused deep in the call
            raise CalibrationInputError(
                helper, step, f"{tensor_wanted(value)}; the program was exported with a "
                f"tensor there ({_describe(expected)})", input=name, method=method)
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
