"""The pieces of :func:`passes.quantization.quantize_methods` that are about methods, not
quantization: the calls it calibrates along, one set of buffer tensors for all the methods,
and what it returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from pass_manager import Report

from .._analysis.buffers import BUFFER, buffer_tensor, replace_buffer_tensor
from .._analysis.marked_state import mutable_buffers
from ..errors import QuantizationInputError

__all__ = ["MethodCall", "QuantizedMethods", "method_calls", "share_buffer_tensors"]

MethodCall = tuple[str, tuple, dict]


def method_calls(programs: Mapping[str, Any], calls: Iterable[Any], where: str,
                 ) -> list[MethodCall]:
    """``calls`` as ``(method, args, kwargs)`` triples, checked against ``programs``: each
    names a method, and every method is called at least once (its own observers would
    measure nothing otherwise)."""
    found = []
    for index, call in enumerate(calls):
        if not isinstance(call, (tuple, list)) or len(call) not in (2, 3):
            raise QuantizationInputError(
                where, f"calls[{index}]", f"is {type(call).__name__} {call!r:.80}; each call "
                "is (method, args) or (method, args, kwargs), e.g. ('decode', (x, pos), {})")
        method, args, kwargs = (*call, {}) if len(call) == 2 else call
        if method not in programs:
            raise QuantizationInputError(
                where, f"calls[{index}]", f"names method {method!r}; the methods are "
                f"{', '.join(map(repr, programs))}")
        if not isinstance(args, tuple):
            args = tuple(args) if isinstance(args, list) else (args,)
        if not isinstance(kwargs, Mapping):
            raise QuantizationInputError(
                where, f"calls[{index}]", f"kwargs is a {type(kwargs).__name__}, not a mapping")
        found.append((method, args, dict(kwargs)))
    uncalled = [name for name in programs if name not in {m for m, _, _ in found}]
    if uncalled:
        raise QuantizationInputError(where, "calls", "no calibration call for method(s) "
                         f"{', '.join(map(repr, uncalled))}: every method needs at least one, "
                         "or the observers only it has measure nothing")
    return found


def share_buffer_tensors(programs: Mapping[str, Any]) -> dict[str, list[str]]:
    """Make each mutable buffer one tensor object in every method holding it (the first
    method's), so that running the methods in turn runs them on one state; returns, per
    buffer, the methods sharing it. The methods must already agree on its shape, dtype and
    value (``pass_manager.check_shared_buffers``)."""
    shared: dict[str, list[str]] = {}
    first: dict[str, torch.Tensor] = {}
    for name, program in programs.items():
        for fqn, info in mutable_buffers(program).items():
            if info.kind != BUFFER:
                continue
            shared.setdefault(fqn, []).append(name)
            tensor = buffer_tensor(program, fqn)
            if fqn not in first:
                first[fqn] = tensor
            elif tensor is not first[fqn]:
                replace_buffer_tensor(program, fqn, first[fqn])
    return {fqn: names for fqn, names in shared.items() if len(names) > 1}


class QuantizedMethods(dict):
    """The quantized methods by name (a plain ``dict`` of ExportedPrograms, in the order
    given, ready for ``to_edge_transform_and_lower``), sharing their buffer tensors.

    Attributes:
        reports: per method, the run report of each stage: ``"transform"`` and
            ``"after_annotate"`` (the PassQuantizer pipelines), ``"unfreeze"``
            (UnfreezeMutableBuffer after convert_pt2e) and, with ``quantize_state=True``,
            ``"quantize_state"`` (QuantizeMutableBuffers).
        shared_buffers: per buffer more than one method holds, those methods.
        observers: per shared buffer, how many observer instances (over all methods) were
            made its one observer.
    """

    def __init__(self, programs: Mapping[str, Any], reports: dict[str, dict[str, Report]],
                 shared_buffers: dict[str, list[str]], observers: dict[str, int]):
        super().__init__(programs)
        self.reports = reports
        self.shared_buffers = shared_buffers
        self.observers = observers

    def __repr__(self) -> str:
        return (f"QuantizedMethods({', '.join(self)}; shared buffers: "
                f"{', '.join(self.shared_buffers) or 'none'})")
