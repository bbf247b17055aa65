"""GraphModules traced by ``make_fx`` rather than exported.

With ``tracing_mode="fake"`` the graph's values share one fake mode and record views as
views: the rewrite is checked against eager over 4 calls. With the default
real tracing, every node's value is a snapshot in a fake mode of its own: a view's value
has lost its base and storage offset (``as_strided(b, (2,), (4,), 1)`` records offset 0),
so the rewrite would write back at the wrong place. It used to fail inside the first fake
evaluation ("Mixing fake modes NYI"); it is refused up front, saying how to trace instead.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from pass_manager import PassManager, assert_same_behaviour
from pass_manager.program import program_text
from passes import InplaceToFunctional, MarkMutableBuffers, UnsupportedMutationError


def _writes_through_views(x, cache):
    cache.diagonal().add_(x[:3])
    cache.t()[1:].mul_(0.5)
    cache.as_strided((2,), (4,), 1).sub_(1)
    torch.sum(x.view(3, 4), 1, out=cache[2])
    return cache.sum(0), cache[0]


class Eager(nn.Module):
    def forward(self, x, cache):
        return _writes_through_views(x, cache)


def _calls():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(12, generator=gen), torch.arange(9.0).reshape(3, 3)) for _ in range(4)]


def test_make_fx_graph_with_one_fake_mode():
    calls = _calls()
    gm = make_fx(_writes_through_views, tracing_mode="fake")(*copy.deepcopy(calls[0]))
    result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(gm).program
    assert_same_behaviour(Eager(), result, calls, calls=4)


def test_make_fx_real_tracing_is_refused_up_front():
    calls = _calls()
    gm = make_fx(_writes_through_views)(*copy.deepcopy(calls[0]))
    marked = PassManager([MarkMutableBuffers()]).run(gm).program
    before = program_text(marked)
    with pytest.raises(UnsupportedMutationError) as info:
        InplaceToFunctional().call(marked)
    assert info.value.kind == "fake-failure"
    assert "tracing_mode='fake'" in str(info.value)
    assert program_text(marked) == before
