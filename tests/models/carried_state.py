"""Models whose state is carried through the call signature instead of living in buffers.

* :class:`InPlaceCache`: a KV-cache-like input written in place at an integer counter input,
  which it also advances in place (``index_copy_``, ``add_``; HF's exporter's decode form);
* :class:`SlidingWindow`: returns its window shifted by one new column (input/output pair);
* :class:`SelectiveScan`: an SSM-style recurrence ``h = a * h + b(x)``, returned as
  ``(y, h)``;
* :class:`NamedState`: ``past_key_values`` dict inputs, ``present.*`` outputs (OpenVINO's
  naming) as keyword inputs;
* :class:`Prefill` / :class:`Decode`: a prefill creating its cache in the graph and returning
  it, and the decode writing that cache in place (HF's prefill and decode);
* :class:`KeyedState` / :class:`FieldState`: state written in place beside a read-only weight
  in one container, a dict keyed by tuples or a registered dataclass of two fields.

Each ``*_inputs`` function returns fresh example inputs.
"""

from __future__ import annotations

import dataclasses

import torch

from tests.models.hf import seeded

__all__ = [
    "Decode",
    "FieldState",
    "InPlaceCache",
    "KeyedState",
    "NamedState",
    "Prefill",
    "SelectiveScan",
    "SlidingWindow",
    "StateFields",
    "cache_inputs",
    "field_state_inputs",
    "keyed_state_inputs",
    "named_state_inputs",
    "scan_inputs",
    "window_inputs",
]

DIM = 4
LENGTH = 8


def _linear(seed: int) -> torch.nn.Linear:
    return seeded(lambda: torch.nn.Linear(DIM, DIM), seed)


class InPlaceCache(torch.nn.Module):
    """Writes ``proj(x)`` into ``cache`` at ``position`` and advances ``position``, in place."""

    def __init__(self):
        super().__init__()
        self.proj = _linear(0)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, position: torch.Tensor
                ) -> torch.Tensor:
        cache.index_copy_(1, position, self.proj(x))
        position.add_(1)
        return cache.sum(1) * 2


def cache_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, 1, DIM), torch.zeros(1, LENGTH, DIM), torch.tensor([0])


class SlidingWindow(torch.nn.Module):
    """Keeps the last ``LENGTH`` inputs: returns ``(mean, window shifted by x)``."""

    def forward(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shifted = torch.cat([window[:, 1:], x], dim=1)
        return shifted.mean(1), shifted


def window_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 1, DIM), torch.zeros(1, LENGTH, DIM)


class SelectiveScan(torch.nn.Module):
    """``h = a * h + b(x)``, ``y = c(h)``: returns ``(y, h)``."""

    def __init__(self):
        super().__init__()
        self.b, self.c = _linear(1), _linear(2)
        self.register_buffer("a", torch.linspace(0.5, 0.9, DIM))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a * h + self.b(x)
        return self.c(h), h


def scan_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, DIM), torch.zeros(1, DIM)


class NamedState(torch.nn.Module):
    """Keyword ``past_key_values={"0.key", "0.value"}`` in, ``present.0.*`` out (by name)."""

    def __init__(self):
        super().__init__()
        self.k, self.v = _linear(3), _linear(4)

    def forward(self, x: torch.Tensor, past_key_values: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        key = torch.cat([past_key_values["0.key"][:, 1:], self.k(x)], dim=1)
        value = torch.cat([past_key_values["0.value"][:, 1:], self.v(x)], dim=1)
        scores = torch.softmax(key @ x.transpose(1, 2), dim=1)
        return {"logits": (scores * value).sum(1), "present.0.key": key,
                "present.0.value": value}


def named_state_inputs() -> tuple[tuple, dict]:
    state = {"0.key": torch.zeros(1, LENGTH, DIM), "0.value": torch.zeros(1, LENGTH, DIM)}
    return (torch.randn(1, 1, DIM),), {"past_key_values": state}


class Prefill(torch.nn.Module):
    """Creates the cache (zeros), writes ``proj(x)`` for ``x``'s tokens, returns ``(y, cache,
    position)``."""

    def __init__(self):
        super().__init__()
        self.proj = _linear(0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = torch.zeros(1, LENGTH, DIM)
        cache[:, : x.shape[1]] = self.proj(x)
        position = torch.tensor([x.shape[1]])
        return cache.sum(1) * 2, cache, position


class Decode(InPlaceCache):
    """The decode of :class:`Prefill`'s cache (the same projection), written in place."""


class KeyedState(torch.nn.Module):
    """Decays ``state[("h", 0)]`` in place toward ``x`` scaled by the read-only
    ``state[("w", 0)]``: a dict keyed by tuples, one of its leaves state."""

    def forward(self, x: torch.Tensor, state: dict[tuple[str, int], torch.Tensor]
                ) -> torch.Tensor:
        h = state[("h", 0)]
        h.mul_(0.5).add_(x * state[("w", 0)])
        return h * 2


def keyed_state_inputs() -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
    return torch.randn(DIM), {("h", 0): torch.zeros(DIM), ("w", 0): torch.full((DIM,), 2.0)}


@dataclasses.dataclass
class StateFields:
    """Two fields: ``h`` the state, ``w`` a read-only weight."""

    h: torch.Tensor
    w: torch.Tensor


torch.export.register_dataclass(StateFields, serialized_type_name="tests.StateFields")


class FieldState(torch.nn.Module):
    """:class:`KeyedState` with its two leaves the fields of a :class:`StateFields`."""

    def forward(self, x: torch.Tensor, fields: StateFields) -> torch.Tensor:
        fields.h.mul_(0.5).add_(x * fields.w)
        return fields.h * 2


def field_state_inputs() -> tuple[torch.Tensor, StateFields]:
    return torch.randn(DIM), StateFields(torch.zeros(DIM), torch.full((DIM,), 2.0))
