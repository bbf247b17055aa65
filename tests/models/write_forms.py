"""One model per form of writing a cache, each deployed as two methods of one module: a
prefill of ``L = 4`` tokens and a one-token decode, sharing the cache.

Every model projects its input to a value ``v [L, D]``, writes ``v`` into the cache
``[S, D]`` in its own way, and returns ``q @ cache.T`` (the cache read through a matmul
that quantizers annotate). :func:`write_form_calls` gives the deployment's calls.
"""

from __future__ import annotations

import torch

from tests.models.hf import seeded

__all__ = ["WRITE_FORMS", "write_form_calls", "write_form_methods"]

SEQ, DIM, PREFILL = 8, 6, 4


class _CacheModel(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.value, self.query = seeded(
            lambda: (torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)), seed)
        self.register_buffer("cache", torch.zeros(SEQ, DIM))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        v = self.value(x)
        self.write(v, pos)
        return self.query(x) @ self.cache.t()

    def write(self, v: torch.Tensor, pos: torch.Tensor) -> None:
        raise NotImplementedError


class Transposed(_CacheModel):
    """``cache.t()[:, pos] = v.t()``: an index write through a transposed view."""

    def write(self, v, pos):
        self.cache.t()[:, pos] = v.t()


class Narrow(_CacheModel):
    """``cache.narrow(0, 0, L).copy_(v)``: a copy into the first ``L`` rows."""

    def write(self, v, pos):
        self.cache.narrow(0, 0, v.shape[0]).copy_(v)


class Window(_CacheModel):
    """``cache[-L:] = v``: the last ``L`` rows."""

    def write(self, v, pos):
        self.cache[-v.shape[0]:] = v


class ShiftedWindow(_CacheModel):
    """A sliding window: the rows shift up by ``L`` (``cache[:-L] = cache[L:].clone()``),
    then ``cache[-L:] = v``."""

    def write(self, v, pos):
        length = v.shape[0]
        self.cache[:-length] = self.cache[length:].clone()
        self.cache[-length:] = v


class Select(_CacheModel):
    """``cache[i] = v[i]`` row by row (``select`` + ``copy_``), at the rows ``pos`` names
    (a Python int per row: the methods are exported with their own positions)."""

    def forward(self, x, pos):
        v = self.value(x)
        for row in range(v.shape[0]):
            self.cache.select(0, SEQ - v.shape[0] + row).copy_(v[row])
        return self.query(x) @ self.cache.t()


class Unflattened(_CacheModel):
    """``cache.unflatten(0, (2, 4))[1, :L] = v``: a view, a select and a slice (the decode
    writes the second half's first row)."""

    def write(self, v, pos):
        self.cache.unflatten(0, (2, SEQ // 2))[1, :v.shape[0]] = v


class Mixed(_CacheModel):
    """Written two ways in one model: ``index_copy_`` at ``pos`` and a narrow copy of
    half the value into the first rows' first columns."""

    def write(self, v, pos):
        self.cache.index_copy_(0, pos, v)
        self.cache.narrow(1, 0, DIM // 2).narrow(0, 0, v.shape[0]).copy_(v[:, :DIM // 2] * 2)


WRITE_FORMS = {cls.__name__: cls for cls in (Transposed, Narrow, Window, ShiftedWindow, Select,
                                             Unflattened, Mixed)}


def write_form_calls(decodes: int, seed: int) -> list[tuple[str, tuple, dict]]:
    """A prefill of 4 tokens at positions 0-3, then ``decodes`` one-token steps at 4, 5, ...
    (``decodes`` at most 4: the cache has 8 rows)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> torch.Tensor:  # bounded: a few calibration calls cover the range
        return torch.rand(n, DIM, generator=generator) * 2 - 1

    calls = [("prefill", (tokens(PREFILL),
                          torch.arange(PREFILL)), {})]
    for step in range(decodes):
        calls.append(("decode", (tokens(1),
                                 torch.tensor([PREFILL + step])), {}))
    return calls


def write_form_methods(form: str, seed: int = 0):
    """``(module, {"prefill": ep, "decode": ep})`` of one write form, exported from one
    module (one cache tensor for both)."""
    module = WRITE_FORMS[form](seed)
    examples = {}
    for method, args, kwargs in write_form_calls(1, 0):
        examples.setdefault(method, (args, kwargs))
    with torch.no_grad():
        programs = {method: torch.export.export(module, args, kwargs)
                    for method, (args, kwargs) in examples.items()}
    return module, programs
