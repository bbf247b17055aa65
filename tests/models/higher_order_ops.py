"""Tiny stateful models whose exported programs hold a higher-order op.

Each reads a buffer inside the op's body and updates a buffer at the top level, so a
program built from it is checked on outputs and state. ``torch.export.export`` gives:

* :class:`MapOverRows`: ``torch.ops.higher_order.map_impl`` (PyTorch's ``test_map_buffers``:
  the mapped body reads a parameter and a buffer, and writes its own result in place);
* :class:`BranchOnSign`: ``torch.ops.higher_order.cond``;
* :class:`RepeatThreeTimes`: ``torch.ops.higher_order.while_loop``;
* :class:`NoGradRegion`: ``torch.ops.higher_order.wrap_with_set_grad_enabled``;
* :class:`AutocastRegion`: ``torch.ops.higher_order.wrap_with_autocast``;
* :class:`WritesInNoGradRegion`: a grad-mode region whose body writes a buffer in place.

:data:`HIGHER_ORDER_CASES` maps each op's name to its model, the op and inputs for
several calls.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._higher_order_ops.map import map as map_over
from torch._higher_order_ops.while_loop import while_loop

__all__ = [
    "HIGHER_ORDER_CASES",
    "AutocastRegion",
    "BranchOnSign",
    "MapOverRows",
    "NoGradRegion",
    "RepeatThreeTimes",
    "WritesInNoGradRegion",
]

higher_order = torch.ops.higher_order


class MapOverRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.param = nn.Parameter(torch.tensor(5.0), requires_grad=False)
        self.register_buffer("buffer", torch.tensor(6.0) + 1)
        self.register_buffer("total", torch.zeros(2))

    def forward(self, xs, y):
        def body(x, y, param, buffer):
            z = x + y + param + buffer
            z.add_(4)
            return z

        rows = map_over(body, xs, y, self.param, self.buffer)
        self.total.add_(rows.sum(0))
        return rows * self.total


class BranchOnSign(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.ones(2))

    def forward(self, x):
        out = torch.cond(x.sum() > 0, lambda x, a: x + a, lambda x, a: x * a, (x, self.acc))
        self.acc.add_(out)
        return out * 2


class RepeatThreeTimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(2))

    def forward(self, x):
        _, out = while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 0.5 + self.acc),
                            (torch.tensor(0), x))
        self.acc.add_(out)
        return out


class NoGradRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(2))
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        with torch.no_grad():
            y = self.linear(x) + self.acc
        self.acc.add_(y)
        return y * 2


class AutocastRegion(nn.Module):
    """A bfloat16 matmul: running it in float32 gives other values, so a lowering that lost
    the region is seen."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(2, 2))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ (x + self.acc)
        self.acc.add_(y.float())
        return y.float() + self.acc


class WritesInNoGradRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(2))

    def forward(self, x):
        y = x * 2
        with torch.no_grad():
            self.acc.add_(y)
            z = self.acc * 3
        return y + z


def _calls(*shape: int, count: int = 4) -> list[tuple]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=generator),) for _ in range(count)]


HIGHER_ORDER_CASES = {
    "map": (MapOverRows, higher_order.map_impl,
            [(torch.randn(3, 2, generator=torch.Generator().manual_seed(i)), torch.tensor(3.0))
             for i in range(4)]),
    # Both branches: the sign of the input's sum alternates.
    "cond": (BranchOnSign, higher_order.cond,
             [(torch.tensor([1.0, 2.0]) * sign,) for sign in (1, -1, -1, 1)]),
    "while_loop": (RepeatThreeTimes, higher_order.while_loop, _calls(2)),
    "set_grad_enabled": (NoGradRegion, higher_order.wrap_with_set_grad_enabled, _calls(2)),
    "autocast": (AutocastRegion, higher_order.wrap_with_autocast, _calls(2, 2)),
}
