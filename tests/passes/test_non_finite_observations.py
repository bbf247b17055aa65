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
from passes.quantization import quantize_program
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
