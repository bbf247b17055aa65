"""quantize_methods on methods carrying their cache as an input written in place (the
Hugging Face exporter's form): calibrated along the calls with the caller's one cache
tensor threaded through them, as deployment threads it, and the cache on one grid in
both methods; a prepared method that would not write the caller's tensor back is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager
from pass_manager.validation import copy_program
from passes import InplaceToFunctional, InputStateError, MarkMutableBuffers
from passes._methods.calls import carried_inputs, check_write_backs
from passes.flow.examples import xnnpack_quantizer
from passes.quantization import _flow_quantizer, _MethodQuantizer, _prepare, quantize_methods
from tests.models.input_state import DIM, SEQ, input_cache_calls, input_cache_methods


def _grid_of_cache_writes(program):
    """(scale, zero point) of the values each ``index_copy`` writes into the cache."""
    found = set()
    for node in program.graph.nodes:
        if "index_copy" in str(node.target):
            value = node.args[3]
            assert "dequantize_per_tensor" in str(value.target), value.target
            found.add((float(value.args[1]), int(value.args[2])))
    assert len(found) == 1, found
    return found.pop()


@pytest.mark.parametrize("functional", [False, True], ids=["in place", "functional"])
def test_a_cache_passed_as_an_input_is_calibrated_along_the_calls_on_one_grid(
        functional, monkeypatch):
    """As exported (``index_copy_`` on the input) and functional (a USER_INPUT_MUTATION
    output). Afterwards the caller's tensor holds what it held before calibration."""
    import passes.quantization

    seen = []  # the caller's cache after each calibration call
    run_call = passes.quantization.run_calibration_call

    def spied(call, args, kwargs, *where):
        result = run_call(call, args, kwargs, *where)
        seen.append(args[2].clone())  # (tokens, positions, cache)
        return result

    monkeypatch.setattr(passes.quantization, "run_calibration_call", spied)
    module, programs = input_cache_methods()
    if functional:
        programs = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            programs).programs
        assert all(spec.kind.name == "USER_INPUT_MUTATION" for program in programs.values()
                   for spec in program.graph_signature.output_specs[:1])
    reference = copy.deepcopy(module)
    calibration_cache = torch.zeros(SEQ, DIM)
    calibration = [call for seed in range(1, 9)
                   for call in input_cache_calls(calibration_cache, 4, seed)]
    quantized = quantize_methods(copy_program(programs), xnnpack_quantizer(), calibration)

    # The calibration ran on the caller's tensor, threaded from call to call: after the
    # last call it held what eager's calls leave in a cache (the prepared methods compute
    # in fp32); then it was put back, bit for bit.
    eager_cache = torch.zeros(SEQ, DIM)
    with torch.no_grad():
        for _, args, kwargs in input_cache_calls(eager_cache, 4, 8):
            reference(*args, **kwargs)
    assert len(seen) == len(calibration) and seen[-1].any()
    assert torch.allclose(seen[-1], eager_cache, atol=1e-6)
    assert torch.equal(calibration_cache, torch.zeros(SEQ, DIM))

    assert quantized.shared_inputs == {"input cache": {"prefill": "cache", "decode": "cache"}}
    assert quantized.observers["input cache"] >= 2
    assert _grid_of_cache_writes(quantized["prefill"]) == \
        _grid_of_cache_writes(quantized["decode"])

    methods = {name: program.module() for name, program in quantized.items()}
    cache, expected_cache = torch.zeros(SEQ, DIM), torch.zeros(SEQ, DIM)
    with torch.no_grad():
        for seed in (20, 21):
            expected = input_cache_calls(expected_cache, 4, seed)
            for (method, args, kwargs), (_, eargs, _) in zip(
                    input_cache_calls(cache, 4, seed), expected, strict=True):
                got, want = methods[method](*args, **kwargs), reference(*eargs)
                assert (got - want).abs().max() < 0.1, (method, seed)
                assert (cache - expected_cache).abs().max() < 0.1, (method, seed)
    assert cache.any()


def test_a_method_that_would_not_write_the_callers_tensor_back_is_refused():
    _, programs = input_cache_methods()
    calls = input_cache_calls(torch.zeros(SEQ, DIM), 1, 1)
    carried = carried_inputs(programs, calls)
    assert carried == {"prefill": {"cache": "input cache"}, "decode": {"cache": "input cache"}}
    prepared = {}
    for name, program in copy_program(programs).items():
        prepared[name] = _prepare(program, _flow_quantizer(xnnpack_quantizer(),
                                                           _MethodQuantizer),
                                  "quantize_methods")
    check_write_backs(prepared, carried)  # both write the cache back
    graph = prepared["decode"].graph
    write_back = next(n for n in graph.nodes if n.target is torch.ops.aten.copy_.default)
    graph.erase_node(write_back)
    with pytest.raises(InputStateError) as caught:
        check_write_backs(prepared, carried)
    error = caught.value
    assert (error.method, error.input, error.argument) == (
        "decode", "cache", "programs['decode'], input 'cache'")
    assert "passes.InputsToBuffers" in str(error)


class _Past(torch.nn.Module):
    """The decode of :class:`InputCache` with its cache input named ``past``."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, pos: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.inner(x, pos, past)


def test_a_cache_passed_by_keyword_is_the_same_state_as_passed_by_position():
    """The decode names the cache ``past``, the prefill ``cache``; calibration passes one
    tensor to both, the decode's by keyword (``past=cache``, which the prepared method
    binds). Before, the keyword was not found where the calls were read: the two inputs
    were two states, each on a grid of its own ((0.00743, 20) in the prefill, (0.00739, 0)
    in the decode) and ``shared_inputs`` was empty."""
    module, programs = input_cache_methods()
    with torch.no_grad():
        programs["decode"] = torch.export.export(
            _Past(module), input_cache_calls(torch.zeros(SEQ, DIM), 1, 0)[1][1])
    cache = torch.zeros(SEQ, DIM)
    positional = [call for seed in (1, 2) for call in input_cache_calls(cache, 4, seed)]
    by_keyword = [(m, args[:2], {"past": args[2]}) if m == "decode" else (m, args, kwargs)
                  for m, args, kwargs in positional]
    expected = quantize_methods(copy_program(programs), xnnpack_quantizer(), positional)
    quantized = quantize_methods(copy_program(programs), xnnpack_quantizer(), by_keyword)
    assert quantized.shared_inputs == expected.shared_inputs == {
        "input cache": {"prefill": "cache", "decode": "past"}}
    assert _grid_of_cache_writes(quantized["prefill"]) == \
        _grid_of_cache_writes(quantized["decode"])
    got, want = torch.zeros(SEQ, DIM), torch.zeros(SEQ, DIM)
    with torch.no_grad():
        for (method, args, _), (_, wargs, _) in zip(input_cache_calls(got, 3, 20),
                                                    input_cache_calls(want, 3, 20), strict=True):
            assert torch.equal(quantized[method].module()(*args),
                               expected[method].module()(*wargs)), method
            assert torch.equal(got, want), method
    assert got.any()
