"""What Core ML does to the state it owns, said by BufferOwningPartitioner before lowering.

Core ML keeps state in fp16 only (coremltools casts an fp32 buffer, with a log line), fails
deep in its converter on an integer buffer (``slice_update ... update has dtype int8``),
and zero-fills state when a model is prewarmed. The wrapper raises
``DelegateStateDtypeError`` for the first (naming the buffer and the backend) and warns
``DelegateStateWarning`` for the others; a demo-backend delegate owning the same buffers
gets no warning.
"""

from __future__ import annotations

import copy
import warnings

import pytest

pytest.importorskip("coremltools")

import torch
from executorch.exir import to_edge, to_edge_transform_and_lower

from pass_manager import PassManager
from passes import QuantizeMutableBuffers
from passes.executorch import (
    BufferOwningPartitioner,
    DelegateStateDtypeError,
    DelegateStateWarning,
)
from tests.models.coreml_cases import (
    CacheWrite,
    cache_inputs,
    coreml_partitioner,
    exported,
)
from tests.models.executorch_cases import everything
from tests.models.quantized_state import GridCache, grid_inputs
from tests.models.quantized_state import exported as quantized_form


@pytest.fixture(scope="module")
def int8_cache():
    """GridCache's cache stored as int8 by QuantizeMutableBuffers."""
    program = quantized_form(GridCache("index_copy"), grid_inputs(1)[0], "exported_program")
    PassManager([QuantizeMutableBuffers()]).run(program)
    assert program.state_dict["cache"].dtype == torch.int8
    return program


def test_coreml_alone_fails_in_its_converter_on_integer_state(int8_cache):
    with pytest.raises(ValueError, match="update has dtype int8 whereas x has dtype fp32"):
        to_edge_transform_and_lower(copy.deepcopy(int8_cache),
                                    partitioner=[coreml_partitioner()])


def test_wrapped_refuses_integer_state_naming_buffer_and_backend(int8_cache):
    with pytest.raises(DelegateStateDtypeError) as info:
        to_edge_transform_and_lower(copy.deepcopy(int8_cache),
                                    partitioner=[BufferOwningPartitioner(coreml_partitioner())])
    error = info.value
    assert (error.buffer, error.backend, error.dtype) == ("cache", "CoreMLBackend", torch.int8)
    assert error.pass_name == "BufferOwningPartitioner"
    assert "'cache'" in str(error) and "CoreMLBackend" in str(error)


def _partition_warnings(model, partitioner) -> list[DelegateStateWarning]:
    edge = to_edge(exported(model, cache_inputs())).exported_program()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BufferOwningPartitioner(partitioner).partition(edge)
    return [w.message for w in caught if isinstance(w.message, DelegateStateWarning)]


def test_fp32_state_owned_by_coreml_warns_of_fp16():
    (warning,) = _partition_warnings(CacheWrite(), coreml_partitioner())
    assert (warning.buffer, warning.backend, warning.issue) == ("cache", "CoreMLBackend", "fp16")
    assert "torch.float32" in str(warning) and "float16" in str(warning)


def test_nonzero_initial_state_owned_by_coreml_warns_of_zero_fill():
    """Through to_edge_transform_and_lower, whose partition step sees fake state: the
    values are read before, where they are real."""
    initial = torch.arange(32.0).reshape(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        to_edge_transform_and_lower(exported(CacheWrite(initial), cache_inputs()),
                                    partitioner=[BufferOwningPartitioner(coreml_partitioner())])
    found = [w.message for w in caught if isinstance(w.message, DelegateStateWarning)]
    assert sorted(w.issue for w in found) == ["fp16", "initial value"]
    (zero_fill,) = [w for w in found if w.issue == "initial value"]
    assert zero_fill.buffer == "cache" and "31 of 32 elements" in str(zero_fill)
    assert "ZeroInitialState" in str(zero_fill)


def test_other_backends_owning_the_same_state_do_not_warn():
    assert _partition_warnings(CacheWrite(torch.ones(8, 4)), everything()) == []
