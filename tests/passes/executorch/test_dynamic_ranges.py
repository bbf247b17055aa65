"""Dynamic sizes planned over the range they were exported with.

A sliding cache ``torch.cat([self.cache[n:], x])`` with ``n`` exported in ``[1, 6]``:
``cache[n:]`` is largest at ``n = 1``. ExecuTorch 1.5.1 plans it over the range torch traced
``n`` for, ``[2, 6]`` (``to_edge`` puts that range in the Edge program too), so the runtime
failed at ``n = 1`` (``Attempted to resize a bounded tensor with a maximum capacity of 12
elements to 14 elements``) and ``decode_on_runtime`` blamed the step's input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.exir import to_edge
from torch.export import Dim

from passes.executorch import ExecuTorchInputError, decode_on_runtime, run_methods_on_runtime


class SlidingCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.arange(16.0).reshape(8, 2))

    def forward(self, x):
        window = torch.cat([self.cache[x.shape[0]:], x])  # shrinks as x grows
        self.cache.copy_(window)
        return window * 2, self.cache + 0


STEPS = [(torch.full((n, 2), float(n)),) for n in (1, 3, 6, 1, 2)]


def _exported() -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(SlidingCache(), (torch.ones(3, 2),),
                                   dynamic_shapes=({0: Dim("n", min=1, max=6)},))


def _eager() -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = SlidingCache()
    with torch.no_grad():
        return [tuple(t.clone() for t in model(*copy.deepcopy(step))) for step in STEPS]


def _same(outputs) -> bool:
    return all(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
               for got, want in zip(outputs, _eager(), strict=True))


def test_a_size_below_the_traced_minimum_runs_as_in_eager():
    """Each step's window and the cache after it, equal to eager bit for bit; on 91ee2ec
    steps[0] (n = 1) raised ExecuTorchInputError ('the lowered method takes Tensor[6, 2]')."""
    program = _exported()
    assert _same(decode_on_runtime(program, None, STEPS).outputs)
    run = run_methods_on_runtime({"forward": program}, [("forward", s, {}) for s in STEPS])
    assert _same(run.outputs)


def test_a_program_lowered_over_the_narrowed_range_says_so():
    """Lowered by the caller's own to_edge, the range n = 1 was exported with is gone: the
    error says the size is within the plan and why the plan is too small."""
    with torch.no_grad():
        pte = to_edge(_exported()).to_executorch().buffer
    with pytest.raises(ExecuTorchInputError) as info:
        decode_on_runtime(pte, None, STEPS)
    reason = info.value.reason
    assert info.value.argument == "steps[0]"
    assert "within the sizes it is planned for" in reason and "starts at 2" in reason
    assert "dimension 0 is 1 (planned up to 6)" in reason
