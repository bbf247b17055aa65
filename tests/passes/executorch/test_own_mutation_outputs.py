"""Functional programs whose new state value is also another output, lowered by ExecuTorch.

After MarkMutableBuffers + InplaceToFunctional each mutation output has a value of its own
(``aten.copy(state, value)`` for a value written twice or also returned). Before, one
value written into two buffers failed every ExecuTorch lowering with torch's
``SpecViolationError``. Each case is lowered with XNNPACK (alone and wrapped in
``BufferOwningPartitioner``) and run on ExecuTorch's runtime over several calls, equal to
eager (the models read their buffers before writing them, so the outputs check the state);
and lowered with Core ML taking over the buffers (lowering runs on Linux, running needs
macOS), checking which buffers the delegate owns and that the lowered program run in
Python equals eager.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import warnings

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower

from pass_manager import PassManager, assert_same_behaviour
from pass_manager.validation import output_errors, run_program
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch import (
    BufferOwningPartitioner,
    DelegateStateWarning,
    decode_on_runtime,
    executorch_state,
)
from passes.executorch.runtime import output_grid
from passes.flow.examples import xnnpack_quantizer
from passes.quantization import quantize_program
from tests.models.shared_values import (
    ReturnsCopies,
    ReturnsNewValue,
    ReturnsStateCopy,
    ReturnsWritten,
    ReturnsWrittenAndSum,
    WrittenTwice,
    WrittenTwiceAndReturned,
    vector_calls,
)

CASES = {
    "written_twice": WrittenTwice,
    "written_twice_and_returned": WrittenTwiceAndReturned,
    "returns_written": ReturnsWritten,
    "returns_written_and_sum": ReturnsWrittenAndSum,
    "returns_new_value": ReturnsNewValue,
}
ATOL = 1e-5
HAS_COREML = importlib.util.find_spec("coremltools") is not None


def _functional(cls, calls):
    ep = torch.export.export(cls(), calls[0])
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program


def _eager(cls, calls):
    return _eager_model(cls(), calls)


@pytest.mark.parametrize("wrapped", [True, False], ids=["wrapped", "alone"])
@pytest.mark.parametrize("case", CASES)
def test_xnnpack_on_the_runtime(case, wrapped):
    cls = CASES[case]
    calls = vector_calls(calls=4)
    program = _functional(cls, calls)
    partitioner = BufferOwningPartitioner(XnnpackPartitioner()) if wrapped else XnnpackPartitioner()
    decoded = decode_on_runtime(program, None, calls, partitioner=partitioner)
    assert decoded.delegates >= 1
    expected = _eager(cls, calls)
    assert len(decoded.trace.outputs) == len(expected)
    for step, (want, got) in enumerate(zip(expected, decoded.trace.outputs, strict=True)):
        assert len(want) == len(got)
        for w, g in zip(want, got, strict=True):
            assert torch.allclose(w, g, atol=ATOL, rtol=0), f"call {step}: {w} != {g}"


@pytest.mark.parametrize("functional", [False, True], ids=["as exported", "functional"])
@pytest.mark.parametrize("cls", [ReturnsStateCopy, ReturnsCopies], ids=lambda c: c.__name__)
def test_copies_of_state_and_inputs_returned_lower_with_xnnpack_and_run(cls, functional):
    """XNNPACK drops a clone it holds, and then refuses to return one value twice or an
    input (ExecuTorch 1.5.1 alone: "Output node ... is already in the inputs", nothing
    lowers); the wrapper keeps such copies at the top level. The runtime returns what eager
    returns, the copy of the state included, call after call."""
    calls = vector_calls(calls=4)
    torch.manual_seed(0)
    model = cls()
    expected = _eager_model(model, calls)
    with torch.no_grad():
        program = torch.export.export(model, calls[0])
    if functional:
        program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    wrapper = BufferOwningPartitioner(XnnpackPartitioner())
    decoded = decode_on_runtime(program, None, calls, partitioner=wrapper)
    assert decoded.delegates >= 1
    kept = [note for note in decoded.notes if "XNNPACK drops copies" in note]
    assert kept and kept == [note for note in wrapper.notes if "XNNPACK drops copies" in note]
    for step, (want, got) in enumerate(zip(expected, decoded.trace.outputs, strict=True)):
        assert len(want) == len(got)
        for w, g in zip(want, got, strict=True):
            assert torch.allclose(w, g, atol=ATOL, rtol=0), f"call {step}: {w} != {g}"


def _eager_model(model, calls):
    """The outputs of a copy of ``model`` called once per call, state carried along."""
    model = copy.deepcopy(model)
    outputs = []
    with torch.no_grad():
        for args in calls:
            out = model(*copy.deepcopy(args))
            outputs.append(tuple(t.clone() for t in (out if isinstance(out, tuple) else (out,))))
    return outputs


def test_quantized_written_twice_on_the_runtime():
    """quantize_program lifts the converted graph module (two write-backs of one value);
    the runtime computes what the quantized Python program computes, within one step of
    the output grid, call after call."""
    calls = vector_calls(calls=6)
    ep = torch.export.export(WrittenTwiceAndReturned(), calls[0])
    quantized = quantize_program(ep, xnnpack_quantizer(), calls)
    decoded = decode_on_runtime(quantized, None, calls)
    grid = output_grid(quantized)
    assert grid is not None
    assert max(output_errors(run_program(quantized, calls), decoded.trace)) <= grid + 1e-6


def _coreml(precision: str = "fp16"):
    import coremltools
    from executorch.backends.apple.coreml.compiler import CoreMLBackend
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner

    specs = CoreMLBackend.generate_compile_specs(
        minimum_deployment_target=coremltools.target.iOS18,
        compute_precision={"fp16": coremltools.precision.FLOAT16,
                           "fp32": coremltools.precision.FLOAT32}[precision])
    return CoreMLPartitioner(compile_specs=specs, take_over_mutable_buffer=True)


def _owned(lowered) -> set[str]:
    """The buffers Core ML's delegates own: written back inside their programs."""
    owned = set()
    for name, module in lowered.graph_module.named_children():
        if name.startswith("lowered_module"):
            owned |= set(module.original_module.graph_signature.buffers_to_mutate.values())
    return owned


# ExecuTorch's CoreMLPartitioner alone hands coremltools 9.0 a program its
# canonicalize_inplace_pattern pass fails on (KeyError from a stale op list): the last op
# of the MIL program computes a new state value of a program with two states (fp16
# compute), or one fp16 cast of one value feeds two states (fp32 compute).
# BufferOwningPartitioner reorders the program and gives each state its own value
# (passes.executorch.coreml_state_order), so the wrapped lowerings succeed.
COREML_CASES = {
    "written_twice": (WrittenTwice, {"a", "b"}, KeyError),
    "written_twice_and_returned": (WrittenTwiceAndReturned, {"a", "b"}, KeyError),
    "returns_written": (ReturnsWritten, {"b"}, None),
    "returns_written_and_sum": (ReturnsWrittenAndSum, {"b"}, None),
    "returns_new_value": (ReturnsNewValue, {"b"}, None),
}


def _lower_with_coreml(program, partitioner):
    logging.disable(logging.WARNING)  # coremltools' progress and fp16-state warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DelegateStateWarning)
            return to_edge_transform_and_lower(program, partitioner=[partitioner])
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.skipif(not HAS_COREML, reason="coremltools (the coreml extra) is not installed")
@pytest.mark.parametrize("wrapped", [True, False], ids=["wrapped", "alone"])
@pytest.mark.parametrize("case", COREML_CASES)
def test_core_ml_lowers_and_owns_the_buffers(case, wrapped):
    cls, written, alone_fails = COREML_CASES[case]
    calls = vector_calls(calls=4)
    program = _functional(cls, calls)
    if not wrapped and alone_fails is not None:
        with pytest.raises(alone_fails, match="coreml_update_state"):
            _lower_with_coreml(program, _coreml())
        return
    partitioner = BufferOwningPartitioner(_coreml()) if wrapped else _coreml()
    lowered = _lower_with_coreml(program, partitioner)
    ep = lowered.exported_program()
    assert _owned(ep) == written
    assert not ep.graph_signature.buffers_to_mutate  # nothing written back at top level
    lowered.to_executorch()
    # The lowered program run in Python (each delegate's Edge program) computes what
    # eager does, call after call, outputs and every buffer, bit for bit.
    assert_same_behaviour(cls(), ep, calls, atol=0, state=executorch_state)


@pytest.mark.skipif(not HAS_COREML, reason="coremltools (the coreml extra) is not installed")
@pytest.mark.parametrize("case", ["written_twice", "written_twice_and_returned"])
def test_core_ml_fp32_compute_owns_one_value_in_two_buffers(case):
    """With fp32 compute coremltools casts each state value to fp16 and merges the two
    equal casts of one value: each buffer needs a value of its own."""
    cls, written, _ = COREML_CASES[case]
    calls = vector_calls(calls=4)
    program = _functional(cls, calls)
    with pytest.raises(KeyError, match="coreml_update_state"):
        _lower_with_coreml(program, _coreml("fp32"))
    lowered = _lower_with_coreml(program, BufferOwningPartitioner(_coreml("fp32")))
    ep = lowered.exported_program()
    assert _owned(ep) == written
    assert_same_behaviour(cls(), ep, calls, atol=0, state=executorch_state)
