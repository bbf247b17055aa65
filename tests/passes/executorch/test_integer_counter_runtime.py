"""An int64 counter quantized with XNNPACK's quantizer advances on ExecuTorch's runtime.

XNNPACK's quantizer makes the scalar of ``pos + 1`` a float32 constant; unless
PassQuantizer gives it back its integer dtype, the runtime prints ``Check failed
(a.scalar_type() == b.scalar_type()): dtype={Float, Long}`` on every call.
"""

from __future__ import annotations

import copy

import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch import decode_on_runtime
from passes.flow.examples import xnnpack_quantizer
from passes.quantization import quantize_program
from tests.models.counters import CountedCache, counted_cache_calls


def test_an_integer_counter_advances_on_the_runtime_without_a_dtype_check_failure(capfd):
    module = CountedCache()
    reference = copy.deepcopy(module)
    calls = counted_cache_calls(6, seed=1)
    with torch.no_grad():
        program = torch.export.export(module, calls[0])
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    quantized = quantize_program(functional, xnnpack_quantizer(), calls)
    steps = counted_cache_calls(5, seed=2)
    capfd.readouterr()
    decoded = decode_on_runtime(quantized, steps[0], steps)
    native = capfd.readouterr()
    assert "Check failed" not in native.out + native.err, native.err[-2000:]
    with torch.no_grad():
        for step, (args, got) in enumerate(zip(steps, decoded.trace.outputs, strict=True)):
            want, want_pos = reference(*args)
            assert got[1].dtype == torch.int64 and torch.equal(got[1], want_pos), step
            assert int(got[1]) == step + 1
            assert (got[0] - want).abs().max() < 0.1, step
