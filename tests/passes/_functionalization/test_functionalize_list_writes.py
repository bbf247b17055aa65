"""Ops writing a list of tensors (``Tensor(a!)[] self``: torch's ``_foreach_*_`` ops, the
optimizers' fused updates, AMP's unscale): the functional op returns the list's new
values. Before, the rewrite read such an op as returning its written arguments (their
alias set is empty) and failed with a bare KeyError."""

import torch
from torch import nn

from passes.functional_variants import functional_variant

from .functionalize_checks import _calls, functionalize_both_forms, targets

aten = torch.ops.aten


class ForeachUpdates(nn.Module):
    """Lists of buffers and of views of buffers, written by several _foreach_ ops."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.zeros(3))
        self.register_buffer("b", torch.ones(2, 2))
        self.register_buffer("c", torch.ones(4))

    def forward(self, x, y):
        torch._foreach_add_([self.a, self.b[0], self.c[::2]], 1.5)
        torch._foreach_addcmul_([self.a, self.b[1]], [x, y], [x, y], value=0.5)
        torch._foreach_copy_([self.c[1::2], self.b[:, 0]], [y, y * 2])
        torch._foreach_zero_([self.a[1:]])
        torch._foreach_lerp_([self.a, self.c[:2]], [x, y], 0.25)
        return self.a * 1, self.b * 1, self.c * 1


class UnscalesGradients(nn.Module):
    """A written list and a written tensor in one op (AMP's unscale and inf check)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("g1", torch.ones(3))
        self.register_buffer("g2", torch.ones(2))
        self.register_buffer("found_inf", torch.zeros(1))

    def forward(self, x, y):
        self.g1.mul_(x)
        self.g2.mul_(y)
        torch._amp_foreach_non_finite_check_and_unscale_(
            [self.g1, self.g2], self.found_inf, torch.tensor(0.5))
        return self.g1 * 1, self.found_inf * 1


def test_foreach_ops_write_each_tensor_of_their_list():
    assert not functional_variant(aten._foreach_add_.List).returns_written
    for program in functionalize_both_forms(ForeachUpdates, _calls((3,), (2,))):
        assert aten._foreach_add.Scalar in targets(program)


def test_a_written_list_and_a_written_tensor_in_one_op():
    calls = _calls((3,), (2,))
    calls[1] = (torch.tensor([1.0, float("inf"), 2.0]), calls[1][1])  # found_inf is set
    functionalize_both_forms(UnscalesGradients, calls)
