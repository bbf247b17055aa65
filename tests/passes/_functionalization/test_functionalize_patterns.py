"""InplaceToFunctional on the mutation shapes of torch's own test suites (issue 10): each
program is exported, functionalized in both forms and called 4 times in a row; outputs,
buffers and mutated inputs must equal eager's, or the pass refuses with a typed error and
leaves the program unchanged."""

import copy

import pytest
import torch
from torch import nn

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers

from .functionalize_checks import (
    _calls,
    functionalize_both_forms,
    refused_in_both_forms,
    refused_in_both_forms_of,
    targets,
)

aten = torch.ops.aten


# -- pattern 9: ops reading a written view's storage --------------------------------------
class StridedAfterWrite(nn.Module):
    """The miscompile the fuzzer found: as_strided of a view written in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(8.0).reshape(2, 4))

    def forward(self, x):
        v = self.b[1]
        v.add_(x)
        # explicit offset 0 reads row 0; the implicit offset is the view's own (4)
        return v.as_strided((2, 2), (1, 1), 0) * 1, v.as_strided((2,), (2,)) * 1


class StridedTakenBeforeWrite(nn.Module):
    """as_strided views taken before a write (of the root, of another view) read after it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(12.0).reshape(3, 4))

    def forward(self, x):
        window = self.b[2].as_strided((3, 2), (2, 1), 1)
        self.b.mul_(1.5)
        self.b[0].add_(x)
        return window + 0, self.b.sum()


class WriteThroughStrided(nn.Module):
    """Writes through as_strided of a view, and through a slice of an as_strided view."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(12.0).reshape(3, 4))

    def forward(self, x):
        self.b[1].as_strided((2,), (3,)).mul_(x[:2])
        self.b.as_strided((4,), (2,), 3)[1:].add_(x[1:])
        return self.b * 1


class StridedOfWrittenInput(nn.Module):
    def forward(self, x, y):
        x[1:].mul_(y)
        return x.as_strided((2, 2), (2, 1), 2) * 1, x[1:].as_strided((3,), (1,), 0) * 1


class StridedOfTransposedTemp(nn.Module):
    """A temporary whose storage is laid out transposed: its as_strided after a write
    cannot be re-addressed in a fresh contiguous value, so it is refused."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        t = (x * 2).t().clone()  # clone keeps the transposed strides
        t[0].add_(1)
        self.b.add_(t.as_strided((3,), (1,), 0))
        return self.b * 1


def test_as_strided_of_a_written_view_reads_the_base_storage():
    ep, gm = functionalize_both_forms(StridedAfterWrite, _calls((4,)))
    for program in (ep, gm):
        assert aten.add_.Tensor not in targets(program)


def test_as_strided_views_taken_before_writes():
    functionalize_both_forms(StridedTakenBeforeWrite, _calls((4,)))


def test_writes_through_as_strided_views_of_views():
    _, gm = functionalize_both_forms(WriteThroughStrided, _calls((4,)))
    assert aten.as_strided_scatter.default in targets(gm)


def test_as_strided_of_a_written_user_input():
    functionalize_both_forms(StridedOfWrittenInput, _calls((3, 2), (2, 2)))


def test_as_strided_of_a_non_contiguous_written_temporary_is_refused():
    error = refused_in_both_forms(StridedOfTransposedTemp, _calls((3, 2)), "storage")
    assert "storage" in error.reason


# -- pattern 10: counterparts derived from the schema -------------------------------------
class InplaceOperators(nn.Module):
    """pow_ with a scalar and a tensor exponent and the in-place operator overloads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.linspace(0.5, 2.0, 6))
        self.register_buffer("flags", torch.arange(6))

    def forward(self, x, bits):
        self.b.pow_(0.5)
        self.b.pow_(x.abs() + 0.5)
        self.flags |= bits
        self.flags &= 7
        self.flags ^= bits
        self.flags <<= 1
        self.flags >>= 1
        self.b[:3] *= 2
        self.b[3:] -= self.b[:3]
        return self.b * 1, self.flags * 1


def test_pow_and_in_place_operator_overloads():
    gen = torch.Generator().manual_seed(0)
    calls = [(torch.rand(6, generator=gen), torch.randint(0, 16, (6,), generator=gen))
             for _ in range(4)]
    ep, gm = functionalize_both_forms(InplaceOperators, calls)
    for program in (ep, gm):
        assert {aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor} <= set(targets(program))
        assert not any(str(t).startswith("aten.__i") for t in targets(program))


# -- pattern 1: views taken before a write and returned ----------------------------------
class ReturnsViewsTakenBeforeWrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))

    def forward(self, x):
        flat, col, tr = x.view(-1), self.b[:, 1], self.b.t()
        x.add_(1)
        self.b.add_(x)
        self.b[0].mul_(2)
        return flat, col, tr, x


def test_views_taken_before_writes_and_returned():
    _, gm = functionalize_both_forms(ReturnsViewsTakenBeforeWrites, _calls((2, 3)))
    # the write-backs stay last (the pass's own Functional postcondition checks them)
    copies = [n for n in gm.graph.nodes if n.target is aten.copy_.default]
    assert len(copies) == 2 and all(n.next in copies or n.next.op == "output" for n in copies)


# -- pattern 7: writes the schema does not annotate ---------------------------------------
class NativeBatchNormTrain(nn.Module):
    """native_batch_norm in training mode updates running_mean/var: its schema says nothing."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        out, mean, invstd = aten.native_batch_norm.default(
            x, self.weight, None, self.running_mean, self.running_var, True, 0.1, 1e-5)
        return out, mean, invstd


def test_native_batch_norm_training_updates_running_stats_functionally():
    ep, gm = functionalize_both_forms(NativeBatchNormTrain, _calls((5, 3)))
    reference = torch.export.export(NativeBatchNormTrain(), _calls((5, 3))[0]).run_decompositions(
        {}).graph_signature
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == sorted(
        reference.buffers_to_mutate.values()) == ["running_mean", "running_var"]
    for program in (ep, gm):
        assert aten.native_batch_norm.default not in targets(program)
        assert aten._native_batch_norm_legit_functional.default in targets(program)


# -- pattern 11: movedim (and other re-indexing views) written through ---------------------
class MovedimWrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(24.0).reshape(2, 3, 4))

    def forward(self, x):
        self.b.movedim(2, 0)[1].add_(x)
        self.b.movedim((0, 1), (2, 0)).select(0, 1).mul_(2)
        self.b.swapaxes(0, 2)[3].sub_(x.t())
        return self.b * 1


def test_writes_through_movedim_and_swapaxes():
    _, gm = functionalize_both_forms(MovedimWrites, _calls((2, 3)))
    assert aten.movedim.int in targets(gm)


# -- pattern 12: disjoint sibling views are not overlapping --------------------------------
class SiblingViews(nn.Module):
    """Writes whose other argument is a disjoint view of the same buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(20.0).reshape(4, 5))

    def forward(self, x):
        self.b[:, 0].add_(self.b[:, 2])
        self.b.select(1, 1).sub_(self.b.select(1, 3) * x)
        self.b.diagonal().mul_(self.b.diagonal(1)[:3].sum())
        self.b.diagonal()[:3].add_(self.b.diagonal(1)[:3])
        self.b[0, ::2].copy_(self.b[0, 1::2][:3].flip(0).sum().expand(3))
        self.b[1::2].add_(self.b[::2])
        return self.b * 1


def test_disjoint_sibling_views_are_rewritten():
    functionalize_both_forms(SiblingViews, _calls((4,)))


class OverlappingViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))

    def forward(self, x):
        self.b[1:].add_(self.b[:-1])
        return self.b * x


def test_truly_overlapping_views_are_refused():
    error = refused_in_both_forms(OverlappingViews, _calls((6,)), "overlap")
    assert "overlap" in error.reason


# -- pattern 2: symbolic ranges proven equal or disjoint from the shape environment --------
class SymbolicRanges(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(16))

    def forward(self, x):
        n = x.shape[0]
        self.b[:n].add_(self.b[0:n])  # one region
        self.b[:n].add_(x)
        self.b[n:2 * n].copy_(self.b[:n] * 2)  # disjoint regions
        self.b.narrow(0, 0, n).mul_(self.b[n:2 * n])
        return self.b * 1


def test_symbolic_ranges_equal_or_disjoint():
    calls = [(torch.randn(n, generator=torch.Generator().manual_seed(n)),) for n in (3, 5, 2, 7)]
    dims = ({0: torch.export.Dim("n", min=2, max=8)},)
    functionalize_both_forms(SymbolicRanges, calls, dynamic_shapes=dims)


class NarrowFromTheEnd(nn.Module):
    """narrow counts a negative start from the end: static, symbolic and unbacked starts
    (sign unknown) whose end ``start + length`` is 0 for the last rows. Written back with
    that end as an absolute bound, slice_scatter got an empty slice and the program failed
    when called."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(8, 3))

    def forward(self, x, pos):
        n, i = x.shape[0], pos.item()
        torch._check(i >= -8)
        torch._check(i < 8)
        self.b.narrow(0, -2, 2).add_(x[:2])
        self.b.narrow(1, -1, 1).mul_(2)
        self.b.narrow(0, -n, 2).sub_(x[:2])
        self.b.narrow(0, i, 1).add_(x[0])
        return self.b * 1


def test_writes_through_narrow_from_the_end():
    gen = torch.Generator().manual_seed(0)
    calls = [(torch.randn(n, 3, generator=gen), torch.tensor(i))
             for n, i in ((2, -1), (5, 3), (4, -8), (2, 0))]
    dims = ({0: torch.export.Dim("n", min=2, max=8)}, None)
    functionalize_both_forms(NarrowFromTheEnd, calls, dynamic_shapes=dims)


class SymbolicPieces(nn.Module):
    """Writes through pieces of split_with_sizes and tensor_split whose bounds are
    symbolic (a token count): refused as "a symbolic split" before, though the pieces'
    bounds are sums of the op's own arguments."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(16, 3))

    def forward(self, x):
        t = x.shape[0]
        head, tail = torch.split(self.b, [t, 16 - t])
        head.add_(x)
        tail[0].mul_(2)
        pieces = torch.tensor_split(self.b, [t, 2 * t])
        pieces[1].sub_(x)
        pieces[2][-1].add_(1)
        return self.b.sum(0)


def test_writes_through_pieces_of_symbolic_splits():
    gen = torch.Generator().manual_seed(0)
    calls = [(torch.randn(t, 3, generator=gen),) for t in (2, 5, 3, 7)]
    dims = ({0: torch.export.Dim("t", min=2, max=7)},)
    for program in functionalize_both_forms(SymbolicPieces, calls, dynamic_shapes=dims,
                                            strict=True):
        assert aten.slice_scatter.default in targets(program)


# -- pattern 6: ops without a registered functional variant -------------------------------
@torch.library.custom_op("fn10_test::accumulate2", mutates_args=("a", "b"))
def _accumulate2(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a.add_(x)
    b.mul_(2)
    return x * 3


@_accumulate2.register_fake
def _(a, b, x):
    return torch.empty_like(x)


@torch.library.custom_op("fn10_test::fill_rows", mutates_args=("out",))
def _fill_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    out.copy_(rows.expand_as(out))


@_fill_rows.register_fake
def _(out, rows):
    return None


class CustomMutations(nn.Module):
    """Custom ops writing two arguments (a view of one buffer and another buffer) and a
    view of a buffer, with no registered functional variant."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.zeros(2, 3))
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        y = torch.ops.fn10_test.accumulate2(self.a[1], self.b, x)
        torch.ops.fn10_test.fill_rows(self.a[:1], x.view(1, 3) + self.b)
        return y + self.a.sum(0)


def test_custom_ops_fall_back_to_auto_functionalized():
    ep, gm = functionalize_both_forms(CustomMutations, _calls((3,)))
    reference = torch.export.export(CustomMutations(), _calls((3,))[0]).run_decompositions(
        {}).graph_signature
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == sorted(
        reference.buffers_to_mutate.values())
    for program in (ep, gm):
        assert targets(program).count(torch.ops.higher_order.auto_functionalized) == 2



class OneTensorForTwoWrittenArguments(nn.Module):
    """A custom op writing two arguments, given one buffer for both: eager adds x and then
    doubles it; one functional call computed both new values from the old buffer and kept
    only the doubled one (2.0 where eager has 5.08 after the first call)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.ones(3))

    def forward(self, x):
        y = _accumulate2(self.a, self.a, x)
        return y + self.a


def test_one_tensor_for_two_written_arguments_is_refused():
    error = refused_in_both_forms(OneTensorForTwoWrittenArguments, _calls((3,)), "overlap")
    assert "is given for two of its written arguments" in error.reason

class RunningStats(nn.Module):
    """Ops torch functionalizes that update state: instance norm tracking running stats,
    the fused moving-average observer + fake quant, and dropout_ outside training."""

    def __init__(self):
        super().__init__()
        self.inorm = nn.InstanceNorm1d(3, track_running_stats=True, affine=True)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("low", torch.tensor([float("inf")]))
        self.register_buffer("high", torch.tensor([float("-inf")]))
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("zero_point", torch.zeros(1, dtype=torch.int32))
        self.register_buffer("on", torch.ones(1, dtype=torch.long))

    def forward(self, x):
        y = self.bn(self.inorm(x))
        torch.ops.aten.dropout_(y, 0.3, False)
        nn.functional.dropout(y, 0.5, training=False, inplace=True)
        q = torch.fused_moving_avg_obs_fake_quant(
            y, self.on, self.on, self.low, self.high, self.scale, self.zero_point, 0.01, 0,
            255, -1)
        return q + y


def test_running_statistics_and_observers():
    ep, gm = functionalize_both_forms(lambda: RunningStats().train(), _calls((2, 3, 5)))
    reference = torch.export.export(RunningStats().train(), _calls((2, 3, 5))[0])
    reference = reference.run_decompositions({})
    # run_decompositions keeps instance_norm, which still writes its running statistics
    # without listing them; here they are mutation outputs like the others.
    assert aten.instance_norm.default in targets(reference)
    expected = {*reference.graph_signature.buffers_to_mutate.values(),
                "inorm.running_mean", "inorm.running_var"}
    assert set(ep.graph_signature.buffers_to_mutate.values()) == expected
    for program in (ep, gm):
        assert aten.instance_norm.default not in targets(program)
        assert aten.fused_moving_avg_obs_fake_quant.default not in targets(program)


# -- pattern 4: writes under torch.no_grad() in a program exported with grad enabled ------
class NoGradState(nn.Module):
    """An EMA buffer and an SSM-like state cache updated under no_grad (exported with grad
    enabled, so export wraps the region in wrap_with_set_grad_enabled), and a no_grad
    region that writes nothing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("state", torch.zeros(2, 3))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0) * 0.1)
            self.state[0].copy_(y[0])
            self.state[1].mul_(0.5).add_(self.state[0])
            seen = self.state.sum(0)
        with torch.no_grad():
            frozen = y * 2
        return y * self.ema + seen + frozen


def test_state_written_under_no_grad():
    calls = _calls((4, 3))
    ep, gm = functionalize_both_forms(NoGradState, calls)
    reference = torch.export.export(NoGradState(), calls[0]).run_decompositions({})
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == sorted(
        reference.graph_signature.buffers_to_mutate.values()) == ["ema", "state"]
    for program in (ep, gm):
        # the writing region is inlined; the region that writes nothing stays as it was
        assert targets(program).count(torch.ops.higher_order.wrap_with_set_grad_enabled) == 1


class WriteThroughOverlappingStrided(nn.Module):
    """Found by the fuzzer: a write through an as_strided view whose strides address one
    element twice has no functional equivalent (its write-back would store that element's
    old and new values)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))

    def forward(self, x):
        self.b[1:].as_strided((2, 2), (1, 1), 0).add_(x[:4].view(2, 2))
        return self.b * 1


def test_write_through_self_overlapping_as_strided_is_refused():
    error = refused_in_both_forms(WriteThroughOverlappingStrided, _calls((6,)), "overlap")
    assert "more than once" in error.reason


class WriteThroughAViewOfOverlappingStrided(nn.Module):
    """Found by the fuzzer (seed 743): a view of an overlapping as_strided view that
    addresses each element once (here a diagonal of a swapped view) is written back from
    its own layout, as run_decompositions does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.arange(24.0).reshape(4, 6))

    def forward(self, x):
        view = self.c.as_strided((2, 2), (1, 1), 0).swapaxes(1, 1).diagonal(1).unsqueeze(1)
        view.sub_(x[:1].view(1, 1))
        return self.c.as_strided((2, 2), (1, 1), 0) * 1


class WriteThroughARowOfOverlappingStrided(WriteThroughAViewOfOverlappingStrided):
    """A row of an overlapping as_strided view of a slice (torch's functionalization bans
    an as_strided in the middle of a written view chain; the row is written back exactly)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))

    def forward(self, x):
        self.b[1:].as_strided((2, 2), (1, 1), 0)[0].add_(x[:2])
        return self.b * 1, super().forward(x)


class FillThroughOverlappingStrided(nn.Module):
    """Found by the fuzzer (seed 1843): fill_ / zero_ store one value at every position of
    an overlapping as_strided view, so its write-back is exact."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(24.0).reshape(2, 3, 4))
        self.register_buffer("c", torch.arange(6.0))

    def forward(self, x):
        window = self.b.as_strided((2, 2), (1, 1), 0)
        window.permute(1, 0).fill_(x.sum())  # a 0-dim tensor value
        self.c.as_strided((3, 2), (1, 1), 1).zero_()
        return window * 1, self.b * 1, self.c * 1


def test_fill_through_an_overlapping_as_strided_view():
    calls = _calls((6,))
    functionalize_both_forms(FillThroughOverlappingStrided, calls)
    ep = torch.export.export(FillThroughOverlappingStrided(), calls[0])
    assert_same_behaviour(FillThroughOverlappingStrided(),
                          ep.run_decompositions({}), calls, calls=4)


class CopyOneValueThroughOverlappingStrided(nn.Module):
    """Found by the fuzzer (seed 2338): copy_ of a 0-dim value, or of an expand of one
    element, stores one value at every position of an overlapping view, like fill_; a
    copy_ of a full tensor through it stays refused (tested above with add_)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))
        self.register_buffer("m", torch.arange(6))

    def forward(self, x):
        self.b.as_strided((2, 2), (1, 1), 0).copy_(x.sum())
        window = self.m.as_strided((2, 2), (1, 1), 1)[0:2]
        window.copy_((x.sum() * 10).to(torch.int64).expand_as(window))
        return self.b * 1, self.m * 1


def test_copy_of_one_value_through_an_overlapping_as_strided_view():
    calls = _calls((6,))
    functionalize_both_forms(CopyOneValueThroughOverlappingStrided, calls)
    ep = torch.export.export(CopyOneValueThroughOverlappingStrided(), calls[0])
    assert_same_behaviour(CopyOneValueThroughOverlappingStrided(),
                          ep.run_decompositions({}), calls, calls=4)


def test_write_through_a_view_of_an_overlapping_as_strided_view():
    calls = _calls((6,))
    functionalize_both_forms(WriteThroughAViewOfOverlappingStrided, calls)
    functionalize_both_forms(WriteThroughARowOfOverlappingStrided, calls)
    ep = torch.export.export(WriteThroughAViewOfOverlappingStrided(), calls[0])
    assert_same_behaviour(WriteThroughAViewOfOverlappingStrided(),
                          ep.run_decompositions({}), calls, calls=4)


# -- pattern 5: out= resizing fresh tensors, shape-changing in-place ops on intermediates --
class Relayouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))

    def forward(self, x):
        total = torch.add(x, 1, out=torch.empty(()))  # resized to x's shape
        low, high = torch.empty(0), torch.empty(0)
        torch.aminmax(x, dim=0, out=(low, high))
        t = x * 2
        t.unsqueeze_(0)
        t.add_(1)
        u = x + 1
        u.t_()
        u.mul_(2)
        v = (x - 1).unsqueeze(0) * 1
        v.squeeze_(0)
        v.transpose_(0, 1)
        self.b.add_(t[0] + u.t() + v.t())
        return total, low + high, t, u, v


def test_out_resize_and_metadata_mutations_of_intermediates():
    ep, gm = functionalize_both_forms(Relayouts, _calls((2, 3)))
    for program in (ep, gm):
        assert not {aten.unsqueeze_.default, aten.t_.default, aten.add.out} & set(targets(program))


class BufferUnsqueezedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        self.b.unsqueeze_(0)
        return self.b + x


def test_relayout_of_state_is_refused():
    # A viewed tensor's relayout is a view now: test_functionalize_metadata.py.
    refused_in_both_forms(BufferUnsqueezedInPlace, _calls((3,)), "relayout")


# -- pattern 3: writes local to a higher-order op's subgraph -------------------------------
def _positive_branch(x):
    y = x * 2
    y.add_(1)  # a tensor the branch allocates: no program mutation
    return y


def _negative_branch(x):
    y = x - 1
    y.mul_(3)
    return y


def _map_body(row):
    z = row.clone()
    z[0].add_(2)
    return z


class LocalWritesInSubgraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        from torch._higher_order_ops.map import map as hop_map

        out = torch.cond(x.sum() > 0, _positive_branch, _negative_branch, (x,))
        mapped = hop_map(_map_body, x.view(3, 1))
        self.b.add_(out)
        return self.b * 1, mapped


def test_writes_local_to_cond_and_map_subgraphs():
    calls = [(torch.randn(3, generator=torch.Generator().manual_seed(i)) * (-1) ** i,)
             for i in range(4)]  # both branches taken
    ep, gm = functionalize_both_forms(LocalWritesInSubgraphs, calls)
    for program in (ep, gm):
        assert torch.ops.higher_order.cond in targets(program)
        assert aten.add_.Tensor not in targets(program)


# -- pattern 8: whole-buffer copies left after re-export -----------------------------------
class CacheAndEma(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        self.ema.copy_(self.ema * 0.5 + x[0])
        return self.cache.sum(0) + self.ema


def test_re_exported_program_has_no_whole_buffer_copies_and_delegates_own_the_cache():
    from passes import ConsumeBufferMutationsInDelegate
    from passes.delegation import OpSupportPartitioner, delegates, program_state, to_delegate

    calls = [(torch.randn(1, 3, generator=torch.Generator().manual_seed(i)), torch.tensor([i]))
             for i in range(4)]
    pipeline = [MarkMutableBuffers(), InplaceToFunctional()]
    first = PassManager(pipeline).run(torch.export.export(CacheAndEma(), calls[0])).program
    # Re-exporting the functional program gives one copy_(buffer, new value) per buffer.
    again = torch.export.export(first.module(), copy.deepcopy(calls[0]))
    assert targets(again).count(aten.copy_.default) == 2
    for program in (again, again.module()):
        result = PassManager(pipeline).run(copy.deepcopy(program)).program
        assert_same_behaviour(CacheAndEma(), result, calls, calls=4)
        assert aten.copy.default not in targets(result)  # no full copy of the cache
    result = PassManager(pipeline).run(again).program
    outputs = result.graph.output_node().args[0]
    assert [n.target for n in outputs[:2]] == [aten.index_copy.default, aten.add.Tensor]
    # A partitioner delegating only the cache update hands the cache to that delegate.
    lowered = to_delegate(result, OpSupportPartitioner([aten.index_copy.default]))
    consumed = PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered).program
    assert [sorted(d.owned_buffers) for d in delegates(consumed)] == [["cache"]]
    assert_same_behaviour(CacheAndEma(), consumed, calls, state=program_state)


class WhileLoopLocalWrites(nn.Module):
    """A while_loop body writing only tensors it allocates; the state is written outside."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        def cond_fn(i, acc):
            return i < 3

        def body_fn(i, acc):
            t = acc * 0.5
            t.add_(1)
            t[0].mul_(2)  # a write through a view of the local tensor
            return i + 1, t

        _, acc = while_loop(cond_fn, body_fn, (torch.tensor(0), x))
        self.b.add_(acc)
        return acc, self.b * 1


def test_writes_local_to_a_while_loop_body():
    calls = _calls((3,))
    for strict in (False, True):
        ep, gm = functionalize_both_forms(WhileLoopLocalWrites, calls, strict=strict)
        for program in (ep, gm):
            assert torch.ops.higher_order.while_loop in targets(program)
            assert aten.add_.Tensor not in targets(program)


class CondWritesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        def writes(x):
            self.b.add_(x)
            return x * 2

        return torch.cond(x.sum() > 0, writes, lambda x: x - 1, (x,))


class WhileLoopWritesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        def body_fn(i, acc):
            self.b.add_(acc)
            return i + 1, acc + 1

        return while_loop(lambda i, acc: i < 3, body_fn, (torch.tensor(0), x))[1]


@pytest.mark.parametrize("factory", [CondWritesBuffer, WhileLoopWritesBuffer])
def test_writes_to_captured_state_in_cond_or_while_loop_are_refused_like_torch(factory):
    """Export accepts these only under no_grad (and refuses a map body writing captured
    state at all); run_decompositions({}) then fails on them, so we refuse too."""
    calls = _calls((3,))
    with torch.no_grad():
        ep = torch.export.export(factory(), copy.deepcopy(calls[0]))
    with pytest.raises(Exception, match="is not functional"):
        copy.deepcopy(ep).run_decompositions({})
    error = refused_in_both_forms_of(ep, "opaque")
    assert "inside its subgraph" in str(error)
