"""Integer KV caches on ExecuTorch's runtime: serialized with their initial values, planned at
their integer size, decoded like the Python program.

The main job's decoder, quantized with the passes (XNNPACK quantizer), re-exported and
functionalized, then QuantizeMutableBuffers; lowered once with
``BufferOwningPartitioner(XnnpackPartitioner())`` and ``to_executorch()``. The planned bytes
are read from the ``.pte``'s execution plan; the loaded program decodes every step within
one step of the output's quantization grid of the Python program.
"""

from __future__ import annotations

import copy

import torch

from pass_manager import PassManager, run_program
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    QuantizeMutableBuffers,
    mutable_buffers,
)
from passes._analysis.quantized_state import state_storage
from passes.executorch.plan import planned_memory
from passes.executorch.runtime import decode_on_runtime, decode_pte, lower_to_pte, output_grid
from passes.flow.examples import decode_inputs, kv_decoder, xnnpack_quantizer
from passes.quantization import quantize_program
from tests.models.quantized_state import in_form, quantized_decoder

CACHES = ("layers.0.attn.k_cache", "layers.0.attn.v_cache")


def test_integer_caches_are_planned_at_their_size_and_decode_like_python():
    gm, example, _ = quantized_decoder("index_copy", "xnnpack")
    program = in_form(gm, example, "exported_program")
    float_bytes = {fqn: s.nbytes for fqn, s in state_storage(program).items()}
    PassManager([QuantizeMutableBuffers()]).run(program)
    grids = {fqn: mutable_buffers(program)[fqn].grid for fqn in CACHES}
    # Positions 0-7 hold a prompt's keys and values (integers of the grid), and decoding
    # goes on from position 8: the runtime must start from them, not from zeros.
    generator = torch.Generator().manual_seed(0)
    for fqn in CACHES:
        program.state_dict[fqn][:, :, :8] = torch.randint(
            -128, 128, (1, 2, 8, 16), generator=generator, dtype=torch.int8)
    calls = decode_inputs(kv_decoder(1)[0].cfg, 5, seed=3, start=8)

    pte, _, _ = lower_to_pte(program, example)
    plan = planned_memory(pte).by_name()
    assert set(plan) == set(CACHES)
    for fqn in CACHES:
        assert plan[fqn].dtype == "int8" and plan[fqn].shape == (1, 2, 16, 16)
        assert plan[fqn].nbytes * 4 == float_bytes[fqn] == 2048

    expected = run_program(copy.deepcopy(program), calls)
    decoded = decode_pte(pte, calls)
    grid = output_grid(program)
    assert grid is not None
    for step, (want, got) in enumerate(zip(expected.outputs, decoded.outputs, strict=True)):
        worst = max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True))
        assert worst <= grid, f"step {step}: {worst} > one grid step {grid}"
    # The first step already reads the prompt: from zeros it would differ.
    zeros = copy.deepcopy(program)
    for fqn in CACHES:
        zeros.state_dict[fqn].fill_(grids[fqn].zero_point)
    assert max(float((a - b).abs().max()) for a, b in zip(
        run_program(zeros, calls[:1]).outputs[0], decoded.outputs[0], strict=True)) > grid


class RingAttention(torch.nn.Module):
    """Attention over a ring buffer of keys and values: ``softmax(q @ keys.T) @ values``, a
    GEMM XNNPACK leaves at the top level (its activation is no dequantize), then the output
    projection, whose quantize of that GEMM's result XNNPACK's config marked fused."""

    def __init__(self, dim: int = 16, slots: int = 4):
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        with torch.no_grad():
            for layer in (self.q, self.k, self.v, self.o):  # biases too: not the global RNG
                layer.weight.copy_(torch.randn(dim, dim, generator=generator) / dim ** 0.5)
                layer.bias.copy_(torch.randn(dim, generator=generator) / dim ** 0.5)
        self.register_buffer("keys", torch.zeros(slots, dim), persistent=False)
        self.register_buffer("values", torch.zeros(slots, dim), persistent=False)
        self.register_buffer("pos", torch.zeros(1, dtype=torch.int64))
        self.slots = slots

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        slot = self.pos % self.slots
        self.keys.index_copy_(0, slot, self.k(hidden))
        self.values.index_copy_(0, slot, self.v(hidden))
        self.pos += 1
        attn = torch.softmax(self.q(hidden) @ self.keys.T, dim=-1) @ self.values
        return self.o(attn)


def test_integer_ring_attention_decodes_like_python_with_xnnpack():
    # XNNPACK dropped the quantize of the top-level GEMM's result and computed the output
    # projection from an uninitialized tensor: off by 1.5-3 on outputs of size ~1.
    generator = torch.Generator().manual_seed(1)
    calls = [(torch.randn(1, 16, generator=generator),) for _ in range(6)]  # wraps the ring
    with torch.no_grad():
        program = torch.export.export(RingAttention().eval(), calls[0], strict=True)
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    program = quantize_program(program, xnnpack_quantizer(), calls)
    PassManager([QuantizeMutableBuffers()]).run(program)
    assert {fqn: s.dtype for fqn, s in state_storage(program).items()
            if fqn != "pos"} == {"keys": torch.int8, "values": torch.int8}

    expected = run_program(copy.deepcopy(program), calls)
    decoded = decode_on_runtime(copy.deepcopy(program), None, calls)
    grid = output_grid(program)
    assert grid is not None
    for step, (want, got) in enumerate(zip(expected.outputs, decoded.outputs, strict=True)):
        worst = max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True))
        assert worst <= grid, f"step {step}: {worst} > one grid step {grid}"
    assert any("kept quantized_decomposed_quantize_per_tensor" in note and "fused into a GEMM"
               in note for note in decoded.notes), decoded.notes
