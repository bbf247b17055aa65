"""A method that only reads state another method writes, run in turn and stored as integers.

``ReadOnlyState`` as a ``read`` method (one row: it reads the total, count and seen mask) and a
``write`` one (three rows: it updates them), called alternately. The reader must see what
the writer wrote, in Python as on the device, and with the state stored as integers by the
pass manager on the mapping it must read the writer's integers.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager
from pass_manager.validation import copy_program, first_difference
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    QuantizeMutableBuffers,
    SharedBufferError,
    mutable_buffers,
)
from passes._methods.calls import share_buffer_tensors
from passes._methods.in_turn import run_methods
from passes.flow.examples import xnnpack_quantizer
from passes.flow.integer_state import dequantized_state
from passes.quantization import quantize_methods
from tests.models.methods import calls_in_sequence
from tests.models.methods_on_runtime import (
    per_channel_methods,
    read_only_state_methods,
    reset_total_methods,
)

STATE = ("total", "count", "seen")


def test_a_reader_shares_the_tensor_of_state_another_method_writes():
    """Before, only the buffers a method writes were shared: the reader kept its own total
    at the initial value, so every read after a write was off (the main job's fp32 check
    failed on the three-method decoder: its state method returned a zero cache)."""
    case = read_only_state_methods()
    programs = copy_program(dict(case.programs))
    shared = share_buffer_tensors(programs)
    assert {fqn: sorted(names) for fqn, names in shared.items()} == {
        fqn: ["read", "write"] for fqn in STATE}
    eager = copy.deepcopy(case.model)
    trace = run_methods(programs, case.calls)
    for index, (method, args, kwargs) in enumerate(case.calls):
        with torch.no_grad():
            want = eager(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        (got,) = trace.outputs[index]  # the one output, as a trace holds it
        assert torch.equal(got, want), (index, method)
        for fqn in STATE:  # bit for bit, after every call
            assert torch.equal(trace.buffers[index][fqn], getattr(eager, fqn)), (index, fqn)


def test_the_pass_manager_makes_a_reader_read_the_integers_the_writer_stores():
    """QuantizeMutableBuffers run on the mapping decides each method from its own writes;
    before, the reader kept a float total beside the writer's int8 one and the run failed
    with SharedBufferError after the pipeline (the main job's integer-state stage too)."""
    case = read_only_state_methods()
    floats = quantize_methods(copy_program(dict(case.programs)), xnnpack_quantizer(), case.calls)
    stored = PassManager([QuantizeMutableBuffers()]).run(copy_program(dict(floats)))
    integers = stored.programs
    assert integers["read"].state_dict["total"].dtype == torch.int8
    assert integers["read"].state_dict["total"] is integers["write"].state_dict["total"]
    assert stored.notes["integer reads"] == {"read": ["total"]}
    # the run's own report says so (before, only a caller of restate_integer_reads's did)
    _says_stored(stored["read"].report.records[-1], "total",
                 "'write' stores and reads them dequantized")
    assert stored["read"].modified
    for got, want in zip(calls_in_sequence(integers, case.calls),
                         calls_in_sequence(floats, case.calls), strict=True):
        assert torch.equal(got, want)  # bit for bit the float-stored methods, call after call
    # and the state the calls leave, dequantized, is the float-stored methods' state
    grids = {fqn: info.grid for program in integers.values()
             for fqn, info in mutable_buffers(program).items() if info.grid is not None}
    assert set(grids) == {"total"}
    want = run_methods(floats, case.calls)
    got = run_methods(integers, case.calls, state=dequantized_state(grids))
    assert first_difference(want, got) is None  # atol 0: outputs and every buffer


@pytest.fixture(scope="module")
def reset_total():
    """``reset_total(fill)``: ``reset_total_methods(fill)`` and its methods quantized with
    float state, made once per fill (a reset off the grid, 0.3, or to zero)."""
    found = {}

    def made(fill: float):
        if fill not in found:
            case = reset_total_methods(fill)
            found[fill] = case, quantize_methods(copy_program(dict(case.programs)),
                                                 xnnpack_quantizer(), case.calls)
        return found[fill]
    return made


def _same_as_float_state(integers, floats, calls) -> dict:
    """The grids ``integers`` stores its state on; its calls compute, outputs and state
    dequantized, bit for bit what ``floats`` computes."""
    grids = {fqn: info.grid for program in integers.values()
             for fqn, info in mutable_buffers(program).items() if info.grid is not None}
    want = run_methods(floats, calls)
    got = run_methods(integers, calls, state=dequantized_state(grids))
    assert first_difference(want, got) is None  # atol 0: outputs and every buffer
    return grids


@pytest.mark.parametrize("fill, stored", [(0.3, None), (0.0, torch.int8)])
def test_a_buffer_one_method_resets_is_stored_alike_in_every_method(reset_total, fill, stored):
    """``add`` stores the total as int8 (its writes lie on one grid); ``reset`` writes it
    with ``fill_``. Off the grid (0.3), the total now stays float in every method (one
    buffer for all of them); to zero, ``reset`` stores the grid's zero point. Before, both
    raised SharedBufferError (aspect "integer storage"); and before that, the join made
    ``reset`` hold the int8 tensor and cast its float write into it: the calls after a
    reset were off the float-stored methods by up to 18.7. Stored to zero, ``reset``'s
    report said "total: stays float32" and counted it left float (modified: no), though it
    holds the int8 total; now it says what it holds."""
    case, floats = reset_total(fill)
    integers = quantize_methods(copy_program(dict(case.programs)), xnnpack_quantizer(),
                                case.calls, quantize_state=True)
    dtypes = {integers[name].state_dict["total"].dtype for name in integers}
    assert dtypes == {stored or torch.float32}
    assert integers["reset"].state_dict["total"] is integers["add"].state_dict["total"]
    grids = _same_as_float_state(integers, floats, case.calls)
    assert set(grids) == ({"total"} if stored else set())
    if stored is None:
        assert integers.reports["add"]["quantize_state"].records[-1].notes == [
            "total: stays float32: method 'reset' writes it off the grid (written by its "
            "mutation output: fill_scalar: computed by fill.Scalar, not data movement of a "
            "dequantized value), and all methods hold one buffer"]
    else:  # the report of each method says what it now holds
        _says_stored(integers.reports["reset"]["quantize_state"].records[-1], "total",
                     "'add' stores and writes only zeros, stored as the grid's zero point")


def _says_stored(record, fqn: str, how: str) -> None:
    """``record`` (QuantizeMutableBuffers) notes ``fqn`` stored as int8, ``how``, and
    counts it so (4 float32 values: 16 bytes before, 4 after)."""
    (note,) = [note for note in record.notes if note.startswith(f"{fqn}: ")]
    assert note.startswith(f"{fqn}: float32 -> int8 (16 -> 4 bytes) on int8 ") and \
        note.endswith(how), note
    assert record.modified
    assert record.statistics["buffers stored as integers"] == 1
    assert "buffers left float" not in record.statistics
    assert f"{fqn}: left float" not in record.statistics
    assert (record.statistics[f"{fqn}: bytes float32"],
            record.statistics[f"{fqn}: bytes int8"]) == (16, 4)


def test_the_pass_manager_alone_says_a_reset_to_zero_stores_the_integers(reset_total):
    """Run directly on the mapping (no quantize_methods), ``reset`` writing the total only
    as zeros holds ``add``'s int8 total. Before, its QuantizeMutableBuffers record still
    said "total: stays float32" and counted it left float, unmodified, unless the caller
    called restate_integer_reads itself; now the joint condition restates it on every run."""
    case, floats = reset_total(0.0)
    stored = PassManager([QuantizeMutableBuffers()]).run(copy_program(dict(floats)))
    assert stored.notes["integer reads"] == {"reset": ["total"]}
    _says_stored(stored["reset"].report.records[-1], "total",
                 "'add' stores and writes only zeros, stored as the grid's zero point")
    assert stored["reset"].modified and stored.modified
    assert "stays float" not in str(stored)
    _same_as_float_state(stored.programs, floats, case.calls)


def test_the_pass_manager_alone_refuses_a_float_write_of_integer_state(reset_total):
    """Run on the mapping, QuantizeMutableBuffers decides each method alone: ``add`` has
    stored the total as int8 before ``reset`` keeps it float, and no pass can take that
    back, so the join refuses it and says how to decide for all methods at once."""
    _, floats = reset_total(0.3)
    with pytest.raises(SharedBufferError, match=r"'reset' writes it and keeps it float "
                       r"\(written by its mutation output: fill_scalar: computed by "
                       r"fill.Scalar") as error:
        PassManager([QuantizeMutableBuffers()]).run(copy_program(dict(floats)))
    assert (error.value.buffer, error.value.methods, error.value.aspect) == (
        "total", ["add", "reset"], "integer storage")
    assert "keep_float={'total': why}" in str(error.value)


@pytest.mark.parametrize("reset, says", [(False, "'read' reads it without writing it"),
                                         (True, "'reset' writes it as zeros")])
def test_a_per_channel_grid_another_method_cannot_hold_is_refused_saying_why(reset, says):
    """``write`` stores the cache on its per-channel grid; ``read`` (or ``reset``, writing
    zeros) holds no scales and zero points to take those integers with. Before, the join
    passed over per-channel grids and the check said the methods differ in dtype ("export
    them from one model", which they were)."""
    case = per_channel_methods(reset)
    with pytest.raises(SharedBufferError, match=says) as error:
        PassManager([MarkMutableBuffers(), InplaceToFunctional(), QuantizeMutableBuffers()]
                    ).run(copy_program(dict(case.programs)))
    assert (error.value.buffer, error.value.aspect) == ("cache", "integer storage")
    assert "keep_float={'cache': why}" in str(error.value)


def test_quantize_methods_keeps_a_per_channel_cache_another_method_reads_float():
    """Deciding for all methods at once, the cache stays float in both: the methods compute
    bit for bit what the float-stored ones do. Before, ``quantize_state=True`` raised
    SharedBufferError (int8 in ``write``, float32 in ``read``)."""
    case = per_channel_methods()
    floats = quantize_methods(copy_program(dict(case.programs)), xnnpack_quantizer(),
                              case.calls)
    integers = quantize_methods(copy_program(dict(case.programs)), xnnpack_quantizer(),
                                case.calls, quantize_state=True)
    assert {name: program.state_dict["cache"].dtype for name, program in integers.items()} \
        == {"write": torch.float32, "read": torch.float32}
    assert integers["read"].state_dict["cache"] is integers["write"].state_dict["cache"]
    assert any(note.startswith("cache: stays float32: method 'read' reads it without")
               for note in integers.reports["write"]["quantize_state"].records[-1].notes)
    want, got = run_methods(floats, case.calls), run_methods(integers, case.calls)
    assert first_difference(want, got) is None  # atol 0: outputs and every buffer
    assert got.buffers[-1]["cache"].any()
