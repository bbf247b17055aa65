"""union_observer_ctr: a moving-average observer constructor becomes its min-max kind,
everything else it was built with kept."""

from __future__ import annotations

import torch
from torchao.quantization.pt2e.fake_quantize import FakeQuantize, FusedMovingAvgObsFakeQuantize
from torchao.quantization.pt2e.observer import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

from passes._analysis.union_observers import (
    averages_by_construction,
    class_name,
    union_observer_ctr,
)


def _kwargs(ctr) -> dict:
    return dict(ctr.p.keywords)


def test_moving_average_becomes_min_max_with_its_keywords():
    ctr = MovingAverageMinMaxObserver.with_args(eps=2 ** -12, averaging_constant=0.5)
    union = union_observer_ctr(ctr)
    assert union.p.func is MinMaxObserver
    assert _kwargs(union) == {"eps": 2 ** -12}  # averaging_constant is the average's only
    observer = union(dtype=torch.uint8, quant_min=0, quant_max=255)
    assert (observer.eps.item(), observer.quant_min, observer.quant_max) == (2 ** -12, 0, 255)
    # The union of two calls' ranges, where the average moved half way.
    for x in (torch.tensor([0.0, 1.0]), torch.tensor([0.0, 9.0])):
        observer(x)
    assert observer.max_val.item() == 9.0


def test_per_channel_keeps_its_axis():
    union = union_observer_ctr(MovingAveragePerChannelMinMaxObserver.with_args(ch_axis=1))
    assert union.p.func is PerChannelMinMaxObserver and _kwargs(union) == {"ch_axis": 1}
    assert union_observer_ctr(MovingAverageMinMaxObserver).p.func is MinMaxObserver


def test_fake_quantize_gets_a_min_max_observer():
    ctr = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, dtype=torch.uint8,
                                 qscheme=torch.per_tensor_symmetric)
    union = union_observer_ctr(ctr)
    assert union.p.func is FakeQuantize
    keywords = _kwargs(union)
    assert keywords.pop("observer").p.func is MinMaxObserver
    assert keywords == {"dtype": torch.uint8, "qscheme": torch.per_tensor_symmetric}
    assert isinstance(union(quant_min=0, quant_max=255).activation_post_process, MinMaxObserver)
    # FakeQuantize's default observer is the moving average.
    assert union_observer_ctr(FakeQuantize).p.keywords["observer"].p.func is MinMaxObserver
    assert class_name(union) == "FakeQuantize(MinMaxObserver)"


def test_union_observers_are_left():
    for ctr in (MinMaxObserver, MinMaxObserver.with_args(eps=1e-3), HistogramObserver,
                PerChannelMinMaxObserver, FakeQuantize.with_args(observer=MinMaxObserver)):
        assert union_observer_ctr(ctr) is None, ctr
        assert not averages_by_construction(ctr)


def test_a_fused_moving_average_fake_quantize_becomes_a_plain_one_with_min_max():
    """FusedMovingAvgObsFakeQuantize (XNNPACK's and QnnQuantizer's QAT activations) averages
    in its fused kernel whatever observer it holds: it becomes a plain FakeQuantize around
    the min-max observer, its other keywords kept, which keeps the union of two calls'
    ranges (the fused one, averaging by 0.01, had barely moved)."""
    fused = FusedMovingAvgObsFakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver, eps=2 ** -12, dtype=torch.qint8,
        qscheme=torch.per_tensor_affine)
    union = union_observer_ctr(fused)
    assert union.p.func is FakeQuantize and not averages_by_construction(fused)
    keywords = _kwargs(union)
    assert keywords.pop("observer").p.func is MinMaxObserver
    assert keywords == {"eps": 2 ** -12, "dtype": torch.qint8,
                        "qscheme": torch.per_tensor_affine}
    assert class_name(union) == "FakeQuantize(MinMaxObserver)"
    module = union(quant_min=-128, quant_max=127)
    before = fused(quant_min=-128, quant_max=127)
    for x in (torch.tensor([0.0, 1.0]), torch.tensor([0.0, 9.0])):
        module(x)
        before(x)
    assert module.activation_post_process.max_val.item() == 9.0
    assert before.activation_post_process.max_val.item() < 1.1
    # Its default observer (the moving average) is replaced too.
    default = union_observer_ctr(FusedMovingAvgObsFakeQuantize)
    assert default.p.func is FakeQuantize
    assert default.p.keywords["observer"].p.func is MinMaxObserver
