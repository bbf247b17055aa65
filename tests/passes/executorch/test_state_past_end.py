"""More calls than a static cache holds, on ExecuTorch's runtime: a typed error naming the
call and the cache, found before lowering, where the runtime failed with an untyped
``RuntimeError`` (``index_put.out``, error 0x12) after a lowering of seconds."""

from __future__ import annotations

import pytest
import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers, StatePastEndError
from passes.executorch import decode_on_runtime, run_methods_on_runtime
from passes.flow.factory import export_program
from tests.models.static_cache import DIM, ROWS, CountedWrites, PositionedWrites, token_calls


def _functional(module, example):
    program = export_program(module, example).program
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


@pytest.mark.parametrize("make, positioned", [(PositionedWrites, True), (CountedWrites, False)],
                         ids=["position input", "counter"])
def test_decoding_past_the_cache_is_a_typed_error_before_lowering(make, positioned):
    calls = token_calls(ROWS + 1, positioned)
    with pytest.raises(StatePastEndError) as info:
        decode_on_runtime(_functional(make(), calls[0]), None, calls)
    error = info.value
    assert (error.argument, error.step, error.state, error.position, error.length) == (
        f"steps[{ROWS}]", ROWS, "cache", ROWS, ROWS)
    assert isinstance(error, IndexError)


def test_methods_past_the_cache_name_the_call_and_its_method():
    module = PositionedWrites()
    prompt = (torch.randn(1, 2, DIM), torch.arange(2))
    decodes = [(torch.randn(1, 1, DIM), torch.tensor([row])) for row in range(2, ROWS + 1)]
    programs = {"prefill": _functional(module, prompt), "decode": _functional(module, decodes[0])}
    calls = [("prefill", prompt, {}), *(("decode", call, {}) for call in decodes)]
    with pytest.raises(StatePastEndError) as info:
        run_methods_on_runtime(programs, calls)
    assert info.value.argument == f"calls[{len(calls) - 1}] ('decode')"
    assert (info.value.position, info.value.length) == (ROWS, ROWS)
