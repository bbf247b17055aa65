"""The main job's Python entries given what they cannot take: refused before any stage,
naming the argument and what to pass, not a bare TypeError, a late report, or silence."""

from __future__ import annotations

import pytest
import torch

from pass_manager import ValidationInputError
from passes.errors import QuantizationInputError
from passes.flow.examples import xnnpack_quantizer
from passes.flow.factory import methods_spec, model_spec
from passes.flow.run import run_flow
from passes.flow.run_methods import run_methods_flow
from tests.models.main_job import RunningSum

X = (torch.ones(2, 4),)


def _flow(**options):
    return run_flow(RunningSum(torch.float32), X, options.pop("steps", [X, X]),
                    delegate=False, log=lambda line: None, **options)


@pytest.mark.parametrize(("argument", "value", "said"), [
    ("steps", 5, "is int 5, not a list of calls"),  # was: 'int' object is not iterable
    ("calibration", 5, "is int 5, not a list of calls"),
    # was: the tensor's rows taken as calls, refused (or run) as calls of another shape
    ("steps", torch.ones(2, 4), "is a tensor, not a list of calls"),
    ("calibration", torch.ones(2, 4), "is a tensor, not a list of calls"),
    ("calibration", [], "gives no call"),  # was: a QuantizationInputError after the decodes
])
def test_steps_or_calibration_that_are_no_calls_are_refused_naming_the_argument(
        argument, value, said):
    with pytest.raises(ValidationInputError) as info:
        _flow(**{argument: value})
    assert f"run_flow({argument}=...)" in str(info.value) and said in str(info.value)


def test_steps_none_is_the_example_once_as_an_empty_list_is():
    """Documented as the default; None raised 'NoneType' object is not iterable."""
    result = _flow(steps=None, quantize=False)
    assert result.ok and len(result.step_errors["fp32 pipeline"]) == 1


def test_an_unknown_runtime_is_refused_not_decoded_in_python_alone():
    """runtime='ExecuTorch' (or a typo) silently skipped the runtime stage."""
    with pytest.raises(ValueError, match="runtime='ExecuTorch': takes 'python'"):
        _flow(runtime="ExecuTorch")
    spec = methods_spec({"module": RunningSum(torch.float32),
                         "methods": {"forward": {"example_args": X}}}, "job", 1)
    with pytest.raises(ValueError, match="run_methods_flow: runtime='pte'"):
        run_methods_flow(spec, runtime="pte", log=lambda line: None)


@pytest.mark.parametrize("given", [xnnpack_quantizer(), None])
def test_a_quantizer_where_its_factory_goes_is_refused_before_any_stage(given):
    """A Quantizer instance failed in the stage 'quantize with the passes' (after export
    and the fp32 decodes) with TypeError: 'XNNPACKQuantizer' object is not callable."""
    with pytest.raises(QuantizationInputError) as info:
        _flow(quantizer_factory=given)
    assert info.value.argument == "quantizer_factory"
    assert "not a function returning a Quantizer" in info.value.reason
    assert ("an instance of XNNPACKQuantizer" in info.value.reason) == (given is not None)


@pytest.mark.parametrize("given", ["model_spec", "mapping"])
def test_methods_flow_given_no_methods_spec_says_what_it_takes(given):
    """As run_model says of what it cannot take; a ModelSpec failed in the stage 'export
    each method' with AttributeError: 'ModelSpec' object has no attribute 'programs', the
    factory's mapping with a bare AttributeError."""
    made = {"module": RunningSum(torch.float32), "methods": {"forward": {"example_args": X}}}
    spec = model_spec((made["module"], X), "job", 1) if given == "model_spec" else made
    with pytest.raises(TypeError, match=r"run_methods_flow takes methods_spec\(factory\(\)"):
        run_methods_flow(spec, log=lambda line: None)
