"""What quantize_program and quantize_methods say when given what they cannot take: a
non-quantizer (with a hint of what to pass) or calibration calls that do not fit the
program (naming the call, the method and the input; the original error chained)."""

from __future__ import annotations

import functools

import pytest
import torch

from passes.errors import CalibrationInputError, QuantizationInputError
from passes.flow.examples import AnnotateEveryOpQuantizer, xnnpack_quantizer
from passes.quantization import PassQuantizer, quantize_methods, quantize_program
from tests.models.methods import decoder_methods


@functools.cache
def decoder():
    _, programs, calls = decoder_methods(n_layers=1, decodes=2)
    return programs, calls


def _torchao_config():
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig()


NOT_QUANTIZERS = {
    "None": (lambda: None, "NoneType None", "pass a torchao pt2e Quantizer instance"),
    "name": (lambda: "xnnpack", "str 'xnnpack'", "not looked up by name"),
    "factory": (lambda: xnnpack_quantizer, "the function xnnpack_quantizer",
                "call it: xnnpack_quantizer() returns the Quantizer"),
    "class": (lambda: AnnotateEveryOpQuantizer, "the class AnnotateEveryOpQuantizer",
              "pass an instance: AnnotateEveryOpQuantizer()"),
    "torchao config": (_torchao_config, "Int8WeightOnlyConfig",
                       "torchao config for quantize_() on an eager module"),
}


@pytest.mark.parametrize("given", NOT_QUANTIZERS)
@pytest.mark.parametrize("helper", ["quantize_program", "quantize_methods", "PassQuantizer"])
def test_a_non_quantizer_is_named_with_what_to_pass(helper, given):
    make, shown, hint = NOT_QUANTIZERS[given]
    programs, calls = decoder()
    with pytest.raises(QuantizationInputError) as caught:
        if helper == "quantize_program":
            quantize_program(programs["decode"], make(), [calls[1][1]])
        elif helper == "quantize_methods":
            quantize_methods(programs, make(), calls)
        else:
            PassQuantizer(make())
    error = caught.value
    assert (error.helper, error.argument) == (helper, "quantizer")
    assert shown in error.reason and hint in error.reason, error.reason
    assert isinstance(error, TypeError)  # as PassQuantizer's TypeError was


def _bad_dtype(args):
    x, pos = args
    return x, pos.float()


def _bad_size(args):
    x, pos = args
    return torch.randn(1, 2, x.shape[-1]), pos


@pytest.mark.parametrize("bad, input_name, reason", [
    (_bad_dtype, "input_pos", "is float32[1]; the program was exported with int64"),
    (_bad_size, "x", "is float32[1, 2, 32]; the program was exported for shape [1, 1, 32]"),
])
def test_a_calibration_call_that_does_not_fit_names_the_call_and_the_input(bad, input_name,
                                                                            reason):
    programs, calls = decoder()
    steps = [args for method, args, _ in calls if method == "decode"]
    wrong = [steps[0], bad(steps[1])]
    with pytest.raises(CalibrationInputError) as caught:
        quantize_program(programs["decode"], AnnotateEveryOpQuantizer(), wrong)
    error = caught.value
    assert (error.step, error.input, error.method) == (1, input_name, None)
    assert reason in error.reason, error.reason
    assert str(error).startswith(f"quantize_program: calibration[1], input {input_name!r}:")
    methods_calls = [*calls[:2], ("decode", bad(calls[2][1]), {})]
    with pytest.raises(CalibrationInputError) as caught:
        quantize_methods(programs, AnnotateEveryOpQuantizer(), methods_calls)
    error = caught.value
    assert (error.step, error.input, error.method) == (2, input_name, "decode")
    assert "calls[2] ('decode')" in str(error)


def test_a_call_the_prepared_program_raises_on_is_named_and_chained():
    """A value no dtype or shape check sees (a position past the cache's end): the
    prepared program's own error, with the call's index, chained."""
    programs, calls = decoder()
    x, _ = calls[1][1]
    wrong = [calls[1][1], (x, torch.tensor([10_000]))]
    before = {name: value.clone() for name, value in programs["decode"].state_dict.items()}
    with pytest.raises(CalibrationInputError) as caught:
        quantize_program(programs["decode"], AnnotateEveryOpQuantizer(), wrong)
    for name, value in before.items():  # the first call's writes were put back
        assert torch.equal(programs["decode"].state_dict[name], value), name
    error = caught.value
    assert error.step == 1 and error.input is None
    assert "the prepared program raised" in error.reason
    assert error.__cause__ is not None and type(error.__cause__).__name__ in error.reason
