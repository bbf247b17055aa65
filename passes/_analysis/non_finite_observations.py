"""Which quantized values held inf or NaN while they were calibrated.

A quantization grid holds finite numbers only: an observed ``-inf`` (an attention mask kept
as a buffer, ``masked_fill(..., -inf)``) becomes a finite value (or NaN) once quantized, and
the quantized program computes something else there (a mask that no longer masks), while
every comparison of two quantized flows that both did so agrees. MinMaxObserver turns the
infinite range into an infinite scale; HistogramObserver ignores such a call, calibrating
on nothing. Both are silent: this records them while the calibration calls run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.fx import GraphModule, Node

__all__ = ["NON_FINITE_MEANING", "non_finite_observations"]

NON_FINITE_MEANING = ("a quantization grid is finite, so the quantized program reads another "
                      "value there (a -inf attention mask no longer masks)")
"""What a recorded line means, said once wherever the lines are shown."""


def _kind(value: torch.Tensor) -> str:
    kinds = [name for name, found in (("-inf", torch.isneginf(value)),
                                      ("inf", torch.isposinf(value)),
                                      ("NaN", torch.isnan(value))) if bool(found.any())]
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
    holding inf or NaN is recorded once, as a line naming the value, what it held and the
    call (``call[0]``, set by the caller before each calibration call, e.g. ``"calibration[0]"``).
    Yields that list of lines; the hooks are gone after the block."""
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
                    or not value.is_floating_point() or bool(torch.isfinite(value).all())):
                return
            seen.add(observed.name)
            found.append(f"{_observed(prepared, observed)} held {_kind(value)} at {call[0]}")

        handles.append(observer.register_forward_pre_hook(record))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
