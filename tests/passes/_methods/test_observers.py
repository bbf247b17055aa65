"""share_observers: one observer per shared buffer across prepared methods, or a clear
error when the methods' quantizer observes the buffer on grids of different kinds."""

from __future__ import annotations

import copy

import pytest
import torch
from torchao.quantization.pt2e.observer import MinMaxObserver, MovingAverageMinMaxObserver

from passes import QuantizationFlowError
from passes._methods.observers import BufferObservers, share_observers


def test_observers_of_another_kind_for_one_buffer_are_refused():
    unsigned = MinMaxObserver(dtype=torch.uint8, quant_min=0, quant_max=255)
    signed = MinMaxObserver(dtype=torch.int8, quant_min=-128, quant_max=127)
    found = {"prefill": BufferObservers(grid={"k_cache": [unsigned]}),
             "decode": BufferObservers(grid={"k_cache": [signed]})}
    with pytest.raises(QuantizationFlowError) as caught:
        share_observers({}, found)
    message = str(caught.value)
    assert "buffer 'k_cache'" in message and "'prefill'" in message and "'decode'" in message
    assert "torch.uint8" in message and "torch.int8" in message


def test_a_read_observed_on_another_kind_of_grid_keeps_its_own():
    grid = [MinMaxObserver(dtype=torch.uint8), MinMaxObserver(dtype=torch.uint8)]
    read = MinMaxObserver(dtype=torch.int8, quant_min=-128, quant_max=127)
    found = {"prefill": BufferObservers(grid={"k_cache": grid[:1]}),
             "decode": BufferObservers(grid={"k_cache": grid[1:]}, reads={"k_cache": [read]})}
    assert share_observers({}, found) == {"k_cache": 2}


def test_observers_of_two_classes_on_one_kind_of_grid_become_one():
    """One quantizer may observe one buffer with several observer classes; what makes a
    grid is its dtype, range and scheme, so they are one instance."""
    minmax = MinMaxObserver(dtype=torch.uint8, quant_min=0, quant_max=255)
    moving = MovingAverageMinMaxObserver(dtype=torch.uint8, quant_min=0, quant_max=255)
    found = {"prefill": BufferObservers(grid={"cache": [minmax]}),
             "decode": BufferObservers(grid={"cache": [moving]})}
    assert share_observers({}, found) == {"cache": 2}


def test_qnn_methods_writing_a_cat_into_the_cache_share_one_grid():
    """QnnQuantizer observes a key written from a ``cat`` with a ConcatObserver and the
    cache's copy with a MovingAverageMinMaxObserver (Phi-3's partial rotary key, HF's
    repeat_kv): quantize_methods refused it (QuantizationFlowError, "quantized as
    ConcatObserver ... in method 'prefill' but as MovingAverageMinMaxObserver ... in method
    'prefill'"). Now: one grid in both methods; stored as integers, the methods compute what
    the float-stored ones do, outputs and state, call after call; and along the calls no
    call is worse than the worst of each method quantized alone (QNN's moving-average
    observers barely move after the first call, so both are far from eager here)."""
    from pass_manager.validation import copy_program
    from passes import mutable_buffers
    from passes._methods.grid_facet import buffer_grids
    from passes.quantization import quantize_methods, quantize_program
    from tests.models.methods import calls_in_sequence, cat_key_methods, errors_per_call
    from tests.models.qnn import qnn_quantizer

    module, programs, calls = cat_key_methods(decodes=4)
    reference = copy.deepcopy(module)
    floats = quantize_methods(copy_program(dict(programs)), qnn_quantizer(), calls)
    stored = quantize_methods(copy_program(dict(programs)), qnn_quantizer(), calls,
                              quantize_state=True)
    grids = {name: buffer_grids(program)["cache"] for name, program in stored.items()}
    assert grids["prefill"] == grids["decode"] and grids["decode"].stored
    grid = mutable_buffers(stored["decode"])["cache"].grid
    modules = {name: program.module() for name, program in stored.items()}
    expected = {name: program.module() for name, program in floats.items()}
    with torch.no_grad():
        for method, args, kwargs in calls:
            assert torch.equal(modules[method](*args, **kwargs),
                               expected[method](*args, **kwargs)), method
            state = grid.dequantize(modules["decode"].get_buffer("cache"))
            assert torch.equal(state, expected["decode"].get_buffer("cache")), method
    alone = {name: quantize_program(program, qnn_quantizer(),
                                    [(args, kwargs) for m, args, kwargs in calls if m == name])
             for name, program in copy_program(dict(programs)).items()}
    eager = calls_in_sequence(reference, calls)
    ours = errors_per_call(eager, calls_in_sequence(dict(floats), calls))
    theirs = errors_per_call(eager, calls_in_sequence(alone, calls))
    assert max(ours) <= max(theirs), (ours, theirs)
