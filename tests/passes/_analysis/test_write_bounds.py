"""Calls writing a static cache past its end are found before anything runs, at the call
where eager raises, in every program form; a ring buffer wrapping its position is not."""

from __future__ import annotations

import pytest
import torch

from pass_manager import PassManager, run_program
from passes import InplaceToFunctional, MarkMutableBuffers
from passes._analysis.write_bounds import first_write_past_end, flat_user_inputs
from passes.flow.examples import xnnpack_quantizer
from passes.flow.factory import export_program
from passes.quantization import quantize_program
from tests.models.static_cache import (
    ROWS,
    CarriedCounter,
    CountedWrites,
    PositionedWrites,
    ResettableCounter,
    ReturnedCounter,
    RingBuffer,
    token_calls,
)

CALLS = ROWS + 2


def _forms(module: torch.nn.Module, calls: list[tuple]):
    """The program as exported (in-place writes), functional, and quantized."""
    exported = export_program(module, calls[0]).program
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        export_program(module, calls[0]).program).program
    quantized = quantize_program(functional, xnnpack_quantizer(), calls[:ROWS])
    return {"exported": exported, "functional": functional, "quantized": quantized}


def _first_past_end(program, calls, **pairs):
    return first_write_past_end(
        {"forward": program}, [("forward", flat_user_inputs(program, call, {}))
                               for call in calls], **pairs)


def _eager_fails_at(module: torch.nn.Module, calls: list[tuple]) -> int | None:
    for index, call in enumerate(calls):
        try:
            module(*call)
        except IndexError:
            return index
    return None


@pytest.mark.parametrize("make, positioned", [
    (PositionedWrites, True), (lambda: PositionedWrites(index_put=True), True),
    (CountedWrites, False)], ids=["index_copy at input", "index_put at input", "counter"])
def test_a_write_past_the_cache_is_found_at_the_call_eager_fails(make, positioned):
    calls = token_calls(CALLS, positioned)
    assert _eager_fails_at(make(), calls) == ROWS
    for form, program in _forms(make(), calls).items():
        found = _first_past_end(program, calls)
        assert found is not None, form
        assert (found.step, found.state, found.dim, found.position, found.length) == (
            ROWS, "cache", 1, ROWS, ROWS), form
        assert _first_past_end(program, calls[:ROWS]) is None, form
        # the program's own buffers are read, not advanced
        assert int(program.state_dict.get("pos", torch.zeros(1))[0]) == 0


def test_a_ring_buffer_is_never_refused():
    calls = token_calls(3 * ROWS)
    module = RingBuffer()
    forms = _forms(module, calls)  # exported from copies: the module's state stays fresh
    for form, program in forms.items():
        assert _first_past_end(program, calls) is None, form
    trace = run_program(forms["functional"], calls)
    eager = [module(*call) for call in calls]  # every call runs, wrapping three times
    assert all(torch.equal(e, t[0]) for e, t in zip(eager, trace.outputs, strict=True))
    assert torch.equal(module.cache, trace.buffers[-1]["cache"])


def test_positions_the_model_computes_from_floats_are_left_to_the_run():
    class ArgmaxPosition(PositionedWrites):
        def forward(self, x, pos):
            self.cache.index_copy_(1, x.argmax(-1).view(1) + ROWS, self.proj(x))
            return self.cache.sum(1)

    calls = token_calls(2, positioned=True)
    # Exported directly: its every write is past the end, so the main job's export refuses
    # it (it raises on its own example in eager); the analysis must still not guess.
    with torch.no_grad():
        program = torch.export.export(ArgmaxPosition(), calls[0])
    assert _first_past_end(program, calls) is None


def test_a_counter_another_method_resets_is_followed_across_methods():
    module = ResettableCounter()
    calls = token_calls(ROWS)
    programs = {"decode": export_program(module, calls[0]).program,
                "reset": export_program(module, (calls[0][0], True)).program}
    sequence = [*(("decode", call) for call in calls), ("reset", (calls[0][0], True)),
                *(("decode", call) for call in calls)]
    flat = [(method, flat_user_inputs(programs[method], call, {}))
            for method, call in sequence]
    for _, call in sequence:  # eager runs every call: the reset makes room
        module(*call)
    assert first_write_past_end(programs, flat) is None
    # without the reset, the fifth decode writes past the cache
    found = first_write_past_end(programs, [entry for entry in flat if entry[0] == "decode"])
    assert (found.step, found.position) == (ROWS, ROWS)


def _carried_position_calls() -> tuple[list[tuple], torch.Tensor]:
    """``CALLS`` tokens, each call passing the one position tensor the caller carries."""
    pos = torch.zeros(1, dtype=torch.long)
    return [(x, pos) for (x,) in token_calls(CALLS)], pos


def test_a_counter_the_caller_carries_written_in_place_is_threaded():
    """On main every call read the position as given (0): no call was found past the end."""
    forms = _forms(CarriedCounter(), _carried_position_calls()[0])  # calibration writes it
    calls, pos = _carried_position_calls()
    for form, program in forms.items():
        found = _first_past_end(program, calls)
        assert found is not None, form
        assert (found.step, found.state, found.position, found.length) == (
            ROWS, "cache", ROWS, ROWS), form
        assert _first_past_end(program, calls[:ROWS]) is None, form
        assert int(pos) == 0  # the caller's tensor is read, not written
    assert _eager_fails_at(CarriedCounter(), calls) == ROWS


def test_a_counter_returned_as_its_next_value_is_threaded_by_its_pairing():
    """Paired (``decode_on_runtime(next_values={"pos": "1"})``), each call takes the last
    output: found at the call the runtime fails with 0x12; unpaired, each call's own."""
    calls, _ = _carried_position_calls()
    program = _forms(ReturnedCounter(), calls)["functional"]  # no input written: calls kept
    found = _first_past_end(program, calls, pairs={"forward": {1: 1}})
    assert (found.step, found.position) == (ROWS, ROWS)
    assert _first_past_end(program, calls) is None  # every call at position 0: in range


def test_decode_on_runtime_refuses_a_paired_counter_past_the_end_before_lowering():
    pytest.importorskip("executorch")
    from passes.errors import StatePastEndError
    from passes.executorch import decode_on_runtime

    calls, _ = _carried_position_calls()
    program = _forms(ReturnedCounter(), calls)["functional"]
    with pytest.raises(StatePastEndError, match=rf"steps\[{ROWS}\] writes position {ROWS}"):
        decode_on_runtime(program, None, calls, next_values={"pos": "1"})


class _FreshCachePrefill(torch.nn.Module):
    """HF's prefill: the cache's new value is written into a fresh tensor, then copied in."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 6))

    def forward(self, x, pos):
        self.cache.copy_(torch.zeros(1, 6).index_copy(1, pos, x))
        return self.cache.sum()


def test_a_write_into_a_fresh_tensor_that_becomes_state_is_checked():
    """On 87ba65d a prefill of 8 tokens into a cache of 6, written into a fresh tensor that
    then becomes the cache (HF's exporter's prefill), was not looked at: the runtime failed
    with an untyped ``RuntimeError`` (0x12), and later writes were blamed on a later call."""
    t = torch.export.Dim("t", min=2, max=8)
    exported = torch.export.export(_FreshCachePrefill(), (torch.ones(1, 2), torch.arange(2)),
                                   dynamic_shapes=({1: t}, {0: t}))
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        torch.export.export(_FreshCachePrefill(), (torch.ones(1, 2), torch.arange(2)),
                            dynamic_shapes=({1: t}, {0: t}))).program
    for program in (exported, functional):
        calls = [(torch.ones(1, n), torch.arange(n)) for n in (4, 6, 8)]
        found = _first_past_end(program, calls)
        assert (found.step, found.state, found.dim, found.position, found.length) == (
            2, "cache", 1, 6, 6)
        assert _first_past_end(program, calls[:2]) is None
