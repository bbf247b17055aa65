"""What Core ML does to the state it owns, said by BufferOwningPartitioner before lowering.

Core ML keeps state in fp16 only (coremltools casts an fp32 buffer, with a log line, and an
int64 counter silently: exact only up to 2048), fails deep in its converter on an int8
buffer (``slice_update ... update has dtype int8``), and zero-fills state when a model is
prewarmed. The wrapper raises ``DelegateStateDtypeError`` for int8 state (naming the buffer
and the backend), keeps other integer and bool state at the top level with a note, and
warns ``DelegateStateWarning`` for the others; a demo-backend delegate owning the same
buffers gets no warning.
"""

from __future__ import annotations

import copy
import warnings

import pytest

pytest.importorskip("coremltools")

import coremltools
import torch
from executorch.exir import to_edge, to_edge_transform_and_lower

from pass_manager import PassManager, assert_same_behaviour
from passes import QuantizeMutableBuffers
from passes.delegation import BufferConsumptionError
from passes.executorch import (
    BufferOwningPartitioner,
    DelegateStateDtypeError,
    DelegateStateWarning,
    ExecuTorchInputError,
    executorch_state,
)
from tests.models.coreml_cases import (
    Accumulator,
    CacheWrite,
    CountedCache,
    RunningMean,
    cache_inputs,
    coreml_io,
    coreml_ops,
    coreml_partitioner,
    coreml_states,
    delegates,
    exported,
    owned_buffers,
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


class _Bfloat16Accumulator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(1, 4, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(x.to(torch.bfloat16))
        return self.acc.float() * 2


def test_wrapped_refuses_bfloat16_state_naming_buffer_and_backend():
    """Core ML's converter has no number for bfloat16: ExecuTorch alone, and the wrapper on
    7c422be (after warning that Core ML keeps the buffer as fp16 state), failed inside
    coremltools with a bare ``KeyError: torch.bfloat16``."""
    program = torch.export.export(_Bfloat16Accumulator(), (torch.randn(1, 4),))
    with pytest.raises(DelegateStateDtypeError) as info:
        to_edge_transform_and_lower(program,
                                    partitioner=[BufferOwningPartitioner(coreml_partitioner())])
    error = info.value
    assert (error.buffer, error.backend, error.dtype) == ("acc", "CoreMLBackend", torch.bfloat16)
    assert "store it as float32 or float16" in str(error)


def test_coreml_alone_holds_an_integer_count_as_fp16_state():
    """ExecuTorch alone hands the count to Core ML, which keeps it as fp16 state without a
    word: on the device it stops counting at 2048 (2048 + 1 rounds to 2048 in fp16)."""
    edge = to_edge_transform_and_lower(exported(RunningMean(), cache_inputs()),
                                       partitioner=[coreml_partitioner()])
    (delegate,) = delegates(edge.exported_program())
    assert coreml_states(delegate) == {"total": "FLOAT16", "count": "FLOAT16"}


def test_coreml_alone_fails_in_its_converter_on_a_position_counter():
    """The fp16 state then indexes the cache, which coremltools refuses, untyped."""
    with pytest.raises(ValueError, match="Only bool and int index handled"):
        to_edge_transform_and_lower(exported(CountedCache(), cache_inputs()),
                                    partitioner=[coreml_partitioner()])


@pytest.mark.parametrize("make, counter, why", [
    (CountedCache, "position", "(an integer above 2048 is rounded)"),
    # The note said "an integer above 2048 is rounded" of a bool buffer too.
    (lambda: CountedCache(torch.bool), "position", "(its True / False would be float16 "
                                                   "1.0 / 0.0)"),
    (RunningMean, "count", "(an integer above 2048 is rounded)"),
], ids=["int64 position", "bool position", "int64 count"])
def test_wrapped_keeps_integer_and_bool_state_at_the_top_level(make, counter, why):
    model = make()
    wrapper = BufferOwningPartitioner(coreml_partitioner())
    edge = to_edge_transform_and_lower(exported(model, cache_inputs()), partitioner=[wrapper])
    program = edge.exported_program()
    (delegate,) = delegates(program)
    floats = {name for name, b in model.named_buffers() if b.is_floating_point()}
    assert owned_buffers(delegate) == floats
    assert coreml_states(delegate) == dict.fromkeys(floats, "FLOAT16")
    (note,) = [n for n in wrapper.notes if f"'{counter}'" in n]
    assert note.startswith(f"kept '{counter}' at the top level: CoreMLBackend keeps float16")
    assert why in note, note
    assert_same_behaviour(model, program, cache_inputs(), atol=1e-5, state=executorch_state)
    edge.to_executorch()


def test_wrapped_strict_refuses_to_keep_integer_state_out():
    edge = to_edge(exported(CountedCache(), cache_inputs())).exported_program()
    with pytest.raises(BufferConsumptionError) as info:
        BufferOwningPartitioner(coreml_partitioner(), strict=True).partition(edge)
    assert type(info.value) is BufferConsumptionError  # not the int8 refusal
    assert info.value.buffer == "position"
    assert "would not hold this int64 buffer" in info.value.reason


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


# keep_precision: fp32 state a user needs exact stays at the top level, in fp32.

def _accumulator_inputs(calls: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(1, 4, generator=generator), torch.tensor([step % 8]))
            for step in range(calls)]


def _lowered_accumulator(precision, **options):
    model = Accumulator()
    wrapper = BufferOwningPartitioner(coreml_partitioner(precision=precision), **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        edge = to_edge_transform_and_lower(exported(model, _accumulator_inputs()),
                                           partitioner=[wrapper])
    found = sorted((w.message.buffer, w.message.issue) for w in caught
                   if isinstance(w.message, DelegateStateWarning))
    return model, wrapper, edge, found


@pytest.mark.parametrize("keep", [["acc"], ("acc",), True], ids=["list", "tuple", "all"])
def test_keep_precision_keeps_fp32_state_at_the_top_level(keep):
    """The accumulator adds x / 1000 to 1000: Core ML's fp16 state (spacing 0.5 there)
    would keep 1000 forever. Kept out, it is an fp32 input and output of the Core ML
    model with no cast on its path (fp32 compute), and the lowered program equals eager
    bit for bit, outputs and state, over 6 calls."""
    model, wrapper, edge, found = _lowered_accumulator(coremltools.precision.FLOAT32,
                                                       keep_precision=keep)
    program = edge.exported_program()
    assert "acc" in program.graph_signature.buffers_to_mutate.values()
    assert program.state_dict["acc"].dtype == torch.float32
    (delegate,) = delegates(program)
    owned = set() if keep is True else {"cache"}
    assert owned_buffers(delegate) == owned
    assert coreml_states(delegate) == dict.fromkeys(owned, "FLOAT16")
    inputs, outputs = coreml_io(delegate)
    assert inputs["b_acc"] == "FLOAT32" and set(outputs.values()) == {"FLOAT32"}
    readers = [op for op, args in coreml_ops(delegate) if "b_acc" in args]
    assert readers == ["add"]  # acc + x / 1000 in fp32, not cast to fp16 first
    (note,) = [n for n in wrapper.notes if "'acc'" in n]
    assert note.startswith("kept 'acc' at the top level: keep_precision asks for it")
    assert found == [("cache", "fp16")] * (keep is not True)
    assert_same_behaviour(model, program, _accumulator_inputs(), atol=0,
                          state=executorch_state)
    edge.to_executorch()


def test_coreml_alone_holds_the_accumulator_as_fp16_state():
    """What keep_precision changes: without it Core ML owns the accumulator as fp16 state
    (read, cast to fp32, added, cast back to fp16, zero-filled when prewarmed), with the
    warning naming the way out."""
    _, _, edge, found = _lowered_accumulator(coremltools.precision.FLOAT32)
    (delegate,) = delegates(edge.exported_program())
    assert coreml_states(delegate) == {"acc": "FLOAT16", "cache": "FLOAT16"}
    assert found == [("acc", "fp16"), ("acc", "initial value"), ("cache", "fp16")]
    assert "keep_precision=['acc']" in str(_partition_warnings(Accumulator(),
                                                              coreml_partitioner())[0])


def test_keep_precision_under_fp16_compute_warns_that_the_value_is_rounded():
    """Kept fp32 at the top level, the accumulator is still added in fp16 when the Core ML
    partition computes in fp16 (the default): the wrapper says so, naming the fix."""
    _, _, edge, found = _lowered_accumulator(coremltools.precision.FLOAT16,
                                             keep_precision=["acc"])
    assert ("acc", "fp16 compute") in found
    (delegate,) = delegates(edge.exported_program())
    assert [op for op, args in coreml_ops(delegate) if "b_acc" in args] == ["cast"]


def test_keep_precision_is_no_refusal_under_strict():
    """strict=True refuses a buffer kept at the top level for the wrapper's own reasons,
    not one the user asked to keep."""
    edge = to_edge(exported(Accumulator(), _accumulator_inputs())).exported_program()
    wrapper = BufferOwningPartitioner(coreml_partitioner(), strict=True, keep_precision=["acc"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DelegateStateWarning)
        wrapper.partition(edge)
    assert [v.fqn for v in wrapper.ownership if v.consumable] == ["cache"]


@pytest.mark.parametrize("keep, match", [
    (["acc", "acum"], "names 'acum', which the program has no buffer called"),
    ("acc", r"for one buffer: keep_precision=\['acc'\]"),
    (1, "pass True"),
], ids=["misspelt", "a string", "an int"])
def test_keep_precision_refuses_what_would_keep_nothing(keep, match):
    program = to_edge(exported(Accumulator(), _accumulator_inputs())).exported_program()
    with pytest.raises(ExecuTorchInputError, match=match) as info:
        BufferOwningPartitioner(coreml_partitioner(), keep_precision=keep).partition(program)
    assert info.value.argument == "keep_precision"


# State shared by methods stays fp32 at the top level, and so does state kept there for an
# ownership reason: a Core ML partition computing in fp16 still rounds its new value.

def _method_warnings(precision) -> dict[str, list[tuple[str, str]]]:
    """The DelegateStateWarnings of partitioning each method of a running total that the
    ``wide`` method adds to and the ``narrow`` one only reads (both lowered to Core ML)."""
    from tests.models.methods_on_runtime import accumulator_methods

    programs = accumulator_methods().programs
    edge = to_edge(copy.deepcopy(programs))
    wrapper = BufferOwningPartitioner(coreml_partitioner(precision=precision), methods=programs)
    found = {}
    for method in programs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapper.partition(edge.exported_program(method))
        found[method] = [(w.message.buffer, w.message.issue, str(w.message)) for w in caught
                         if isinstance(w.message, DelegateStateWarning)]
    return found


def test_state_shared_by_methods_under_fp16_compute_warns_that_its_value_is_rounded():
    """The total stays fp32 at the top level (the methods share it), and the wide method's
    Core ML partition casts it to fp16, adds and casts back: its new value is rounded on
    every call (the .mlpackage's ops, as with keep_precision). Said for the method that
    writes it, not the one that only reads it."""
    found = _method_warnings(coremltools.precision.FLOAT16)
    assert found["narrow"] == []
    ((buffer, issue, message),) = found["wide"]
    assert (buffer, issue) == ("total", "fp16 compute")
    assert "in method 'wide'" in message and "'narrow', 'wide'" in message
    assert "compute_precision=coremltools.precision.FLOAT32" in message


def test_state_shared_by_methods_under_fp32_compute_does_not_warn():
    assert _method_warnings(coremltools.precision.FLOAT32) == {"narrow": [], "wide": []}


class _Decay(torch.nn.Module):
    """State updated from itself and constants alone (no user input on its path)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(1.0).mul_(0.5)
        return self.acc.sum(0, keepdim=True) + x


def test_state_updated_from_constants_alone_gets_no_copy():
    """The trial partition deciding copies lowers the buffer's neighbourhood, which had no
    user input here; torch's constant lifting then misnamed its two scalars, the trial
    failed (SpecViolationError, on 91ee2ec) and the Core ML delegate returned a copy of
    the whole buffer every call for nothing."""
    wrapper = BufferOwningPartitioner(coreml_partitioner())
    with torch.no_grad():
        wrapper.transform_for_pre_decomposition(torch.export.export(_Decay(), (torch.ones(4),)))
    assert wrapper.copy_plan.failure is None
    assert wrapper.copy_plan.copied == frozenset() and wrapper.copy_plan.inside == {"acc"}
