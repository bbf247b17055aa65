"""Programs writing through self-overlapping as_strided views that the overlapping-write
tests and the Edge-dialect tests share."""

import torch
from torch import nn

__all__ = ["IndexPuts", "IndexWrites", "one_index"]


def one_index(x, n=2):
    """A one-element index the input decides (so 4 calls write different slices)."""
    return (x.sum() > 0).long().view(1) * (n - 1)


class IndexWrites(nn.Module):
    """index_add_ / index_copy_ / index_fill_ / index_reduce_ of one slice (the index
    comes from the input) through overlapping views, with reads of the view between and
    after the writes and the view itself returned."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))
        self.register_buffer("c", torch.arange(24.0).reshape(2, 3, 4))

    def forward(self, x):
        window = self.b.as_strided((2, 2), (1, 1), 0)
        window.index_add_(0, one_index(x), x[:2].view(1, 2), alpha=2)
        between = window * 1
        window.index_copy_(1, one_index(-x), x[2:4].view(2, 1))
        window.index_fill_(1, one_index(x), -1.0)
        window.index_fill_(0, one_index(-x), x[5])
        cube = self.c.as_strided((3, 2, 2), (4, 1, 1), 2)  # slices along dim 1 address once
        cube.index_add_(1, one_index(x), x[:6].view(3, 1, 2))
        cube.index_reduce_(1, one_index(-x), x[:6].view(3, 1, 2), "amax")
        return between, window * 1, window, cube * 1, self.b * 1, self.c * 1


class IndexPuts(nn.Module):
    """index_put_ (setitem) with one-element index tensors, accumulate too, and a
    negative index, through overlapping views."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))
        self.register_buffer("m", torch.arange(12).reshape(3, 4))

    def forward(self, x):
        window = self.b.as_strided((2, 2), (1, 1), 1)
        window[one_index(x)] = x[:2]
        window[:, one_index(-x)] = x[2:4].view(2, 1)
        window.index_put_((one_index(x) - 2,), x[4:6], accumulate=True)
        ints = self.m.as_strided((3, 3), (1, 1), 2)
        ints[one_index(x, 3), one_index(-x, 3)] = 7  # one element
        torch.ops.aten.index_put_(ints, [None, one_index(x, 3)], torch.tensor(5), True)
        return window * 1, self.b * 1, self.m * 1
