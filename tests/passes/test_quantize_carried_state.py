"""QuantizeMutableBuffers on state the caller carries: a cache passed as an input and
written in place (transformers' exporter's form), a ``USER_INPUT_MUTATION`` output once
functional.

By default the pass leaves it float and says why (strict: a typed error naming the input);
with ``carried_state=True`` it stores it as its grid's integers, the caller passing integer
tensors: the program must then return, call after call, the same outputs bit for bit as the
fp32-stored quantized program, and the caller's integer state, dequantized, must equal the
float state bit for bit. Forms: the ExportedProgram ``quantize_program`` returns and its
``.module()``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from pass_manager import PassFailedError, PassManager
from pass_manager.program import program_text
from passes import (
    QuantizedStateError,
    QuantizeMutableBuffers,
    conditions,
    mutable_buffers,
    reset_mutable_buffers,
)
from passes._analysis.grids import same_bits
from passes.errors import CarriedStateWarning
from tests.models.quantized_state import (
    HAND_FORMS,
    CarriedGridCache,
    carried_cache,
    exported,
    grid_inputs,
    quantized_carried,
)

FORMS = ("exported_program", "graph_module")
WRITES = ("index_copy", "index_put")


def quantize_state(program, **options):
    result = PassManager([QuantizeMutableBuffers(**options)], strict=True).run(program)
    assert result.program is program
    return result, result.report.records[0]


def module_of(program):
    return program.module() if isinstance(program, torch.export.ExportedProgram) else program


def run_carried(program, calls, cache: torch.Tensor) -> list[torch.Tensor]:
    """Call ``program`` once per ``(x, pos)`` with ``cache`` carried along (written in
    place); the outputs, and a copy of the cache after each call, interleaved."""
    module, trace = module_of(program), []
    with torch.no_grad():
        for args in calls:
            trace.append(module(*args, cache))
            trace.append(cache.clone())
    return trace


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("write", WRITES)
def test_carried_cache_stays_float_by_default_and_the_notes_say_why(write, form):
    program, _ = quantized_carried(write, form)
    before = program_text(program)
    result, record = quantize_state(program)
    assert not result.modified
    assert record.statistics == {"inputs left float": 1, "input 'cache': left float": 1}
    (note,) = record.notes
    assert note.startswith("input 'cache': stays float32: it is state the caller carries: "
                           "its writes store values of int8 ")
    assert "carried_state=True" in note and "passes.InputsToBuffers" in note
    assert program_text(program) == before
    assert mutable_buffers(program)["cache"].grid is None


def test_strict_refuses_a_carried_cache_naming_the_input():
    program, _ = quantized_carried()
    before = program_text(program)
    with pytest.raises(PassFailedError) as error:
        quantize_state(program, strict=True)
    cause = error.value.__cause__
    assert isinstance(cause, QuantizedStateError) and cause.node == "cache"
    assert cause.reason.startswith("input 'cache' stays float: it is state the caller carries")
    assert "passes.InputsToBuffers" in cause.reason
    assert program_text(program) == before


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("write", WRITES)
def test_carried_cache_stored_as_integers_bit_for_bit(write, form):
    program, calls = quantized_carried(write, form)
    reference = copy.deepcopy(program)
    result, record = quantize_state(program, carried_state=True)
    assert result.modified
    assert record.statistics == {"inputs stored as integers": 1, "call signature changed": 1,
                                 "input 'cache': float32 -> int8": 1}
    (note,) = record.notes
    assert note.startswith("input 'cache': float32 -> int8 on int8 [-128, 127], scale=")
    assert "the call signature changed: the caller passes input 'cache' as int8 (was " \
           "float32)" in note
    grid = mutable_buffers(program)["cache"].grid
    assert grid is not None and grid.dtype == torch.int8
    (placeholder,) = [n for n in program.graph.nodes if n.op == "placeholder"
                      and n.meta.get("mutable_user_input") == "cache"]
    assert placeholder.meta["val"].dtype == torch.int8
    assert conditions.MutableBuffersMarked.check(program) == []

    # From a fresh cache, then from a non-zero one (the state of four calls, on the grid).
    start = carried_cache()
    for steps in (calls, calls[2:]):
        float_cache, int_cache = start.clone(), grid.quantize(start)
        assert same_bits(grid.dequantize(int_cache), float_cache)
        expected = run_carried(reference, steps, float_cache)
        actual = run_carried(program, steps, int_cache)
        for call, (want, got) in enumerate(zip(expected[::2], actual[::2], strict=True)):
            assert same_bits(want, got), f"call {call}: output differs"
        for call, (want, got) in enumerate(zip(expected[1::2], actual[1::2], strict=True)):
            assert got.dtype == torch.int8
            assert same_bits(grid.dequantize(got), want), f"call {call}: cache differs"
        start = expected[7]
        assert not torch.equal(start, carried_cache())
    if form == "exported_program":  # torch's verifier takes the integer input
        decomposed = program.run_decompositions({})
        (cache,) = [n for n in decomposed.graph.nodes if n.name == "cache"]
        assert cache.meta["val"].dtype == torch.int8


def assert_carried_bit_for_bit(reference, program, calls, grid) -> None:
    """Both called in a row from a zero cache: outputs bit for bit, the integer cache
    dequantized equal to the float one after every call."""
    float_cache = carried_cache()
    int_cache = grid.quantize(float_cache)
    expected = run_carried(reference, calls, float_cache)
    actual = run_carried(program, calls, int_cache)
    for call in range(len(calls)):
        assert same_bits(expected[2 * call], actual[2 * call]), f"call {call}: output"
        assert same_bits(grid.dequantize(actual[2 * call + 1]), expected[2 * call + 1]), (
            f"call {call}: cache")


@pytest.mark.parametrize("form", HAND_FORMS)
def test_carried_cache_in_every_form_export_gives(form):
    """Quantized by hand: the in-place write into the input (exported, or its module), the
    trailing ``copy_`` of the functional module, the ``USER_INPUT_MUTATION`` output."""
    calls = grid_inputs()
    program = exported(CarriedGridCache(), (*calls[0], carried_cache()), form)
    reference = copy.deepcopy(program)
    result, record = quantize_state(program, carried_state=True)
    assert result.modified and record.statistics["call signature changed"] == 1
    grid = mutable_buffers(program)["cache"].grid
    assert grid.describe() == "int8 [-128, 127], scale=0.05, zero_point=3"
    assert_carried_bit_for_bit(reference, program, calls, grid)


def test_a_second_run_leaves_the_integer_input_as_it_is():
    program, _ = quantized_carried()
    quantize_state(program, carried_state=True)
    before = program_text(program)
    result, record = quantize_state(program, carried_state=True)
    assert not result.modified and record.statistics == {}
    (note,) = record.notes
    assert note.startswith("input 'cache': left as it is (stored as integers on int8 ")
    assert program_text(program) == before


@pytest.mark.parametrize("form", FORMS)
def test_reset_warns_that_the_carried_state_is_not_reset(form):
    program, calls = quantized_carried("index_copy", form)
    module_of(program)(*calls[0], carried_cache())
    with pytest.warns(CarriedStateWarning) as caught:
        assert reset_mutable_buffers(program) == []
    (warning,) = [w.message for w in caught if isinstance(w.message, CarriedStateWarning)]
    assert warning.inputs == ["cache"]
    assert "input(s) 'cache' lives in the caller's tensors" in str(warning)
    assert "passes.InputsToBuffers" in str(warning)
    # The same for the methods of one model.
    with pytest.warns(CarriedStateWarning):
        reset_mutable_buffers({"decode": program, "again": program})


def test_reset_of_resident_state_does_not_warn():
    from tests.models.quantized_state import GridCache, exported, grid_inputs

    program = exported(GridCache(), grid_inputs()[0], "exported_program")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CarriedStateWarning)
        assert reset_mutable_buffers(program) == ["cache"]


def test_the_example_inputs_give_the_integer_input_the_program_now_takes():
    """Stored as integers, a carried input's example is its grid's integers: the program's
    own example inputs are a call it takes (they stayed float, and torch refused them)."""
    calls = grid_inputs()
    program = exported(CarriedGridCache(), (*calls[0], carried_cache()), "exported_program")
    reference = copy.deepcopy(program)
    quantize_state(program, carried_state=True)
    grid = mutable_buffers(program)["cache"].grid
    (args, _), (reference_args, _) = program.example_inputs, reference.example_inputs
    assert args[2].dtype == torch.int8 and torch.equal(args[2], grid.quantize(reference_args[2]))
    assert torch.equal(args[0], reference_args[0]) and torch.equal(args[1], reference_args[1])
    expected = run_carried(reference, calls[:3], reference_args[2].clone())
    actual = run_carried(program, calls[:3], args[2].clone())
    for call in range(3):
        assert same_bits(expected[2 * call], actual[2 * call]), f"call {call}: output"
        assert same_bits(grid.dequantize(actual[2 * call + 1]), expected[2 * call + 1])


def test_state_made_resident_stored_as_integers_comes_back_with_integer_examples():
    """InputsToBuffers, QuantizeMutableBuffers (the resident cache stored as integers), then
    BuffersToInputs restoring the signature: the input is now the grid's integers, and so
    is its example (the record's float example no longer fits the program). Called in a
    row, the restored program follows the resident one bit for bit, output and state."""
    from passes import BuffersToInputs, InplaceToFunctional, InputsToBuffers, MarkMutableBuffers

    calls = grid_inputs()
    program = exported(CarriedGridCache(), (*calls[0], carried_cache()), "exported_program")
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional(),
                           InputsToBuffers(), QuantizeMutableBuffers()]).run(program).program
    grid = mutable_buffers(program)["cache"].grid
    assert program.constants["cache"].dtype == torch.int8
    resident = copy.deepcopy(program).module()
    back = PassManager([BuffersToInputs()]).run(program).program
    assert back.graph_signature.user_inputs == ("x", "pos", "cache")
    args, _ = back.example_inputs
    assert args[2].dtype == torch.int8 and torch.equal(args[2], grid.quantize(carried_cache()))
    carried = back.module()
    cache = args[2].clone()
    with torch.no_grad():
        for call, step in enumerate(calls):
            assert same_bits(resident(*step), carried(*step, cache)), f"call {call}: output"
            assert same_bits(dict(resident.named_buffers())["cache"], cache), f"call {call}"


def test_carried_state_stored_as_integers_then_made_resident_starts_from_its_integers():
    """QuantizeMutableBuffers(carried_state=True), then InputsToBuffers: the buffer starts
    as the example's grid integers (it was the float example, and the program's int8
    ``index_copy_`` into it failed on the first call); called in a row it follows the carried
    integer program bit for bit, output and state."""
    from passes import InputsToBuffers

    calls = grid_inputs()
    program = exported(CarriedGridCache(), (*calls[0], carried_cache()), "exported_program")
    quantize_state(program, carried_state=True)
    grid = mutable_buffers(program)["cache"].grid
    resident = PassManager([InputsToBuffers()]).run(program).program
    assert resident.constants["cache"].dtype == torch.int8
    module, carried = resident.module(), copy.deepcopy(program).module()
    cache = grid.quantize(carried_cache())
    with torch.no_grad():
        for call, step in enumerate(calls):
            assert same_bits(module(*step), carried(*step, cache)), f"call {call}: output"
            assert same_bits(dict(module.named_buffers())["cache"], cache), f"call {call}"


@pytest.mark.parametrize("form", FORMS)
def test_integer_state_made_an_input_and_resident_again_starts_from_its_integers(form):
    """The quantized carried cache made resident and stored as int8 (its fresh state: the
    zero point's integers), then BuffersToInputs and InputsToBuffers again: the buffer starts
    from those integers on both forms. A GraphModule kept no value for the input and its
    buffer restarted as int8 zeros (another value than 0 on the grid): every call's output
    and cache differed (by up to 0.45 and 10 grid steps)."""
    from passes import BuffersToInputs, InputsToBuffers

    program, calls = quantized_carried("index_copy", "exported_program")
    program = PassManager([InputsToBuffers(initial_values={"cache": carried_cache()}),
                           QuantizeMutableBuffers()]).run(program).program
    program = program if form == "exported_program" else program.module()
    resident = module_of(copy.deepcopy(program))
    back = PassManager([BuffersToInputs()]).run(program).program
    again = module_of(PassManager([InputsToBuffers()]).run(back).program)
    with torch.no_grad():
        for call, step in enumerate(calls):
            assert same_bits(again(*step), resident(*step)), f"call {call}: output"
            assert same_bits(dict(again.named_buffers())["cache"],
                             dict(resident.named_buffers())["cache"]), f"call {call}: cache"
