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
such a call, calibrating on nothing. A smaller finite mask does the same to an 8-bit grid:
``(1 - mask) * -10000.0`` (older Hugging Face models) gives the scores it is added to a step
of ~39, and a masked decode was as far from eager (0.41) as under ``finfo.min``; ``-1000``:
0.13, ``-100``: 0.04, against 0.009 unmasked. So a value is also recorded when it splits
into two clusters far apart and the wider spans fewer than :data:`FEW_STEPS` steps of its
observer's grid (:func:`stretched_grid`). All are silent: this records them while the
calibration calls run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.fx import GraphModule, Node

__all__ = ["EXTREME", "FEW_STEPS", "NON_FINITE_MEANING", "beyond_any_grid",
           "non_finite_observations", "stretched_grid"]

EXTREME = float(torch.finfo(torch.float16).max)
"""65504: float16's largest value. A magnitude at or past it is an "infinity" written as a
number (a float32 or bfloat16 ``finfo.min`` mask, ``-1e9``); ``QnnQuantizer`` treats the same
bound as infinite. Activations of a float16 model never exceed it."""

NON_FINITE_MEANING = ("a quantization grid is finite and evenly spaced, so the quantized "
                      "program reads another value there (a -inf attention mask no longer "
                      "masks), and a value at +-65504 or beyond stretches the grid so far "
                      "that the tensor's other values read 0 (a finfo.min mask flattens the "
                      "scores it masks), as a smaller one does where the rest of the values "
                      "fall within a step or two of its grid (a -10000 mask on an 8-bit grid)")
"""What a recorded line means, said once wherever the lines are shown."""

FEW_STEPS = 2
"""A value whose clusters each span fewer grid steps than this reads at most three values
there: it has lost what it held to the gap between them. Masked scores under ``-10000``
spread over 0.075 steps (a decode 0.41 from eager, as under ``finfo.min``), under ``-1000``
0.75 (0.13); under ``-100`` 7.5 (0.04: an outlier's usual cost, as a small embedding's
values, spread over 11, bear it), under ``-30`` 23 (0.013, against 0.009 unmasked)."""


def beyond_any_grid(value: torch.Tensor | float) -> bool:
    """Whether ``value`` (a float tensor's elements, or a number) holds inf, NaN or a
    magnitude of :data:`EXTREME` or more: no 8- or 16-bit grid over it keeps the rest."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.numel() == 0:
            return False
        return not bool(torch.isfinite(value).all()) or \
            bool((value.abs() >= EXTREME).any())
    return isinstance(value, float) and (not math.isfinite(value) or abs(value) >= EXTREME)


def clusters(value: torch.Tensor) -> tuple[float, float, float] | None:
    """``(low, high, wider)``: ``value``'s range and how far the wider of its two clusters
    (its values below and above the middle of that range) spreads; ``None`` for a value
    with no two clusters."""
    value = value.detach().float()
    low, high = float(value.min()), float(value.max())
    middle = (low + high) / 2
    below, above = value[value <= middle], value[value > middle]
    if not below.numel() or not above.numel():
        return None
    return low, high, max(float(below.max()) - low, high - float(above.min()))


def stretched_grid(low: float, high: float, wider: float, observer: torch.nn.Module,
                   ) -> str | None:
    """Where ``observer`` quantizes per tensor on a grid over ``[low, high]`` and the wider
    cluster of the values it saw (:func:`clusters`, the widest any call had) spans fewer
    than :data:`FEW_STEPS` of that grid's steps (a score plus a ``-10000`` mask: the scores
    read one value): ``"-1e+04, its other values within 0.15 of the grid's 255 steps"``.
    ``None`` otherwise, and for clusters of one value each (a 0/-10000 mask itself is on
    its grid exactly), a per-channel or dynamic observer."""
    quant_min, quant_max = getattr(observer, "quant_min", None), getattr(observer, "quant_max",
                                                                           None)
    scheme = getattr(observer, "qscheme", None)
    if (quant_min is None or quant_max is None or wider == 0
            or scheme not in (torch.per_tensor_affine, torch.per_tensor_symmetric)
            or getattr(observer, "is_dynamic", False)):
        return None
    if scheme == torch.per_tensor_symmetric:
        span = 2 * max(abs(low), abs(high))
    else:
        span = max(high, 0.0) - min(low, 0.0)  # pt2e's grids hold 0
    step = span / (quant_max - quant_min)
    if wider >= FEW_STEPS * step:
        return None
    far = low if abs(low) >= abs(high) else high
    return (f"{far:.3g}, its other values within {wider / step:.2g} of the grid's "
            f"{quant_max - quant_min} steps")


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
def non_finite_observations(prepared: GraphModule | Mapping[str, GraphModule], call: list[str],
                            ) -> Iterator[list[str]]:
    """While the block calibrates ``prepared`` (from ``prepare_pt2e``), each observer's input
    holding inf, NaN or a value at ±:data:`EXTREME` or beyond is recorded once, as a line
    naming the value, what it held and the call (``call[0]``, set by the caller before each
    calibration call, e.g. ``"calibration[0]"``); when the block ends, each whose grid the
    calls stretched (:func:`stretched_grid`) is, naming the call that stretched it most.
    Yields that list of lines; the hooks are gone after the block.

    ``prepared`` may be the methods of one model by name (:func:`~passes.quantization.
    quantize_methods`, whose methods may share an observer): ``call[1]`` then names the
    method being called, only its observers record, and each line starts
    ``"method 'decode': "``."""
    from torchao.quantization.pt2e.observer import _is_activation_post_process

    methods = dict(prepared) if isinstance(prepared, Mapping) else {None: prepared}
    found: list[str] = []
    seen: set[tuple[str | None, str]] = set()
    spread: dict[tuple[str | None, str], list[Any]] = {}  # low, high, wider, call, observer
    handles = []
    for method, module in methods.items():
        for node in module.graph.find_nodes(op="call_module"):
            observer = module.get_submodule(node.target)
            if not (_is_activation_post_process(observer) and isinstance(node.args[0], Node)):
                continue
            where = (f"method {method!r}: " if method is not None else "") + \
                _observed(module, node.args[0])
            key = (method, where)

            def record(observer, inputs, key=key, method=method) -> None:
                value = inputs[0] if inputs else None
                if (key in seen or not isinstance(value, torch.Tensor)
                        or not value.is_floating_point() or value.numel() == 0
                        or (method is not None and call[1] != method)):
                    return
                if beyond_any_grid(value):
                    seen.add(key)
                    found.append(f"{key[1]} held {_kind(value)} at {call[0]}")
                    return
                this = clusters(value)
                if this is None:
                    return
                low, high, wider = this
                so_far = spread.setdefault(key, [low, high, 0.0, call[0], observer])
                if high - low > so_far[1] - so_far[0]:
                    so_far[3] = call[0]
                so_far[0], so_far[1] = min(so_far[0], low), max(so_far[1], high)
                so_far[2] = max(so_far[2], wider)

            handles.append(observer.register_forward_pre_hook(record))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
        for key, (low, high, wider, at, observer) in spread.items():
            held = None if key in seen else stretched_grid(low, high, wider, observer)
            if held is not None:
                found.append(f"{key[1]} held {held} at {at}")
