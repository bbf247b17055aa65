"""BufferOwningPartitioner in a user's own script: ``to_edge_transform_and_lower`` with the
wrapper, then ``to_executorch()`` and ExecuTorch's runtime, with none of our runtime helpers.

Kept in a file of its own that never imports :mod:`passes.executorch.runtime` (which loads
ExecuTorch's quantized kernels for itself): run alone, it sees what a user's script sees.
"""

from __future__ import annotations

import copy

import torch
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

from pass_manager import run_program

CALLS = 4


class ScaledByCount(torch.nn.Module):
    """A 0-d float counter scaling the input of a linear: XNNPACK cannot quantize the 0-d
    value itself, so the wrapper quantizes it at the top level."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.tensor(0.0))

    def forward(self, x):
        self.count.add_(1.0)
        return self.lin(x * self.count)


def test_a_quantize_the_wrapper_keeps_at_the_top_level_serializes_and_runs():
    """The wrapper keeps the 0-d counter's quantize out of the XNNPACK partition (docs:
    "0-d values with XNNPACK"); ExecuTorch's portable kernel then runs it, whose out variant
    only ``executorch.kernels.quantized`` registers. On 9f796bf nothing imported it, and a
    user's ``to_executorch()`` failed with ``RuntimeError: Missing out variants:
    {'quantized_decomposed::quantize_per_tensor'}``. Now it serializes, and ExecuTorch's
    runtime equals the quantized program bit for bit over 4 calls."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.runtime import Runtime

    from passes.executorch import BufferOwningPartitioner
    from passes.flow.examples import xnnpack_quantizer
    from passes.quantization import quantize_program

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    steps = [(torch.randn(2, 4, generator=generator),) for _ in range(CALLS)]
    with torch.no_grad():
        quantized = quantize_program(torch.export.export(ScaledByCount().eval(), steps[0]),
                                     xnnpack_quantizer(), steps)
        wrapper = BufferOwningPartitioner(XnnpackPartitioner())
        edge = to_edge_transform_and_lower(copy.deepcopy(quantized), partitioner=[wrapper])
        assert any("quantizing the 0-d b_count" in note for note in wrapper.notes), wrapper.notes
        signature = edge.exported_program().graph_signature
        state = [name for name, fqn in signature.inputs_to_buffers.items()
                 if fqn in signature.buffers_to_mutate.values()]
        pte = edge.to_executorch(
            ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(state)]))
    forward = Runtime.get().load_program(pte.buffer).load_method("forward")
    expected = run_program(copy.deepcopy(quantized), steps).outputs
    for step, (args, want) in enumerate(zip(steps, expected, strict=True)):
        (got,) = forward.execute(list(args))
        assert torch.equal(got, want[0]), (step, float((got - want[0]).abs().max()))
