"""State of other shapes and write forms, carried through the call signature: each model
takes its state as an input and writes it in place, or returns its next value.

Each entry of :data:`CASES` is a :class:`Case`: the model, fresh example inputs, the
``InputsToBuffers`` options its state needs (``next_values`` for returned state), and how
eager threads its state between calls (``thread``: the next call's inputs from this call's
inputs and outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.models.hf import seeded

__all__ = ["CASES", "Case", "state_of", "stateless"]

DIM, LENGTH = 4, 6


def _linear(seed: int) -> torch.nn.Linear:
    return seeded(lambda: torch.nn.Linear(DIM, DIM), seed)


class ShiftingWindow(torch.nn.Module):
    """A sliding window written in place: shift left by one, the new column last."""

    def __init__(self):
        super().__init__()
        self.proj = _linear(0)

    def forward(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        window[:, :-1] = window[:, 1:].clone()
        window[:, -1] = self.proj(x)
        return window.sum(1) * 0.5


class Counter(torch.nn.Module):
    """An int64 counter input advanced in place; the output scales by it."""

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count.add_(1)
        return x * count


class Scan(torch.nn.Module):
    """SSM-style: ``h = a * h + b(x)`` returned first, ``y = c(h)`` second."""

    def __init__(self):
        super().__init__()
        self.b, self.c = _linear(1), _linear(2)
        self.register_buffer("a", torch.linspace(0.5, 0.9, DIM))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a * h + self.b(x)
        return h, self.c(h).relu()


class TransposedWrite(torch.nn.Module):
    """A ``(LENGTH, DIM)`` cache written through ``cache.t()`` at a position input, and
    through ``narrow``: ``cache.t()[:, pos] = v``; ``cache.narrow(0, 0, 1).mul_(0.5)``."""

    def __init__(self):
        super().__init__()
        self.proj = _linear(3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor
                ) -> torch.Tensor:
        cache.t()[:, pos] = self.proj(x).t()
        cache.narrow(0, 0, 1).mul_(0.5)
        return cache.mean(0)


class TwoStates(torch.nn.Module):
    """Two states in one dict input: a running sum and a decaying maximum."""

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        state["sum"].add_(x)
        state["max"].copy_(torch.maximum(state["max"] * 0.9, x))
        return state["sum"] - state["max"]


class Scalar(torch.nn.Module):
    """A 0-d state input accumulating ``x.sum()``."""

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.add_(x.sum())
        return x * total


class SeenMask(torch.nn.Module):
    """A bool mask state (which features were ever positive) and an int32 hit count."""

    def forward(self, x: torch.Tensor, seen: torch.Tensor, hits: torch.Tensor
                ) -> torch.Tensor:
        seen.logical_or_(x > 0)
        hits.add_(seen.to(torch.int32))
        return torch.where(seen, x, torch.zeros_like(x)) + hits


def stateless(case: Case, inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """``inputs`` without the state: what the resident program is called with."""
    args, _ = inputs
    return tuple(args[i] for i in case.keep), {}


def state_of(case: Case, inputs: tuple[tuple, dict]) -> list[torch.Tensor]:
    """The state leaves of ``inputs``, in :attr:`Case.state`'s order."""
    args, kwargs = inputs
    return [a for i, a in enumerate(args) if i not in case.keep] + torch.utils._pytree.tree_leaves(
        kwargs)


class PassThrough(torch.nn.Module):
    """State paired with an output that returns it unchanged (its next value is itself)."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + h, h


class ReturnedInPlace(torch.nn.Module):
    """An fp16 state written in place and also returned (``h.mul_(0.5).add_(x); return h``)."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h.mul_(0.5).add_(x)
        return h, x * 2


class OneValueTwoStates(torch.nn.Module):
    """Two state inputs whose next value is one output (one value into two states)."""

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        v = a + b * 0.5 + x
        return v * 2, v


class Swap(torch.nn.Module):
    """Two states paired with each other's old value (``return y, b, a``)."""

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x + a - b * 0.5, b, a


class CopyOther(torch.nn.Module):
    """A state written in place with another state's old value, which is then advanced."""

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.copy_(b)
        b.add_(x)
        return a * 2 + b


@dataclass
class Case:
    """One model and how its state is carried.

    Attributes:
        model: builds the eager module.
        inputs: fresh ``(args, kwargs)`` example inputs (the state at its initial value).
        options: InputsToBuffers options.
        state: the buffers the state becomes (in flat input order).
        keep: the positional inputs that are not state (every keyword input is state).
        thread: the next call's ``(args, kwargs)`` from this call's and its outputs (a new
            ``x``; returned state passed back); state written in place stays in the inputs.
    """

    model: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]
    state: tuple[str, ...]
    keep: tuple[int, ...] = (0,)
    options: dict[str, Any] = field(default_factory=dict)
    thread: Callable[[tuple[tuple, dict], Any], tuple[tuple, dict]] | None = None


def _next_x(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x * 3.1 + 0.7)


def _in_place(inputs: tuple[tuple, dict], _: Any) -> tuple[tuple, dict]:
    (x, *rest), kwargs = inputs
    return (_next_x(x), *rest), kwargs


def _scan_thread(inputs: tuple[tuple, dict], out: Any) -> tuple[tuple, dict]:
    (x, _), kwargs = inputs
    return (_next_x(x), out[0]), kwargs


def _pass_through_thread(inputs: tuple[tuple, dict], out: Any) -> tuple[tuple, dict]:
    (x, _), kwargs = inputs
    return (_next_x(x), out[1]), kwargs


def _pair_thread(*outputs: int):
    def thread(inputs: tuple[tuple, dict], out: Any) -> tuple[tuple, dict]:
        (x, *_), kwargs = inputs
        return (_next_x(x), *(out[i] for i in outputs)), kwargs
    return thread


def _transposed_thread(inputs: tuple[tuple, dict], _: Any) -> tuple[tuple, dict]:
    (x, pos, cache), kwargs = inputs
    return (_next_x(x), (pos + 1) % LENGTH, cache), kwargs


CASES: dict[str, Case] = {
    "sliding window": Case(
        ShiftingWindow, lambda: ((torch.randn(1, DIM), torch.zeros(1, LENGTH, DIM)), {}),
        ("window",), thread=_in_place),
    "int64 counter": Case(
        Counter, lambda: ((torch.randn(DIM), torch.tensor([0])), {}), ("count",),
        thread=_in_place),
    "returned scan state": Case(
        Scan, lambda: ((torch.randn(1, DIM), torch.zeros(1, DIM)), {}), ("h",),
        options={"next_values": {"h": "0"}}, thread=_scan_thread),
    "transposed and narrowed write": Case(
        TransposedWrite, lambda: ((torch.randn(1, DIM), torch.tensor([2]),
                                   torch.zeros(LENGTH, DIM)), {}),
        ("cache",), keep=(0, 1), thread=_transposed_thread),
    "two states in one dict": Case(
        TwoStates, lambda: ((torch.randn(DIM),), {"state": {
            "sum": torch.zeros(DIM), "max": torch.full((DIM,), -1.0)}}),
        ("state.sum", "state.max"), thread=_in_place),
    "0-d state": Case(
        Scalar, lambda: ((torch.randn(DIM), torch.tensor(0.0)), {}), ("total",),
        thread=_in_place),
    "bool and int32 masks": Case(
        SeenMask, lambda: ((torch.randn(DIM), torch.zeros(DIM, dtype=torch.bool),
                            torch.zeros(DIM, dtype=torch.int32)), {}),
        ("seen", "hits"), thread=_in_place),
    "pass-through pair": Case(
        PassThrough, lambda: ((torch.randn(DIM), torch.ones(DIM)), {}), ("h",),
        options={"next_values": {"h": "1"}}, thread=_pass_through_thread),
    "fp16 state written in place and returned": Case(
        ReturnedInPlace, lambda: ((torch.randn(DIM).half(), torch.ones(DIM).half()), {}),
        ("h",), options={"next_values": {"h": "0"}}, thread=_in_place),
    "one value into two states": Case(
        OneValueTwoStates, lambda: ((torch.randn(DIM), torch.zeros(DIM), torch.ones(DIM)), {}),
        ("a", "b"), options={"next_values": {"a": "1", "b": "1"}}, thread=_pair_thread(1, 1)),
    "swapped pair": Case(
        Swap, lambda: ((torch.randn(DIM), torch.zeros(DIM), torch.ones(DIM)), {}),
        ("a", "b"), options={"next_values": {"a": "1", "b": "2"}}, thread=_pair_thread(1, 2)),
    "written with another state's old value": Case(
        CopyOther, lambda: ((torch.randn(DIM), torch.zeros(DIM), torch.ones(DIM)), {}),
        ("a", "b"), thread=_in_place),
}
