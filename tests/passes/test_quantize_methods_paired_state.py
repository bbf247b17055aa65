"""quantize_methods on state carried as an input/output pair (the method returns the cache's
next value; the caller passes the same cache tensor to every call).

Paired (``next_values``, as InputsToBuffers takes it), the calibration calls thread the
returned cache into the next call as deployment does, so the observers measure what a
deployed decode computes: the grids are exactly those of a calibration given the threaded
caches by hand. The input and its output are one state on one grid. Unpaired, the methods
are refused: on main 32e9d2d every call was calibrated on the stale cache the caller passed.
"""

from __future__ import annotations

import pytest
import torch

from passes.errors import UnpairedStateError
from passes.flow.examples import AnnotateEveryOpQuantizer, xnnpack_quantizer
from passes.quantization import quantize_methods
from tests.models.input_state import DIM, SEQ
from tests.models.paired_state import (
    SummedPairedCache,
    paired_cache_calls,
    paired_cache_methods,
    thread_by_hand,
)

PAIRED = {"cache": "1"}


def _grids(program) -> dict[str, tuple]:
    """Each value quantized, by the name of the node computing it: its grid; the value
    written into the cache as ``"state"``."""
    found = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and str(node.target).endswith(
                "quantize_per_tensor.default") and "dequantize" not in str(node.target):
            writes = any(u.target is torch.ops.aten.index_copy.default
                         for d in node.users for u in d.users)
            found["state" if writes else node.args[0].name] = tuple(node.args[1:3])
    return found


def test_unpaired_state_is_refused_naming_method_input_and_output():
    _, programs = paired_cache_methods()
    calls = paired_cache_calls(torch.zeros(SEQ, DIM), 2, 1)
    with pytest.raises(UnpairedStateError) as caught:
        quantize_methods(programs, xnnpack_quantizer(), calls)
    assert (caught.value.method, caught.value.input, caught.value.output) == (
        "prefill", "cache", "1")


def test_calibration_threads_the_pair_as_by_hand():
    """Same cache tensor + pairing == each call given the eager-threaded cache by hand."""
    module, programs = paired_cache_methods(2, SummedPairedCache)
    cache = torch.zeros(SEQ, DIM)
    calls = paired_cache_calls(cache, 3, 4)
    threaded = quantize_methods(programs, xnnpack_quantizer(), calls, next_values=PAIRED)
    _, caches = thread_by_hand({"prefill": module, "decode": module}, calls)
    by_hand = [(m, (a[0], a[1], caches[i - 1] if i else a[2]), k)
               for i, (m, a, k) in enumerate(calls)]
    given = quantize_methods(programs, xnnpack_quantizer(), by_hand, next_values={})
    stale = quantize_methods(programs, xnnpack_quantizer(), calls, next_values={})
    grids = {name: {m: _grids(q[m]) for m in programs}
             for name, q in (("threaded", threaded), ("given", given), ("stale", stale))}
    for method in programs:  # every grid but the state's is the by-hand calibration's
        for name in grids:
            grids[name][method].pop("state")
        assert grids["threaded"][method] == grids["given"][method]
    # One state, one grid: the value written into the cache in both methods (calibrated
    # apart, by hand, the two methods' writes got two grids).
    assert _grids(threaded["prefill"])["state"] == _grids(threaded["decode"])["state"]
    assert _grids(given["prefill"])["state"] != _grids(given["decode"])["state"]
    # Calibrating on the stale cache gives the cache-reading layer another grid.
    assert grids["threaded"]["decode"]["sum_1"] != grids["stale"]["decode"]["sum_1"]
    assert torch.equal(cache, torch.zeros(SEQ, DIM))  # the caller's tensor is not written
    assert threaded.shared_inputs == {"input cache": {"prefill": "cache", "decode": "cache"}}


def test_the_input_and_its_next_value_share_one_grid_and_stay_close_to_eager():
    module, programs = paired_cache_methods(0)
    calls = paired_cache_calls(torch.zeros(SEQ, DIM), 4, 5)
    quantized = quantize_methods(programs, AnnotateEveryOpQuantizer(), calls,
                                 next_values=PAIRED)
    for method, program in quantized.items():
        cache = next(n for n in program.graph.nodes if n.name == "cache")
        read = next(iter(cache.users))  # the input quantized where it is read
        assert "quantize_per_tensor" in str(read.target), method
        returned = program.graph.output_node().args[0][1]
        assert "dequantize_per_tensor" in str(returned.target), method
        assert read.args[1:] == returned.args[1:], method  # one grid: scale, zero point
    check = paired_cache_calls(torch.zeros(SEQ, DIM), 4, 6)
    outputs, caches = thread_by_hand({m: p.module() for m, p in quantized.items()}, check)
    eager, eager_caches = thread_by_hand({"prefill": module, "decode": module}, check)
    grid = float(quantized["decode"].graph.output_node().args[0][1].args[1])
    for got, want in zip(caches, eager_caches, strict=True):
        assert (got - want).abs().max() <= grid * 2  # on the cache's grid, threaded
    for got, want in zip(outputs, eager, strict=True):
        assert (got - want).abs().max() < 0.1
