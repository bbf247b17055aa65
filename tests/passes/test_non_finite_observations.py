"""A quantized value holding -inf (an attention mask kept as state) reads a finite value
once quantized: the mask hides nothing, and two quantized flows that both did so agree. One
holding torch.finfo(torch.float32).min stretches its grid until the scores it masks read 0.
quantize_program records each such value; the every-op quantizer leaves them in float."""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.errors import QuantizationFlowError
from passes.flow.examples import AnnotateEveryOpQuantizer, xnnpack_quantizer
from passes.quantization import quantize_methods, quantize_program
from tests.models.main_job import MaskedCacheAttention, masked_cache_steps
from tests.models.qnn import qnn_quantizer

FINFO_MIN = torch.finfo(torch.float32).min


def _worst_step_error(quantizer, fill=float("-inf"), steps=3):
    model, steps = MaskedCacheAttention(fill=fill).eval(), masked_cache_steps(steps)
    program = torch.export.export(copy.deepcopy(model), steps[0])
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    quantized, report = quantize_program(program, quantizer, steps, return_report=True)
    run = quantized.module()
    worst = max(float((model(*step) - run(*step)).abs().max()) for step in steps)
    return worst, report


def test_a_quantized_minus_inf_mask_is_recorded_naming_the_value():
    """torchao's XNNPACK quantizer observes the masked scores: their -inf became a finite
    value and the decode was 0.6 off eager, with nothing saying why."""
    worst, report = _worst_step_error(xnnpack_quantizer())
    assert worst > 0.1  # what the lines explain
    assert any(line.startswith("'add' held -inf at calibration[0]")
               for line in report.non_finite_reads), report.non_finite_reads
    assert "inf or NaN in calibration" in "\n".join(report.summary())
    assert report.to_dict()["non_finite_reads"] == report.non_finite_reads


def test_without_a_report_it_is_a_warning():
    model, steps = MaskedCacheAttention().eval(), masked_cache_steps(1)
    program = torch.export.export(model, steps[0])
    with pytest.warns(UserWarning, match=r"'add' held -inf at calibration\[0\].*no longer masks"):
        quantize_program(program, xnnpack_quantizer(), steps)


def test_the_every_op_quantizer_leaves_a_minus_inf_mask_in_float():
    """It quantized the mask's read (scale inf) and the decode was 1.48 off eager."""
    worst, report = _worst_step_error(AnnotateEveryOpQuantizer())
    assert report.non_finite_reads == []
    assert worst < 0.05


def test_a_finfo_min_mask_is_recorded_naming_the_value():
    """Finite, so nothing was said: the add's grid spans -3.4e38, the scores read 0 and the
    decode was 0.40 off eager (XNNPACK's quantizer; QnnQuantizer's 0.29)."""
    worst, report = _worst_step_error(xnnpack_quantizer(), FINFO_MIN, steps=4)
    assert worst > 0.1
    assert "'add' held -3.4e+38 at calibration[0]" in report.non_finite_reads, \
        report.non_finite_reads
    assert "+-65504 and beyond" in "\n".join(report.summary())


def test_the_every_op_quantizer_leaves_a_finfo_min_mask_in_float():
    """It quantized the mask's read and the add after it: 0.40 off eager."""
    worst, report = _worst_step_error(AnnotateEveryOpQuantizer(), FINFO_MIN, steps=4)
    assert report.non_finite_reads == []
    assert worst < 0.05


def test_an_observer_range_turned_nan_by_an_inf_is_a_typed_error_naming_the_value():
    """QnnQuantizer's moving-average observers make -inf's range NaN, and convert_pt2e
    failed with a bare AssertionError ("min nan should be less than max 0.0")."""
    with pytest.raises(QuantizationFlowError, match=r"'add' held -inf at calibration\[0\]") \
            as caught:
        _worst_step_error(qnn_quantizer(), steps=2)
    assert isinstance(caught.value.__cause__, AssertionError)


def test_a_minus_10000_mask_is_recorded_as_stretching_its_grid():
    """Older Hugging Face models mask with (1 - mask) * -10000.0: finite and below 65504, so
    nothing was said, while the scores it is added to read one value of the 8-bit grid and
    the decode was 0.41 off eager, as far as under finfo.min."""
    worst, report = _worst_step_error(xnnpack_quantizer(), -1e4, steps=4)
    assert worst > 0.1
    assert any(line.startswith("'add' held -1e+04, its other values within 0.0")
               for line in report.non_finite_reads), report.non_finite_reads


def test_a_mask_that_leaves_the_scores_their_grid_is_not_recorded():
    """-30 leaves the scores ~23 steps of the grid: 0.013 off eager, against 0.009 unmasked."""
    worst, report = _worst_step_error(xnnpack_quantizer(), -30.0, steps=4)
    assert worst < 0.02
    assert report.non_finite_reads == []


class _MaskedScores(torch.nn.Module):
    """Scaled scores over a KV cache (1/8, as over 64-wide heads), the unwritten positions
    masked_fill'ed with -inf."""

    def __init__(self, dim: int = 8, length: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.register_buffer("k_cache", torch.zeros(length, dim))

    def forward(self, x, pos):
        self.k_cache.index_copy_(0, pos, self.k(x))
        unwritten = torch.arange(self.k_cache.shape[0]) > pos.max()
        scores = (self.q(x) @ self.k_cache.T / 8).masked_fill(unwritten, float("-inf"))
        return torch.softmax(scores, -1)


def test_qnn_replacing_minus_inf_by_minus_255_is_recorded():
    """QnnQuantizer writes -255 for the mask's -inf: it masks, but the scores it is filled
    into spread over 0.37 of a step of their 8-bit grid, the attention reads nearly
    uniform (0.07 off eager), and nothing said so."""
    model, steps = _MaskedScores().eval(), masked_cache_steps(4)
    program = torch.export.export(copy.deepcopy(model), steps[0])
    quantized, report = quantize_program(program, qnn_quantizer(), steps, return_report=True)
    run = quantized.module()
    assert max(float((model(*step) - run(*step)).abs().max()) for step in steps) > 0.05
    assert any(line.startswith("'masked_fill' held -255, its other values within")
               for line in report.non_finite_reads), report.non_finite_reads


def test_quantize_methods_records_what_its_calls_quantize_off_any_grid():
    """quantize_methods calibrates along the calls over one state and said nothing of a -inf
    mask it quantized: only the main job, calibrating each method on its own, noted it."""
    model = MaskedCacheAttention().eval()
    generator = torch.Generator().manual_seed(1)
    prefill = (torch.randn(2, 8, generator=generator), torch.tensor([0, 1]))
    decode = (torch.randn(1, 8, generator=generator), torch.tensor([2]))
    programs = {"prefill": torch.export.export(copy.deepcopy(model), prefill),
                "decode": torch.export.export(copy.deepcopy(model), decode)}
    quantized = quantize_methods(programs, xnnpack_quantizer(),
                                 [("prefill", prefill), ("decode", decode)])
    for line in ("method 'prefill': 'add' held -inf at calls[0]",
                 "method 'decode': 'add' held -inf at calls[1]"):  # its own call, its own node
        assert line in quantized.non_finite_reads, quantized.non_finite_reads


def test_quantize_methods_names_the_value_when_convert_cannot_compute_its_grid():
    """QnnQuantizer's moving-average observer made the -inf's range NaN and convert_pt2e's
    bare AssertionError escaped quantize_methods."""
    model = MaskedCacheAttention().eval()
    steps = masked_cache_steps(2)
    programs = {"decode": torch.export.export(copy.deepcopy(model), steps[0])}
    with pytest.raises(QuantizationFlowError, match=r"method 'decode': 'add' held -inf"):
        quantize_methods(programs, qnn_quantizer(), [("decode", step) for step in steps])
