"""Which quantized values held inf, NaN or a number at a float's extreme while they were
calibrated.

A quantization grid holds finite numbers only, evenly spaced: an observed ``-inf`` (an
attention mask kept as a buffer, ``masked_fill(..., -inf)``) becomes a finite value (or
NaN) once quantized, and the quantized program computes something else there (a mask that
no longer masks). A finite value at a float's extreme (``torch.finfo(torch.float32).min``,
the mask Hugging Face's models build, or ``-1e9``) stretches the grid over it: its step is
then ~1e36 and every other value of that tensor reads 0 (the scores under the mask flatten,
the attention averages). Every comparison of two quantized flows that both did so agrees.
MinMaxObserver turns an infinite range into an infinite scale; HistogramObserver ignores
such a call, calibrating on nothing. All are silent: this records them while the
calibration calls run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.fx import GraphModule, Node

__all__ = ["EXTREME", "NON_FINITE_MEANING", "beyond_any_grid", "non_finite_observations"]

EXTREME = float(torch.finfo(torch.float16).max)
"""65504: float16's largest value. A magnitude at or past it is an "infinity" written as a
number (a float32 or bfloat16 ``finfo.min`` mask, ``-1e9``); ``QnnQuantizer`` treats the same
bound as infinite. Activations of a float16 model never exceed it."""

NON_FINITE_MEANING = ("a quantization grid is finite and evenly spaced, so the quantized "
                      "program reads another value there (a -inf attention mask no longer "
                      "masks), and a value at +-65504 or beyond stretches the grid so far "
                      "that the tensor's other values read 0 (a finfo.min mask flattens the "
                      "scores it masks)")
"""What a recorded line means, said once wherever the lines are shown."""


def beyond_any_grid(value: torch.Tensor | float) -> bool:
    """Whether ``value`` (a float tensor's elements, or a number) holds inf, NaN or a
    magnitude of :data:`EXTREME` or more: no 8- or 16-bit grid over it keeps the rest."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.numel() == 0:
            return False
        return not bool(torch.isfinite(value).all()) or \
            bool((value.abs() >= EXTREME).any())
    return isinstance(value, float) and (not math.isfinite(value) or abs(value) >= EXTREME)


def _kind(value: torch.Tensor) -> str:
    kinds = [name for name, found in (("-inf", torch.isneginf(value)),
                                      ("inf", torch.isposinf(value)),
                                      ("NaN", torch.isnan(value))) if bool(found.any())]
    finite = value[torch.isfinite(value)]
    if finite.numel() and bool((finite.abs() >= EXTREME).any()):
        extreme = finite[finite.abs().argmax()]
        kinds.append(f"{float(extreme):.3g}")
    return " and ".join(kinds)


def _observed(prepared: GraphModule, node: Node) -> str:
    """``'mask' (buffer 'mask')``: the value an observer reads, as the user knows it."""
    if node.op == "get_attr":
        return f"{node.name!r} (buffer or constant {node.target!r})"
    if node.op == "placeholder":
        return f"input {node.name!r}"
    return repr(node.name)


@contextmanager
def non_finite_observations(prepared: GraphModule, call: list[str]) -> Iterator[list[str]]:
    """While the block calibrates ``prepared`` (from ``prepare_pt2e``), each observer's input
    holding inf, NaN or a value at ±:data:`EXTREME` or beyond is recorded once, as a line
    naming the value, what it held and the call (``call[0]``, set by the caller before each
    calibration call, e.g. ``"calibration[0]"``). Yields that list of lines; the hooks are
    gone after the block."""
    from torchao.quantization.pt2e.observer import _is_activation_post_process

    found: list[str] = []
    seen: set[str] = set()
    handles = []
    for node in prepared.graph.find_nodes(op="call_module"):
        observer = prepared.get_submodule(node.target)
        if not (_is_activation_post_process(observer) and isinstance(node.args[0], Node)):
            continue
        observed = node.args[0]

        def record(_module, inputs, observed=observed) -> None:
            value = inputs[0] if inputs else None
            if (observed.name in seen or not isinstance(value, torch.Tensor)
                    or not beyond_any_grid(value)):
                return
            seen.add(observed.name)
            found.append(f"{_observed(prepared, observed)} held {_kind(value)} at {call[0]}")

        handles.append(observer.register_forward_pre_hook(record))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
