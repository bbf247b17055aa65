"""Quantize and dequantize nodes whose ExecuTorch 1.5.1 portable kernel aborts the process.

QnnQuantizer annotates the cast writing a bfloat16 buffer, so its quantized program
quantizes a bfloat16 value and dequantizes to bfloat16; XNNPACK takes neither, so both run
at the top level on ``executorch.kernels.quantized``, which takes float32 and float16 only
and aborts the whole process on bfloat16 (``Unhandled input dtype 15``). The runtime
helpers refuse such a program with a typed error before serializing it; the same model
with float32 or float16 state runs on the runtime as the Python program does.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from pass_manager import run_program
from passes.executorch import PortableKernelAbortError, PortableKernelAbortWarning
from passes.executorch.methods import run_methods_on_runtime
from passes.executorch.runtime import decode_on_runtime
from passes.quantization import quantize_program
from tests.models.qnn import qnn_quantizer

CALLS = 4


class Total(torch.nn.Module):
    """A running total stored in ``dtype``, returned in float32 beside ``2 * x``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4, dtype=dtype))

    def forward(self, x):
        self.total.add_(x.to(self.total.dtype))
        return x * 2, self.total.float()


def _steps() -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.rand(4, generator=generator),) for _ in range(CALLS)]


def _quantized(dtype: torch.dtype) -> torch.export.ExportedProgram:
    steps = _steps()
    with torch.no_grad():
        return quantize_program(torch.export.export(Total(dtype), steps[0]), qnn_quantizer(),
                                steps)


@pytest.mark.parametrize("form", ["exported", "edge", "executorch"])
def test_a_bfloat16_quantize_at_the_top_level_is_refused_before_it_aborts(form):
    """On 1e863ae ``decode_on_runtime`` serialized the program and ran it, and ExecuTorch's
    quantize kernel aborted the Python process (``op_quantize.cpp: Unhandled input dtype
    15``, exit status 134) in its first call. Now a typed error names the node and the
    dtype before serializing, whether the helper lowers it (XNNPACK, which leaves the node
    at the top level) or is given the portable lowering (``to_edge``, no partitioner), as an
    Edge program or already serialized (``to_executorch()``, whose graph it still reads)."""
    program = _quantized(torch.bfloat16)
    # The Python program runs: the refusal is about ExecuTorch's kernel only.
    run_program(copy.deepcopy(program), _steps())
    if form != "exported":
        from executorch.exir import to_edge

        with torch.no_grad():
            program = to_edge(copy.deepcopy(program))
            if form == "executorch":
                program = program.to_executorch()
    with pytest.raises(PortableKernelAbortError) as caught:
        decode_on_runtime(program, None, _steps())
    error = caught.value
    assert error.dtype == torch.bfloat16 and error.method == "forward"
    assert error.helper == "decode_on_runtime" and error.node in str(error)
    assert "quantize_per_tensor" in str(error) and "bfloat16" in str(error)


def test_a_bfloat16_quantize_is_refused_in_every_method():
    """``run_methods_on_runtime`` checks each method's top level the same way."""
    program = _quantized(torch.bfloat16)
    with pytest.raises(PortableKernelAbortError) as caught:
        run_methods_on_runtime({"forward": program}, [("forward", s, {}) for s in _steps()])
    assert caught.value.method == "forward"
    assert caught.value.helper == "run_methods_on_runtime"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float32_and_float16_state_runs_on_the_runtime_like_python(dtype):
    """The dtypes the kernels take are not refused: the runtime equals the quantized Python
    program bit for bit over 4 calls, the output and the total (the state) it returns."""
    program = _quantized(dtype)
    steps = _steps()
    expected = run_program(copy.deepcopy(program), steps).outputs
    run = decode_on_runtime(copy.deepcopy(program), None, steps)
    for step, (got, want) in enumerate(zip(run.outputs, expected, strict=True)):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (step, float((a - b).abs().max()))
    # The total grows from the first call on (QnnQuantizer's grid, calibrated on the first
    # call by its moving average, then saturates): the state is carried between calls.
    totals = [out[1] for out in run.outputs]
    assert bool((totals[1] > totals[0]).any()) and bool(totals[0].any())


@pytest.mark.parametrize(("dtype", "warned"), [(torch.bfloat16, True), (torch.float32, False)])
def test_the_wrapper_warns_of_a_kernel_that_would_abort_in_a_users_script(dtype, warned):
    """A script of one's own (``to_edge_transform_and_lower`` with the wrapper, then
    ``to_executorch()``) gets no runtime helper's check: on 1e863ae it lowered silently and
    the ``.pte`` aborted the process in its first call. The wrapper now warns, naming each
    bfloat16 quantize or dequantize left at the top level (none for float32 state)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from passes.executorch import BufferOwningPartitioner
    from passes.executorch.portable_kernels import aborting_kernels

    program = _quantized(dtype)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        edge = to_edge_transform_and_lower(
            copy.deepcopy(program), partitioner=[BufferOwningPartitioner(XnnpackPartitioner())])
    named = sorted(w.message.node for w in caught
                   if isinstance(w.message, PortableKernelAbortWarning))
    left = sorted(node.name for node, *_ in aborting_kernels(edge.exported_program()))
    assert named == left
    assert bool(named) == warned
    if warned:
        assert any("quantize_per_tensor" in name for name in named), named


def _per_channel_cache(scales: torch.dtype, zero_points: torch.dtype):
    """A cache quantized by hand per channel on a grid of the given dtypes (torch's
    reference takes any), and three calls writing positions 0, 1, 2."""
    from tests.models.quantized_state import PerChannelCache

    model = PerChannelCache()
    model.register_buffer("scales", model.scales.to(scales))
    model.register_buffer("zero_points", model.zero_points.to(zero_points))
    generator = torch.Generator().manual_seed(0)
    steps = [(torch.randn(2, 1, 4, generator=generator), torch.tensor([i])) for i in range(3)]
    with torch.no_grad():
        return model, torch.export.export(copy.deepcopy(model), steps[0]), steps


@pytest.mark.parametrize(("scales", "zero_points", "side"),
                         [(torch.float32, torch.int64, "scales"),
                          (torch.float64, torch.int32, "zero points")])
def test_a_per_channel_grid_of_other_dtypes_is_refused_before_it_aborts(scales, zero_points,
                                                                         side):
    """On cc54dca ``decode_on_runtime`` ran it and ExecuTorch's per-channel quantize kernel
    aborted the process (``op_quantize.cpp: scale.scalar_type() 6 is not double type``):
    the kernels take float64 scales and int64 zero points only."""
    _, program, steps = _per_channel_cache(scales, zero_points)
    run_program(copy.deepcopy(program), steps)  # Python runs it
    with pytest.raises(PortableKernelAbortError) as caught:
        decode_on_runtime(program, None, steps)
    error = caught.value
    assert error.dtype == (scales if side == "scales" else zero_points)
    assert f"its {side} are" in str(error) and "per_channel" in str(error), str(error)


def test_a_per_channel_grid_of_float64_scales_and_int64_zero_points_runs():
    """The grid the kernels take is not refused: the runtime decodes as eager does."""
    model, program, steps = _per_channel_cache(torch.float64, torch.int64)
    run = decode_on_runtime(program, None, steps)
    for step, (got, want) in enumerate(zip(run.outputs, (model(*s) for s in steps),
                                           strict=True)):
        assert torch.allclose(got[0], want[0], atol=1e-6), step
