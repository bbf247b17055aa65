"""What quantize_program and quantize_methods say when given what they cannot take: a
non-quantizer (with a hint of what to pass) or calibration calls that do not fit the
program (naming the call, the method and the input; the original error chained)."""

from __future__ import annotations

import copy
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


class MasksByKind(torch.nn.Module):
    """Takes one attention mask per kind, ``None`` for a kind it has no layer of, as HF's
    exporter gives a Cohere2 / Gemma3 prefill (``{"full_attention": None,
    "sliding_attention": mask}``), and advances a position counter."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("position", torch.zeros((), dtype=torch.long))

    def forward(self, x, attention_mask, position_ids):
        self.position.add_(position_ids.shape[-1])
        return self.proj(x).masked_fill(~attention_mask["sliding_attention"], 0.0)


def test_a_none_input_among_the_calibration_inputs_is_no_misfit():
    """A ``None`` leaf is an input of the call spec but no placeholder: the inputs after it
    are checked against their own placeholders (it named the mask an int64 before)."""
    kwargs = {"x": torch.randn(1, 3, 4),
              "attention_mask": {"full_attention": None,
                                 "sliding_attention": torch.ones(1, 3, 4, dtype=torch.bool)},
              "position_ids": torch.arange(3).unsqueeze(0)}
    model = MasksByKind()
    program = torch.export.export(copy.deepcopy(model), (), copy.deepcopy(kwargs))
    calls = [copy.deepcopy(kwargs), copy.deepcopy(kwargs)]
    calls[1]["attention_mask"] = {"sliding_attention": torch.zeros(1, 3, 4, dtype=torch.bool),
                                  "full_attention": None}  # a caller's own key order
    quantized = quantize_program(program, xnnpack_quantizer(), calls)
    module = quantized.module()
    for call in calls * 2:
        with torch.no_grad():
            expected = model(**copy.deepcopy(call))
        torch.testing.assert_close(module(**copy.deepcopy(call)), expected, atol=0.05, rtol=0)
    assert int(quantized.state_dict["position"]) == int(model.position) == 12
    bad = copy.deepcopy(kwargs)
    bad["position_ids"] = bad["position_ids"].float()
    with pytest.raises(CalibrationInputError, match="is float32"):
        quantize_program(program, xnnpack_quantizer(), [bad])
    try:
        quantize_program(program, xnnpack_quantizer(), [bad])
    except CalibrationInputError as error:
        assert error.input == "position_ids", error.input


class _Float64Linear(torch.nn.Module):
    """A Linear and an accumulator, converted with ``.double()``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        return self.linear(x) + self.total


@pytest.mark.parametrize("helper", ["quantize_program", "quantize_methods"])
def test_a_float64_value_the_quantizer_observes_is_named_before_calibration(helper):
    """It calibrated, then failed inside convert_pt2e with an untyped AssertionError
    ("Expecting input to have dtype torch.float32"), the calibration left in the buffers."""
    model = _Float64Linear().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        program = torch.export.export(model, (x,))
    before = program.state_dict["total"].clone()
    with pytest.raises(QuantizationInputError) as caught:
        if helper == "quantize_program":
            quantize_program(program, xnnpack_quantizer(), [(x,)])
        else:
            quantize_methods({"forward": program}, xnnpack_quantizer(), [("forward", (x,), {})])
    error = caught.value
    # quantize_methods names the method, as its other errors do.
    argument = "program" if helper == "quantize_program" else "programs['forward']"
    assert (error.helper, error.argument) == (helper, argument)
    assert "torch.float64" in error.reason and ".float()" in error.reason
    assert "'x'" in error.reason or "'linear_weight'" in error.reason, error.reason
    assert torch.equal(program.state_dict["total"], before)  # nothing calibrated


@pytest.mark.parametrize("helper", ["quantize_program", "quantize_methods"])
def test_an_integer_counter_the_quantizer_annotates_is_left_out_of_quantization(helper):
    """ExecuTorch's CoreMLQuantizer annotates every ``add``, an int64 position counter's
    too (Hugging Face's ``cumulative_length``, a tiny Qwen2's ``arange + offset``): its
    fake-quantize raised inside the first calibration call (``CalibrationInputError:
    calibration[0]: ... not implemented for 'Long'``), then the flow refused the program
    (``QuantizationInputError``: "the quantizer observes 'pos', of dtype torch.int64").
    pt2e quantizes float values only: the counter's annotations are dropped, it stays an
    exact int64 counter, and the float linear beside it is quantized."""
    pytest.importorskip("coremltools")
    from tests.models.coreml_cases import coreml_quantizer
    from tests.models.counters import CountedCache, counted_cache_calls

    calls = counted_cache_calls(3, seed=1)
    with torch.no_grad():
        program = torch.export.export(CountedCache(), calls[0])
    quantizer = coreml_quantizer(("add", "linear"))
    if helper == "quantize_program":
        quantized = quantize_program(program, quantizer, calls)
    else:
        quantized = quantize_methods({"forward": program}, quantizer,
                                     [("forward", args, {}) for args in calls])["forward"]
    targets = {node.target for node in quantized.graph.nodes}
    assert torch.ops.quantized_decomposed.quantize_per_tensor.default in targets  # the linear
    module, eager = quantized.module(), CountedCache()
    with torch.no_grad():
        for args in calls:
            expected, got = eager(*args), module(*args)
            assert got[1].dtype == torch.int64 and torch.equal(got[1], expected[1])
            assert torch.allclose(got[0], expected[0], atol=1.0)  # quantized on 8 bits
    assert quantized.state_dict["pos"].dtype == torch.int64
    assert torch.equal(quantized.state_dict["pos"], eager.pos)


def _numpy(args):
    x, pos = args
    return x.numpy(), pos


def _number(args):
    x, _ = args
    return x, 4


@pytest.mark.parametrize("bad, input_name, reason", [
    (_numpy, "x", "is a numpy.ndarray: pass a torch.Tensor (torch.from_numpy(array)); the "
                  "program was exported with a tensor there (float32[1, 1, 32])"),
    (_number, "input_pos", "is an int: pass a torch.Tensor (torch.tensor(value)); the program "
                           "was exported with a tensor there (int64[1])"),
])
@pytest.mark.parametrize("helper", ["quantize_program", "quantize_methods"])
def test_a_calibration_input_that_is_no_tensor_is_named_before_anything_is_prepared(
        helper, bad, input_name, reason):
    """A numpy array (or a number) for a tensor input passed every check and failed inside
    the prepared program: "the prepared program raised AttributeError: 'numpy.ndarray'
    object has no attribute 'numel'", no input named."""
    programs, calls = decoder()
    with pytest.raises(CalibrationInputError) as caught:
        if helper == "quantize_program":
            quantize_program(programs["decode"], xnnpack_quantizer(), [bad(calls[1][1])])
        else:
            quantize_methods(programs, xnnpack_quantizer(),
                             [*calls[:2], ("decode", bad(calls[2][1]), {})])
    error = caught.value
    assert error.input == input_name and error.reason == reason, error.reason
    assert error.__cause__ is None  # found by the check, not raised by the prepared program


def test_a_keyword_naming_no_input_is_named_with_the_inputs():
    """It said "it gives 1 positional argument, the program takes 2" for a misspelt keyword."""
    programs, calls = decoder()
    x, pos = calls[1][1]
    with pytest.raises(CalibrationInputError) as caught:
        quantize_program(programs["decode"], xnnpack_quantizer(), [{"x": x, "pos": pos}])
    assert caught.value.reason == ("the program takes no input named 'pos'; its inputs are "
                                   "'x', 'input_pos'")


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor, scale: int) -> torch.Tensor:
        self.total.add_(self.linear(x).sum(0) * scale)
        return self.total * 1


def test_another_number_than_the_program_was_specialized_to_is_refused_before_prepare():
    """torch.export makes a Python number a constant: another one failed the prepared
    program's guard ("Guard failed: scale == 3") after prepare, the input unnamed."""
    x = torch.randn(2, 4)
    with torch.no_grad():
        program = torch.export.export(_Scaled(), (x, 3))
    with pytest.raises(CalibrationInputError) as caught:
        quantize_program(program, xnnpack_quantizer(), [(x, 3), (x, 5)])
    error = caught.value
    assert (error.step, error.input) == (1, "scale") and error.__cause__ is None
    assert "is 5; the program was exported with the constant 3" in error.reason


@pytest.mark.parametrize("given, shown", [
    (None, "is NoneType None, not a sequence of calls"),
    ("tensor", "is a Tensor float32[1, 1, 32], not a sequence of calls"),
    ("one call", "is one call's arguments (x, input_pos), not a sequence of calls: pass a "
                 "list of calls, e.g. [(x, input_pos)]"),
])
def test_calibration_that_is_no_sequence_of_calls_is_named(given, shown):
    """``None`` raised a bare TypeError ("'NoneType' object is not iterable"); a tensor was
    iterated row by row, and one call's ``(x, pos)`` read as two calls of one argument
    each ("calibration[0]: it gives 1 positional argument")."""
    programs, calls = decoder()
    x, pos = calls[1][1]
    calibration = {"tensor": x, "one call": (x, pos)}.get(given)
    with pytest.raises(QuantizationInputError) as caught:
        quantize_program(programs["decode"], xnnpack_quantizer(), calibration)
    assert caught.value.argument == "calibration" and shown in caught.value.reason


@pytest.mark.parametrize("given, shown", [
    (None, "is NoneType None, not a sequence of calls"),
    ("one call", "is one call ('decode', ...), not a sequence of calls"),
])
def test_method_calls_that_are_no_sequence_of_calls_are_named(given, shown):
    programs, calls = decoder()
    given = {"one call": calls[1]}.get(given)
    with pytest.raises(QuantizationInputError) as caught:
        quantize_methods(programs, xnnpack_quantizer(), given)
    assert caught.value.argument == "calls" and shown in caught.value.reason


@pytest.mark.parametrize("form, shown", [
    ("arguments alone", "is a tuple of 2 (Tensor float32[1, 1, 32], Tensor int64[1]), with no "
                        "method name first"),
    ("a tensor", "is a Tensor float32[1, 1, 32], with no method name first"),
    ("a dict", "is a dict {'x': Tensor float32[1, 1, 32]}, with no method name first"),
    ("unpacked", "is ('decode', then 2 values: a Tensor float32[1, 1, 32], a Tensor int64[1])"),
    ("the name alone", "is the method 'decode' alone"),
])
def test_a_call_that_is_no_method_call_is_described_in_a_few_words(form, shown):
    """Each printed the tensors' data (1,435 characters for a prefill's arguments alone,
    as "names method tensor([[[-0.8173, ..."), or said "kwargs is a Tensor, not a
    mapping" for ``('decode', x, pos)``; now the call, its kind and the call to write."""
    programs, calls = decoder()
    x, pos = calls[1][1]
    given = {"arguments alone": (x, pos), "a tensor": x, "a dict": {"x": x},
             "unpacked": ("decode", x, pos), "the name alone": "decode"}[form]
    with pytest.raises(QuantizationInputError) as caught:
        quantize_methods(programs, AnnotateEveryOpQuantizer(), [calls[0], given])
    reason = caught.value.reason
    assert caught.value.argument == "calls[1]" and shown in reason, reason
    assert "tensor(" not in reason and len(reason) < 300, reason
    assert "('decode', (x, input_pos))" in reason or "('prefill', (x, input_pos))" in reason
