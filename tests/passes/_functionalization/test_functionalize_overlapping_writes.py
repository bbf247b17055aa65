"""Index-style writes through an as_strided view addressing some elements twice: accepted
when the positions the op writes address each element once for every index value (they
are written back there only), refused otherwise (``overlap``). Both program forms, 4
calls, outputs and state (buffers and the frozen parameter) compared with eager."""

import collections
import copy

import pytest
import torch
from torch import nn

from pass_manager import PassFailedError, PassManager, run_program
from passes import InplaceToFunctional, MarkMutableBuffers, UnsupportedMutationError
from tests.models.overlapping import IndexPuts, IndexWrites, one_index
from tests.models.random_programs import (
    RandomChooser,
    check_against_torch,
    generate_program,
    program_state,
)

from .functionalize_checks import _calls, functionalize_both_forms, refused_in_both_forms


class Seed1542(nn.Module):
    """Fuzz seed 1542: index_add_ into one row of a transposed overlapping as_strided view
    of a frozen parameter ([[0, 1], [1, 2]]: the row addresses each element once)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.arange(6.0), requires_grad=False)

    def forward(self, x):
        self.p.fill_(0.5)
        view = self.p.as_strided((2, 2), (1, 1), 0).swapaxes(0, 0).swapaxes(1, 0)
        view.index_add_(0, torch.tensor([1]), torch.full_like(view.narrow(0, 0, 1), 1.5))
        return self.p * 1


class Scatters(nn.Module):
    """scatter_ / scatter_add_ / scatter_reduce_ whose index reaches one column or one row
    of [[0, 1], [1, 2]]: the positions it can write address each element once, whatever
    the index values (a whole-view index reaches element 1 twice and stays refused)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))

    def forward(self, x):
        window = self.b.as_strided((2, 2), (1, 1), 0)
        index = (x[:1] > 0).long().view(1, 1)
        window.scatter_(0, index, x[2:3].view(1, 1))
        between = window * 1
        window.scatter_add_(0, (x[:2] > 0).long().view(2, 1), x[2:4].view(2, 1))
        window.scatter_reduce_(0, index, x[4:5].view(1, 1), "amin")
        window.scatter_(1, (x[3:5] > 0).long().view(1, 2), 9.0)
        return between, window * 1, self.b * 1


class OneValueWherever(nn.Module):
    """Ops storing one value at every position they write (index_fill_, scatter_ of a
    value, index_put_ / index_copy_ of one element broadcast): positions reaching an
    element twice store the same value, so any index is exact."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(8.0))

    def forward(self, x):
        window = self.b.as_strided((2, 2), (1, 1), 0)
        both = torch.cat([one_index(x), 1 - one_index(x)])
        window.index_fill_(0, both, x[0])
        cube = self.b.as_strided((2, 2, 2), (1, 1, 1), 1)  # each slice overlaps itself
        cube.index_fill_(2, one_index(-x), -1.0)
        window.scatter_(0, (x[:2] > 0).long().view(1, 2), 4.0)
        # fuzz seed 40: a scatter_ of a full_like source, one column each
        window.scatter_(0, (x[2:4] > 0).long().view(1, 2), torch.full_like(window[:1], 2.5))
        shifted = self.b.as_strided((2, 2), (1, 1), 3)
        shifted.index_put_((both,), x[1])
        shifted.index_copy_(1, both, x[2:3].view(1, 1).expand(2, 2))
        return window * 1, cube * 1, self.b * 1


@pytest.mark.parametrize("factory", [Seed1542, IndexWrites, IndexPuts, Scatters,
                                     OneValueWherever])
def test_index_writes_through_an_overlapping_view_are_written_back_where_they_wrote(factory):
    calls = _calls((6,), n=4, seed=1)
    ep, gm = functionalize_both_forms(factory, calls, state=program_state)
    for program in (ep, gm):
        assert torch.ops.aten.index_put.default in {
            n.target for n in program.graph.nodes if n.op == "call_function"}


def test_fuzz_seed_1542_is_transformed_and_torch_agrees():
    steps = generate_program(RandomChooser(1542))
    assert check_against_torch(steps, 1542) == ("transformed", "ok")


def test_statistics_count_writes_through_an_overlapping_view():
    calls = _calls((6,))
    ep = torch.export.export(IndexWrites(), copy.deepcopy(calls[0]))
    report = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).report
    statistics = report.records[-1].statistics
    assert statistics["of which through an overlapping view, where the op wrote"] == 6


class OneRefusedWrite(nn.Module):
    """One write through an overlapping view whose written positions may reach an element
    twice (or cannot be told): refused, as ``add_`` through it is."""

    def __init__(self, write):
        super().__init__()
        self.register_buffer("b", torch.arange(8.0))
        self.write = write

    def forward(self, x):
        self.write(self.b.as_strided((2, 2), (1, 1), 0), self.b, x)
        return self.b * 1


REFUSED = {
    # rows 0 and 1 of [[0, 1], [1, 2]] share element 1
    "index_add_ of two rows": lambda w, b, x: w.index_add_(
        0, torch.cat([one_index(x), 1 - one_index(x)]), x[:4].view(2, 2)),
    # each slice along dim 0 of this cube addresses elements twice itself
    "index_copy_ of an overlapping slice": lambda w, b, x: b.as_strided(
        (2, 2, 2), (1, 1, 1), 0).index_copy_(0, one_index(x), x[:4].view(1, 2, 2)),
    "index_put_ with a mask": lambda w, b, x: w.__setitem__(x[:2].view(2) > 0, 1.0),
    "index_put_ of two rows": lambda w, b, x: w.index_put_(
        (torch.cat([one_index(x), one_index(-x)]),), x[:2]),
    # the fuzzer's scatter: one position per column, and columns 0 and 1 share element 1
    "scatter_ along the whole view": lambda w, b, x: w.scatter_(
        0, (x[:2] > 0).long().view(1, 2), x[2:4].view(1, 2)),
    "scatter_add_ of the whole view": lambda w, b, x: w.scatter_add_(
        1, (x[:4] > 0).long().view(2, 2), x[2:6].view(2, 2)),
    # a filled source written since holds two values
    "scatter_ of a filled tensor written since": lambda w, b, x: w.scatter_(
        0, (x[:2] > 0).long().view(1, 2), torch.zeros(1, 2).index_fill_(1, one_index(x), 1.0)),
    "index_fill_ with an index of data-dependent length": lambda w, b, x: w.index_fill_(
        0, torch.nonzero(x[:1] > 0).view(-1), 2.0),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_writes_that_may_reach_an_element_twice_stay_refused(name):
    error = refused_in_both_forms(lambda: OneRefusedWrite(REFUSED[name]), _calls((6,)),
                                  "overlap")
    assert "more than once" in error.reason and "not proven" in error.reason


class NonContiguousRoot(nn.Module):
    """The written positions are numbered in the root's storage order: a root that is not
    a contiguous tensor owning its storage is refused (``storage``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0).reshape(2, 3).t())

    def forward(self, x):
        self.b.as_strided((2, 2), (1, 1), 0).index_add_(0, one_index(x), x[:2].view(1, 2))
        return self.b * 1


def test_index_write_through_an_overlapping_view_of_a_strided_root_is_refused():
    refused_in_both_forms(NonContiguousRoot, _calls((6,)), "storage")


class RandomIndexWrite(nn.Module):
    """One index-style write, with input-dependent index values, through an as_strided
    view of a 12-element buffer; the view is read after the write."""

    def __init__(self, layout, op, dim, index_shape):
        super().__init__()
        self.register_buffer("b", torch.arange(12.0))
        self.layout, self.op, self.dim, self.index_shape = layout, op, dim, index_shape

    def forward(self, x):
        view = self.b.as_strided(*self.layout)
        size = view.shape[self.dim]
        n = max(1, torch.Size(self.index_shape).numel())
        index = ((x[:n] * 7).abs().long() % size).view(self.index_shape)
        source_shape = list(view.shape)
        if self.op in ("index_add_", "index_copy_", "index_fill_"):
            source_shape[self.dim] = self.index_shape[0]
            source = x[:1].expand(source_shape) * 1.5
            if self.op == "index_fill_":
                view.index_fill_(self.dim, index, -2.0)
            else:
                getattr(view, self.op)(self.dim, index, source)
        elif self.op == "index_put_":
            indices = [None] * self.dim + [index]
            torch.ops.aten.index_put_(view, indices, x[0] * 3, True)
        else:
            getattr(view, self.op)(self.dim, index, x[:1].expand(self.index_shape) + 1)
        return view * 1, self.b * 1


def _random_cases(count, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def pick(n):
        return int(torch.randint(n, (), generator=gen))

    cases = []
    while len(cases) < count:
        ndim = 1 + pick(3)
        sizes = [1 + pick(3) for _ in range(ndim)]
        strides = [pick(4) for _ in range(ndim)]
        span = sum((s - 1) * t for s, t in zip(sizes, strides, strict=True))
        if span >= 12:
            continue
        layout = (sizes, strides, pick(12 - span))
        op = ["index_add_", "index_copy_", "index_fill_", "index_put_", "scatter_add_",
              "scatter_"][pick(6)]
        dim = pick(ndim)
        if op.startswith("scatter"):
            index_shape = [1 + pick(s) for s in sizes]
        else:
            index_shape = [1 + pick(2)]
        cases.append((layout, op, dim, index_shape))
    return cases


def test_random_index_writes_through_as_strided_views_are_exact_or_refused():
    """Random layouts (many address elements twice) and index ops: each is either
    functionalized equal to eager over 4 calls with different index values, or refused
    with ``overlap``; programs eager itself refuses are skipped."""
    calls = _calls((6,), n=4, seed=3)
    outcomes = collections.Counter()
    for case in _random_cases(40):
        try:
            run_program(RandomIndexWrite(*case), calls, state=program_state)
            ep = torch.export.export(RandomIndexWrite(*case), copy.deepcopy(calls[0]))
        except RuntimeError:
            outcomes["eager refuses"] += 1
            continue
        try:
            PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(copy.deepcopy(ep))
        except PassFailedError as e:
            assert isinstance(e.__cause__, UnsupportedMutationError), case
            assert e.__cause__.kind == "overlap", case
            outcomes["refused"] += 1
            continue
        functionalize_both_forms(lambda case=case: RandomIndexWrite(*case), calls,
                                 state=program_state)
        outcomes["exact"] += 1
    assert outcomes["exact"] >= 10 and outcomes["refused"] >= 3, outcomes


class HalfIndexWrites(nn.Module):
    """On float16, eager's index_copy_ / index_put_ / index_fill_ write each position in
    place (accepted); its index_add_ and scatters copy a temporary of the whole view back,
    stale values included, so they stay refused (see HalfIndexAdd)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("h", torch.arange(6.0).half())

    def forward(self, x):
        window = self.h.as_strided((2, 2), (1, 1), 0)
        window.index_copy_(0, one_index(x), x[:2].half().view(1, 2))
        window[one_index(-x)] = x[2:4].half()
        window.index_fill_(1, one_index(x), -3.0)
        return window * 1, self.h * 1


class HalfIndexAdd(HalfIndexWrites):
    def forward(self, x):
        self.h.as_strided((2, 2), (1, 1), 0).index_add_(0, one_index(x), x[:2].half().view(1, 2))
        return self.h * 1


def test_half_precision_writes_accepted_only_where_eager_writes_in_place():
    calls = _calls((6,), n=4, seed=2)
    functionalize_both_forms(HalfIndexWrites, calls)
    refused_in_both_forms(HalfIndexAdd, calls, "overlap")
    # the eager kernel this refusal is about: row 0 (elements 0 and 1) gets 1 added, but
    # element 1 keeps its old value, copied back from row 1
    h = torch.arange(6.0).half()
    h.as_strided((2, 2), (1, 1), 0).index_add_(0, torch.tensor([0]), torch.ones(1, 2).half())
    assert h[0] == 1 and h[1] == 1


class OverlappingBuffer(nn.Module):
    """A buffer registered with overlapping strides (rows 0..2 are storage 0..3, 1..4 and
    2..5), written by ``write(buffer, x)`` and read whole."""

    def __init__(self, write):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0).as_strided((3, 4), (1, 1)))
        self.write = write

    def forward(self, x):
        self.write(self.b, x)
        return self.b * 2


# Each position computed from the values the positions before it stored (eager) or from
# the old values (functional): torch's run_decompositions({}) is off too (add_: 3.6).
OVERLAPPING_BUFFER_REFUSED = {
    "add_": lambda b, x: b.add_(x),
    "mul_ scalar": lambda b, x: b.mul_(2),
    "index_add_": lambda b, x: b.index_add_(0, torch.tensor([2]), x[:1]),
    "index_copy_": lambda b, x: b.index_copy_(0, torch.tensor([1, 2]), x[:2]),
    "add_ to a slice": lambda b, x: b[:, 1:3].add_(x[:, :2]),
}
# A view addressing each element once, copy_ and fill_: written into a clone of the
# buffer's own layout, position after position as eager writes them.
OVERLAPPING_BUFFER_EXACT = {
    "add_ to a row": lambda b, x: b[1].add_(x[0]),
    "copy_ to a column": lambda b, x: b[:, 2].copy_(x[:, 0]),
    "copy_ to two rows": lambda b, x: b[1:3].copy_(x[:2]),
    "copy_ whole": lambda b, x: b.copy_(x),
    "fill_": lambda b, x: b.fill_(3.0),
}


@pytest.mark.parametrize("name", sorted(OVERLAPPING_BUFFER_REFUSED))
def test_writes_to_positions_sharing_an_element_of_overlapping_state_are_refused(name):
    """These were silently wrong (add_: 3.6 off eager on the first call, index_copy_: 18)."""
    write = OVERLAPPING_BUFFER_REFUSED[name]
    error = refused_in_both_forms(lambda: OverlappingBuffer(write), _calls((3, 4)), "overlap")
    assert "buffer 'b' more than once" in error.reason


@pytest.mark.parametrize("name", sorted(OVERLAPPING_BUFFER_EXACT))
def test_exact_writes_to_overlapping_state_are_functionalized(name):
    write = OVERLAPPING_BUFFER_EXACT[name]
    functionalize_both_forms(lambda: OverlappingBuffer(write), _calls((3, 4)))
