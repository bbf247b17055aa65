"""run_methods, the Python reference of run_methods_on_runtime, threads state carried as an
input/output pair when told the pairing: as a caller threading the returned cache by hand;
and, once InputsToBuffers made that state resident in every method, shares it."""

from __future__ import annotations

import pytest
import torch

from pass_manager import PassManager, ValidationInputError
from passes import InputsToBuffers
from passes._methods.in_turn import run_methods
from tests.models.input_state import DIM, SEQ
from tests.models.paired_state import paired_cache_calls, paired_cache_methods, thread_by_hand


def test_paired_cache_threaded_as_by_hand():
    module, programs = paired_cache_methods()
    cache = torch.zeros(SEQ, DIM)
    calls = paired_cache_calls(cache, 4, 2)
    trace = run_methods(programs, calls, next_values={"cache": "1"})
    outputs, caches = thread_by_hand({"prefill": module, "decode": module}, calls)
    for got, out, new in zip(trace.outputs, outputs, caches, strict=True):
        torch.testing.assert_close(got[0], out, atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1], new, atol=1e-6, rtol=0)
    unpaired = run_methods(programs, calls)  # as eager: every call given the zero cache
    assert (unpaired.outputs[-1][1].abs().sum(1) > 0).sum() == 1
    assert torch.equal(cache, torch.zeros(SEQ, DIM))


def test_pairs_need_exported_methods():
    module, _ = paired_cache_methods()
    with pytest.raises(ValidationInputError, match="ExportedProgram"):
        run_methods({"decode": module}, [], next_values={"cache": "1"})


def test_state_inputs_to_buffers_makes_in_the_methods_is_one_tensor():
    """InputsToBuffers run on the mapping makes the paired cache a resident buffer in the
    prefill and in the decode; the device shares it by name. Before, each method kept a
    ``cache`` tensor of its own, so the decode called after the prefill (``.module()`` each,
    or run_methods) read a zero cache: off the threaded eager calls by 0.39 to 0.54."""
    module, programs = paired_cache_methods()
    result = PassManager([InputsToBuffers(next_values={"cache": "1"}, buffers=["cache"])]).run(
        programs)
    resident = result.programs
    assert resident["prefill"].constants["cache"] is resident["decode"].constants["cache"]
    assert result.notes["reshared"] == ["cache"]
    calls = paired_cache_calls(torch.zeros(SEQ, DIM), 3, 5)
    outputs, caches = thread_by_hand({"prefill": module, "decode": module}, calls)
    trace = run_methods(resident, [(method, args[:2], kwargs) for method, args, kwargs in calls])
    for index, (got, out, new) in enumerate(zip(trace.outputs, outputs, caches, strict=True)):
        torch.testing.assert_close(got[0], out, atol=1e-6, rtol=0)
        torch.testing.assert_close(trace.buffers[index]["cache"], new, atol=1e-6, rtol=0)
