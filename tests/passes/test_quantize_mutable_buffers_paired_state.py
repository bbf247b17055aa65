"""QuantizeMutableBuffers on state carried as an input/output pair (the program returns the
cache's next value instead of writing the input), in both program forms.

With the pairing (``next_values``, as InputsToBuffers takes it) and ``carried_state=True``,
the input and the output become the grid's integers (the call signature changes, the report
says so) and the program computes exactly what it did: threaded by hand over several calls,
its outputs are bit for bit the float program's and its integer cache dequantizes to the
float program's cache. Without opt-in, or without a pairing, the notes (and ``strict=True``,
as a QuantizedStateError) say why the pair stays float.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassFailedError, PassManager
from passes import QuantizeMutableBuffers
from passes.errors import QuantizedStateError
from passes.flow.examples import xnnpack_quantizer
from passes.quantization import quantize_methods
from tests.models.input_state import DIM, SEQ
from tests.models.paired_state import paired_cache_calls, paired_cache_methods

PAIRED = {"cache": "1"}
_qd = torch.ops.quantized_decomposed


@pytest.fixture(scope="module")
def quantized_decode():
    _, programs = paired_cache_methods()
    calls = paired_cache_calls(torch.zeros(SEQ, DIM), 3, 7)
    return quantize_methods(programs, xnnpack_quantizer(), calls, next_values=PAIRED)["decode"]


def _form(program, form):
    program = copy.deepcopy(program)
    return program if form == "ExportedProgram" else program.module()


def _run(program, steps, cache):
    """Call ``program`` once per step, each given the cache the previous call returned."""
    module = program.module() if hasattr(program, "module") and not isinstance(
        program, torch.nn.Module) else program
    outputs, caches = [], []
    with torch.no_grad():
        for x, pos, _ in steps:
            out, cache = module(x, pos, cache)
            outputs.append(out)
            caches.append(cache)
    return outputs, caches


def _cache_grid(program) -> tuple[float, int]:
    graph = program.graph
    write = next(n for n in graph.nodes if n.target is torch.ops.aten.index_copy.default)
    read = next(u for u in write.users if "dequantize" in str(u.target))
    return read.args[1], read.args[2]


@pytest.mark.parametrize("form", ["ExportedProgram", "GraphModule"])
def test_the_pair_stored_as_integers_computes_exactly_what_it_did(quantized_decode, form):
    program = _form(quantized_decode, form)
    steps = [args for m, args, _ in paired_cache_calls(torch.zeros(SEQ, DIM), 4, 9)
             if m == "decode"]
    expected, float_caches = _run(copy.deepcopy(program), steps, torch.zeros(SEQ, DIM))
    result = PassManager([QuantizeMutableBuffers(carried_state=True, next_values=PAIRED)]
                         ).run(program)
    stored = result.program
    assert result.modified
    stats = result.report.records[0].statistics
    assert stats["call signature changed"] == 1
    assert stats["input 'cache': float32 -> int8"] == stats["output '1': float32 -> int8"] == 1
    assert any("the call signature changed" in n for n in result.report.records[0].notes)
    scale, zero_point = _cache_grid(stored)
    cache = _qd.quantize_per_tensor(torch.zeros(SEQ, DIM), scale, zero_point, -128, 127,
                                    torch.int8)
    outputs, caches = _run(stored, steps, cache)
    for got, want, int_cache, float_cache in zip(outputs, expected, caches, float_caches,
                                                 strict=True):
        assert int_cache.dtype == torch.int8
        assert torch.equal(got, want)
        assert torch.equal(_qd.dequantize_per_tensor(int_cache, scale, zero_point, -128, 127,
                                                     torch.int8), float_cache)
    placeholder = next(n for n in stored.graph.nodes if n.name == "cache")
    assert placeholder.meta["val"].dtype == torch.int8
    if form == "ExportedProgram":
        assert stored.example_inputs[0][2].dtype == torch.int8


@pytest.mark.parametrize("form", ["ExportedProgram", "GraphModule"])
@pytest.mark.parametrize("options, why", [
    ({"next_values": PAIRED}, "pass carried_state=True"),
    ({"carried_state": True}, "pass next_values={'cache': '1'} with carried_state=True"),
])
def test_without_opt_in_the_pair_stays_float_and_says_why(quantized_decode, form, options,
                                                          why):
    program = _form(quantized_decode, form)
    result = PassManager([QuantizeMutableBuffers(**options)]).run(program)
    assert not result.modified
    notes = result.report.records[0].notes
    assert any(n.startswith("input 'cache' (output '1' returns its next value): stays float")
               and why in n for n in notes), notes
    assert result.report.records[0].statistics["input 'cache': left float"] == 1
    with pytest.raises(PassFailedError) as caught:
        PassManager([QuantizeMutableBuffers(strict=True, **options)]).run(program)
    assert isinstance(caught.value.__cause__, QuantizedStateError)
    assert caught.value.__cause__.node == "cache"


def test_an_empty_pairing_is_no_pair(quantized_decode):
    result = PassManager([QuantizeMutableBuffers(strict=True, carried_state=True,
                                                 next_values={})]).run(
        copy.deepcopy(quantized_decode))
    assert not result.modified and not result.report.records[0].notes


class _PairNamedLikeAModule(torch.nn.Module):
    """A paired cache input ``proj`` beside the module ``proj`` (``proj.weight``), values
    of one int8 grid written with ``index_copy``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(DIM, DIM)

    def forward(self, x, pos, proj):
        value = _qd.dequantize_per_tensor(_qd.quantize_per_tensor(
            self.proj(x), 0.05, 3, -128, 127, torch.int8), 0.05, 3, -128, 127, torch.int8)
        new = proj.index_copy(0, pos, value)
        return (new * x).sum(-1), new


@pytest.mark.parametrize("form", ["ExportedProgram", "GraphModule"])
def test_a_pair_named_like_a_module_is_stored_as_integers(form):
    """The pair is made a buffer while rewritten under the pass's own path: named after the
    input, it clashed with the module ``proj`` (refused on the GraphModule, a CarriedStateError
    the caller could do nothing about)."""
    from passes import InplaceToFunctional, MarkMutableBuffers

    steps = [(torch.randn(1, DIM, generator=torch.Generator().manual_seed(i)),
              torch.tensor([i % SEQ]), None) for i in range(5)]
    ep = torch.export.export(_PairNamedLikeAModule(), (*steps[0][:2], torch.zeros(SEQ, DIM)))
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        ep if form == "ExportedProgram" else ep.module()).program
    expected, float_caches = _run(copy.deepcopy(program), steps, torch.zeros(SEQ, DIM))
    result = PassManager([QuantizeMutableBuffers(carried_state=True,
                                                 next_values={"proj": "1"})]).run(program)
    assert result.report.records[0].statistics["input 'proj': float32 -> int8"] == 1
    cache = _qd.quantize_per_tensor(torch.zeros(SEQ, DIM), 0.05, 3, -128, 127, torch.int8)
    outputs, caches = _run(result.program, steps, cache)
    for got, want, int_cache, float_cache in zip(outputs, expected, caches, float_caches,
                                                 strict=True):
        assert torch.equal(got, want)
        assert torch.equal(_qd.dequantize_per_tensor(int_cache, 0.05, 3, -128, 127,
                                                     torch.int8), float_cache)
