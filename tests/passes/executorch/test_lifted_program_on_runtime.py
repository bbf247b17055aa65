"""A program from quantize_program lowers to a ``.pte`` as it is (no re-export) and decodes
on ExecuTorch's runtime like the Python program: each step within one step of the output's
quantization grid, the KV caches persisting in the loaded program between calls."""

from __future__ import annotations

import copy

import torch

from pass_manager import run_program
from passes.executorch import decode_on_runtime
from passes.executorch.runtime import output_grid
from passes.flow.examples import decoder_job, xnnpack_quantizer
from passes.quantization import quantize_program


def test_a_quantized_program_decodes_on_the_runtime_without_a_re_export():
    model, example, steps = decoder_job(n_layers=1, steps=5)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), example, strict=True)
    quantized = quantize_program(ep, xnnpack_quantizer(), steps[:2])
    grid = output_grid(quantized)
    assert grid is not None and grid > 0
    expected = run_program(quantized, steps)
    decoded = decode_on_runtime(quantized, example, steps)
    assert decoded.delegates >= 1
    for step, (exp, act) in enumerate(zip(expected.outputs, decoded.trace.outputs, strict=True)):
        assert float((exp[0] - act[0]).abs().max()) <= grid, step
    # The caches are state on the runtime too: decoding every step from empty caches differs.
    fresh = [run_program(quantized, [args]).outputs[0][0] for args in steps]
    assert any(float((f - d[0]).abs().max()) > grid
               for f, d in zip(fresh[1:], decoded.trace.outputs[1:], strict=True))
