"""State a program carries as an input/output pair, on ExecuTorch's runtime.

Static-shape backends take state as explicit I/O: the program returns the cache's next value
as an output instead of writing the input. A caller threads it by hand in eager; with the
pairing (``next_values`` / ``pair_by_name``, as InputsToBuffers takes it),
``decode_on_runtime`` and ``run_methods_on_runtime`` do the same: every step passing the same
cache tensor is given the output the previous call returned. Without a pairing, an output
that looks like an input's next value is an UnpairedStateError; on main 32e9d2d every step
silently got the cache the caller first passed (stale from the second step on).
"""

from __future__ import annotations

import pytest
import torch

from passes.errors import StateNameError, StatePairingError, UnpairedStateError
from passes.executorch import ExecuTorchInputError, decode_on_runtime, run_methods_on_runtime
from passes.executorch.runtime import lower_for_runtime
from tests.models.carried_state import NamedState, named_state_inputs
from tests.models.input_state import DIM, SEQ
from tests.models.paired_state import (
    paired_cache_calls,
    paired_cache_methods,
    thread_by_hand,
)

DECODES = 4


@pytest.fixture(scope="module")
def paired():
    return paired_cache_methods()


@pytest.fixture(scope="module")
def lowered_decode(paired):
    """The decode lowered once, decoded by several tests (pairs resolve on its program)."""
    return lower_for_runtime(paired[1]["decode"])


def _decode_steps(cache: torch.Tensor) -> list[tuple]:
    return [args for method, args, _ in paired_cache_calls(cache, DECODES, 1)
            if method == "decode"]


def _assert_threaded(outputs, carried, eager_outputs, eager_caches, atol=1e-5):
    assert len(outputs) == len(eager_outputs)
    for step, (got, want, state, cache) in enumerate(zip(
            outputs, eager_outputs, carried, eager_caches, strict=True)):
        torch.testing.assert_close(got[0], want, atol=atol, rtol=0, msg=f"step {step}")
        torch.testing.assert_close(got[1], cache, atol=atol, rtol=0, msg=f"step {step}")
        torch.testing.assert_close(state["cache"], cache, atol=atol, rtol=0)


@pytest.mark.parametrize("form", ["ExportedProgram", "LoweredProgram"])
def test_decode_threads_the_paired_cache_as_eager_by_hand(paired, lowered_decode, form):
    module, programs = paired
    cache = torch.zeros(SEQ, DIM)
    steps = _decode_steps(cache)
    program = programs["decode"] if form == "ExportedProgram" else lowered_decode
    run = decode_on_runtime(program, None, steps, next_values={"cache": "1"})
    outputs, caches = thread_by_hand({"decode": module}, [("decode", s, {}) for s in steps])
    _assert_threaded(run.outputs, run.carried, outputs, caches)
    # The state moved: the last cache holds every step's value, the first only one row.
    assert int((caches[-1].abs().sum(1) > 0).sum()) == DECODES
    assert torch.equal(cache, torch.zeros(SEQ, DIM))  # the caller's tensor is untouched


def test_decode_without_pairing_refuses_instead_of_a_stale_cache(paired):
    _, programs = paired
    with pytest.raises(UnpairedStateError) as caught:
        decode_on_runtime(programs["decode"], None, _decode_steps(torch.zeros(SEQ, DIM)))
    error = caught.value
    assert (error.input, error.output, error.helper) == ("cache", "1", "decode_on_runtime")
    assert "next_values={'cache': '1'}" in str(error)


def test_an_empty_pairing_says_there_is_no_such_state(paired, lowered_decode):
    module, _ = paired
    cache = torch.zeros(SEQ, DIM)
    steps = _decode_steps(cache)
    run = decode_on_runtime(lowered_decode, None, steps, next_values={})
    with torch.no_grad():  # every step from the cache given, as asked
        for got, step in zip(run.outputs, steps, strict=True):
            torch.testing.assert_close(got[0], module(*step)[0], atol=1e-5, rtol=0)
    assert run.carried == [{}] * DECODES


def test_pairing_errors_name_the_input_or_output(paired):
    _, programs = paired
    steps = _decode_steps(torch.zeros(SEQ, DIM))
    with pytest.raises(StateNameError, match="'kache'"):
        decode_on_runtime(programs["decode"], None, steps, next_values={"kache": "1"})
    with pytest.raises(StatePairingError, match="not its next value"):
        decode_on_runtime(programs["decode"], None, steps, next_values={"cache": "0"})


def test_one_tensor_for_two_paired_inputs_is_refused():
    class TwoCaches(torch.nn.Module):
        def forward(self, x, k, v):
            return x.sum(), k.index_copy(0, torch.tensor([0]), x), v.index_copy(
                0, torch.tensor([0]), 2 * x)

    zeros = torch.zeros(3, 2)
    program = torch.export.export(TwoCaches(), (torch.ones(1, 2), zeros, zeros.clone()))
    with pytest.raises(ExecuTorchInputError, match="'k' and 'v' are one tensor"):
        decode_on_runtime(program, None, [(torch.ones(1, 2), zeros, zeros)],
                          next_values={"k": "1", "v": "2"})


def test_keyword_state_paired_by_openvino_names():
    """Keyword dict inputs (flattened by the call spec) paired by prefix, as OpenVINO's
    stateful export pairs ``past_key_values.*`` with ``present.*``."""
    module = NamedState()
    args, kwargs = named_state_inputs()
    program = torch.export.export(module, args, kwargs)
    torch.manual_seed(2)
    state = kwargs["past_key_values"]
    steps = [((torch.randn(1, 1, 4),), {"past_key_values": state}) for _ in range(3)]
    with pytest.raises(UnpairedStateError, match="OpenVINO"):
        decode_on_runtime(program, None, steps)
    run = decode_on_runtime(program, None, steps,
                            pair_by_name=("past_key_values.", "present."))
    with torch.no_grad():
        carried = dict(state)
        for step, ((x,), _) in enumerate(steps):
            out = module(x, past_key_values=carried)
            carried = {"0.key": out["present.0.key"], "0.value": out["present.0.value"]}
            torch.testing.assert_close(run.outputs[step][0], out["logits"], atol=1e-5, rtol=0)
            torch.testing.assert_close(run.outputs[step][1], out["present.0.key"])
            torch.testing.assert_close(run.carried[step]["past_key_values_0_value"],
                                       out["present.0.value"])


def test_methods_thread_the_paired_cache_across_prefill_and_decodes(paired):
    module, programs = paired
    calls = paired_cache_calls(torch.zeros(SEQ, DIM), DECODES, 3)
    with pytest.raises(UnpairedStateError) as caught:
        run_methods_on_runtime(programs, calls)
    assert caught.value.method == "prefill"
    run = run_methods_on_runtime(programs, calls,
                                 next_values={m: {"cache": "1"} for m in programs})
    outputs, caches = thread_by_hand({"prefill": module, "decode": module}, calls)
    _assert_threaded(run.outputs, run.carried, outputs, caches)


def test_quantized_methods_thread_the_pair_as_python_does(paired):
    """quantize_methods (paired) then the runtime (paired): each call as the quantized
    programs threaded by hand in Python (measured: within 6e-8, the cache bit for bit)."""
    from passes.flow.examples import xnnpack_quantizer
    from passes.quantization import quantize_methods

    _, programs = paired
    pairing = {"cache": "1"}
    quantized = quantize_methods(programs, xnnpack_quantizer(),
                                 paired_cache_calls(torch.zeros(SEQ, DIM), 3, 7),
                                 next_values=pairing)
    calls = paired_cache_calls(torch.zeros(SEQ, DIM), DECODES, 8)
    run = run_methods_on_runtime(quantized, calls, next_values=pairing)
    outputs, caches = thread_by_hand({m: p.module() for m, p in quantized.items()}, calls)
    _assert_threaded(run.outputs, run.carried, outputs, caches)
    unthreaded, _ = thread_by_hand({m: p.module() for m, p in quantized.items()}, calls,
                                   cache_argument=99)  # what a stale cache gives
    assert (run.outputs[-1][0] - unthreaded[-1]).abs().max() > 1e-2
