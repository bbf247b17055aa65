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
    for program in functionalize_both_forms(UnscalesGradients, calls):
        # found_inf, given to every position, does not make the positions depend on
        # one another: the op stays one call.
        assert targets(program).count(
            aten._amp_foreach_non_finite_check_and_unscale.default) == 1



class PositionsShareTensors(nn.Module):
    """_foreach ops whose positions share tensors: one buffer at two positions, a later
    position reading a tensor an earlier one wrote. Eager runs them one position after the
    other; one functional call read every old value and kept only the last write of a
    tensor written twice (``a`` off by 2.18 after the first call; torch's
    run_decompositions({}) is off the same way)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.ones(3))
        self.register_buffer("b", torch.zeros(3))
        self.register_buffer("c", torch.ones(3))

    def forward(self, x, y):
        torch._foreach_add_([self.a, self.a], [x, y])
        torch._foreach_addcmul_([self.a, self.b], [x, y], [self.b, self.a], value=0.5)
        torch._foreach_copy_([self.c, self.b], [self.a * 2, self.c])
        torch._foreach_add_([self.a, self.b], [x, y])  # independent positions: one call
        return self.a * 1, self.b * 1, self.c * 1


def test_positions_sharing_tensors_run_one_after_the_other():
    for program in functionalize_both_forms(PositionsShareTensors, _calls((3,), (3,))):
        found = targets(program)
        # Each dependent op became one functional call per position, in order.
        assert found.count(aten._foreach_add.List) == 3
        assert found.count(aten._foreach_addcmul.Scalar) == 2
        assert found.count(aten._foreach_copy.default) == 2


class OverlappingPositions(nn.Module):
    """A column written at one position overlaps the rows written at the others: refused
    as a possible partial overlap before; run position by position, it is exact."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.ones(3, 3))

    def forward(self, x, y):
        torch._foreach_mul_([self.s[0], self.s[1], self.s[:, 2]], [x, y, x])
        return self.s * 1


def test_overlapping_positions_are_rewritten_position_by_position():
    for program in functionalize_both_forms(OverlappingPositions, _calls((3,), (3,))):
        assert targets(program).count(aten._foreach_mul.List) == 3
