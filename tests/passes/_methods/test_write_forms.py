"""quantize_methods shares a cache's observers whatever form its writes take.

Each model of tests/models/write_forms.py writes its cache its own way (through a
transposed view, a narrow, a sliding window with and without a shift, row selects, an
unflattened view, and two ways at once); its prefill (4 tokens) and decode (1 token) are
quantized together with XNNPACK's quantizer, then run along calls other than the
calibration ones and compared with the eager module, outputs and cache, call after call.
The cache holds one grid in both methods.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager.validation import copy_program
from passes._methods.grid_facet import buffer_grids
from passes.flow.examples import xnnpack_quantizer
from passes.quantization import quantize_methods
from tests.models.write_forms import WRITE_FORMS, write_form_calls, write_form_methods


@pytest.mark.parametrize("form", WRITE_FORMS)
def test_a_cache_written_in_any_form_holds_one_grid_and_decodes_like_eager(form):
    module, programs = write_form_methods(form)
    reference = copy.deepcopy(module)
    calibration = [call for seed in range(1, 13) for call in write_form_calls(4, seed)]
    quantized = quantize_methods(copy_program(programs), xnnpack_quantizer(), calibration)
    assert quantized.shared_buffers == {"cache": ["prefill", "decode"]}
    assert quantized.observers["cache"] >= 2  # one of each method at least, made one
    grids = {name: buffer_grids(program) for name, program in quantized.items()}
    assert grids["prefill"]["cache"] == grids["decode"]["cache"], grids
    assert quantized["prefill"].state_dict["cache"] is quantized["decode"].state_dict["cache"]

    methods = {name: program.module() for name, program in quantized.items()}
    cache = methods["decode"].get_buffer("cache")
    assert methods["prefill"].get_buffer("cache") is cache
    with torch.no_grad():
        for seed in (20, 21):
            for method, args, kwargs in write_form_calls(4, seed):
                want = reference(*args, **kwargs)
                got = methods[method](*args, **kwargs)
                # Within 8-bit error of eager (the input, the weights and the cache on
                # int8 grids), the state as the outputs.
                assert (cache - reference.cache).abs().max() < 0.1, (method, seed)
                assert (got - want).abs().max() < 0.1, (method, seed)
