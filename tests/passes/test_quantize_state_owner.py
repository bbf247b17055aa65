"""QuantizeMutableBuffers keeps a buffer a stateful delegate will own in a dtype that
delegate takes: Core ML (``CoreMLPartitioner(take_over_mutable_buffer=True)``) keeps state
as float only and fails to lower integer state (``slice_update ... update has dtype int8
whereas x has dtype fp32``).

Told the owner (``state_owner="coreml"``, or ``QuantizeMutableBuffers.for_partitioner``),
the pass keeps those buffers float with a note naming buffer and owner, or under
``strict`` refuses with a :class:`StateOwnerError`. The Core ML tests lower on Linux with an
iOS 18 compile spec (running needs macOS, so the delegate's Python path, its
``original_module``, is what runs); they are skipped without coremltools.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.utils._pytree as pytree

from pass_manager import PassFailedError, PassManager
from pass_manager.program import program_text
from passes import QuantizedStateError, QuantizeMutableBuffers, mutable_buffers
from passes._analysis.grids import same_bits
from passes.errors import StateOwnerError
from passes.quantize_mutable_buffers import state_owner_of
from tests.models.quantized_state import (
    CacheAndAccumulator,
    GridCache,
    accumulator_inputs,
    bit_identical,
    exported,
    grid_inputs,
    quantize,
)

KEPT = ("cache: stays float32: coreml will own it: Core ML keeps state as float only "
        "(float16 on device; it casts float32 state to float16), so it stays float (its "
        "writes store values of int8 [-128, 127], scale=0.05, zero_point=3)")


def grid_cache(form: str = "exported_program"):
    calls = grid_inputs()
    return exported(GridCache("index_copy"), calls[0], form), calls


def quantize_state(program, pass_):
    result = PassManager([pass_], strict=True).run(program)
    return result, result.report.records[0]


@pytest.mark.parametrize("form", ["graph_module", "exported_program"])
def test_a_buffer_core_ml_will_own_stays_float_with_a_note(form):
    program, calls = grid_cache(form)
    reference = copy.deepcopy(program)
    result, record = quantize_state(program, QuantizeMutableBuffers(state_owner="coreml"))
    assert not result.modified
    assert record.notes == [KEPT]
    assert record.statistics == {"buffers left float": 1, "cache: left float": 1,
                                 "cache: kept float for coreml": 1,
                                 "state bytes before": 256, "state bytes after": 256}
    assert mutable_buffers(program)["cache"].grid is None
    assert program_text(program) == program_text(reference)
    bit_identical(reference, program, calls)


def test_strict_refuses_naming_the_buffer_and_the_owner():
    program, _ = grid_cache()
    before = program_text(program)
    with pytest.raises(PassFailedError) as error:
        quantize_state(program, QuantizeMutableBuffers(strict=True, state_owner="coreml"))
    cause = error.value.__cause__
    assert isinstance(cause, StateOwnerError) and isinstance(cause, QuantizedStateError)
    assert (cause.node, cause.owner) == ("cache", "coreml")
    assert cause.reason.startswith("buffer 'cache' stays float: coreml will own it")
    assert program_text(program) == before


def test_owned_buffers_names_which_buffers_the_owner_takes():
    gm = quantize(CacheAndAccumulator(), accumulator_inputs()[0], accumulator_inputs()[:4],
                  "xnnpack")
    # The owner takes the accumulator only: the cache is still stored as integers.
    _, record = quantize_state(gm, QuantizeMutableBuffers(state_owner="coreml",
                                                          owned_buffers=("acc",)))
    assert record.statistics["buffers stored as integers"] == 1
    assert mutable_buffers(gm)["cache"].grid is not None
    assert "acc: kept float for coreml" not in record.statistics  # float for its own reason


def test_an_unknown_owner_or_owned_buffer_is_a_typed_error():
    program, _ = grid_cache()
    before = program_text(program)
    with pytest.raises(PassFailedError) as error:
        quantize_state(program, QuantizeMutableBuffers(state_owner="vulkan"))
    cause = error.value.__cause__
    assert isinstance(cause, QuantizedStateError) and "'coreml'" in cause.reason
    with pytest.raises(PassFailedError) as error:  # misspelt: "cache" would become int8
        quantize_state(program, QuantizeMutableBuffers(state_owner="coreml",
                                                       owned_buffers=("cahce",)))
    cause = error.value.__cause__
    assert isinstance(cause, QuantizedStateError) and cause.node == "cahce"
    assert "not a mutable buffer of the program (cache)" in cause.reason
    assert program_text(program) == before


# -- Core ML --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coreml():
    """``partitioner()``: a fresh ``CoreMLPartitioner(take_over_mutable_buffer=True)`` with
    an iOS 18 compile spec (stateful models need it), and ``lower(program)``."""
    ct = pytest.importorskip("coremltools")
    pytest.importorskip("executorch.backends.apple.coreml.partition")
    from executorch.backends.apple.coreml.compiler import CoreMLBackend
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    from executorch.exir import to_edge_transform_and_lower

    def partitioner():
        specs = CoreMLBackend.generate_compile_specs(minimum_deployment_target=ct.target.iOS18)
        return CoreMLPartitioner(compile_specs=specs, take_over_mutable_buffer=True)

    def lower(program):
        return to_edge_transform_and_lower(program, partitioner=[partitioner()])

    class CoreML:
        pass

    found = CoreML()
    found.partitioner, found.lower, found.cls = partitioner, lower, CoreMLPartitioner
    return found


def owned_by_core_ml(edge) -> tuple[object, set[str]]:
    """The one Core ML delegate of a lowered program and the buffers it owns (none left at
    the top level)."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    top = edge.exported_program()
    assert not top.graph_signature.buffers_to_mutate
    assert not top.graph_signature.inputs_to_buffers
    ((_, lowered, _),) = get_lowered_submodules(top.graph_module)
    assert lowered.backend_id == "CoreMLBackend"
    return lowered, set(lowered.original_module.graph_signature.buffers_to_mutate.values())


def test_state_owner_is_read_from_the_partitioner(coreml):
    from executorch.exir.backend.partitioner import Partitioner

    assert state_owner_of(coreml.partitioner()) == "coreml"
    assert state_owner_of(coreml.cls(take_over_mutable_buffer=False)) is None
    assert state_owner_of(object()) is None

    class Wrapper(Partitioner):  # holds the partitioner it wraps, as BufferOwningPartitioner
        def __init__(self, partitioner):
            super().__init__()
            self.partitioner = partitioner

        def partition(self, exported_program):
            return self.partitioner.partition(exported_program)

    assert state_owner_of(Wrapper(coreml.partitioner())) == "coreml"
    pass_ = QuantizeMutableBuffers.for_partitioner(coreml.partitioner(), strict=True)
    assert (pass_.state_owner, pass_.strict) == ("coreml", True)


def test_integer_state_fails_inside_core_ml_and_the_owner_keeps_it_float(coreml):
    """Today's failure: the cache stored as int8 and lowered. With the owner known, a typed
    error before lowering (strict), or the float cache Core ML lowers and owns."""
    program, _ = grid_cache()
    stored = copy.deepcopy(program)
    PassManager([QuantizeMutableBuffers()]).run(stored)
    assert stored.state_dict["cache"].dtype == torch.int8
    with pytest.raises(ValueError, match="update has dtype int8 whereas x has dtype fp32"):
        coreml.lower(stored)

    with pytest.raises(PassFailedError) as error:
        quantize_state(copy.deepcopy(program),
                       QuantizeMutableBuffers.for_partitioner(coreml.partitioner(), strict=True))
    assert isinstance(error.value.__cause__, StateOwnerError)
    assert (error.value.__cause__.node, error.value.__cause__.owner) == ("cache", "coreml")

    _, record = quantize_state(program, QuantizeMutableBuffers.for_partitioner(
        coreml.partitioner()))
    assert record.notes == [KEPT]
    _, owned = owned_by_core_ml(coreml.lower(program))
    assert owned == {"cache"}


@functools.cache
def _quantized_decoder():
    from passes.examples import AnnotateEveryOpQuantizer, decode_inputs, kv_decoder
    from passes.quantization import quantize_program

    model, example = kv_decoder(1, cache_update="index_put")
    calls = decode_inputs(model.cfg, 6, seed=3)
    with torch.no_grad():
        program = torch.export.export(model, example)
    return quantize_program(program, AnnotateEveryOpQuantizer(), calls[:2]), calls


CACHES = {"layers.0.attn.k_cache", "layers.0.attn.v_cache"}


def test_core_ml_owns_the_float_caches_of_a_quantized_decoder(coreml):
    quantized, calls = _quantized_decoder()
    program = copy.deepcopy(quantized)
    reference = copy.deepcopy(quantized)
    _, record = quantize_state(program, QuantizeMutableBuffers.for_partitioner(
        coreml.partitioner()))
    assert record.statistics["buffers left float"] == 2
    for fqn in CACHES:
        assert record.statistics[f"{fqn}: kept float for coreml"] == 1
        (note,) = [n for n in record.notes if n.startswith(f"{fqn}: ")]
        assert "coreml will own it: Core ML keeps state as float only" in note
        assert "its writes store values of uint8" in note
    lowered, owned = owned_by_core_ml(coreml.lower(program))
    assert owned == CACHES

    # The delegate's Python path, called in a row, against the quantized program.
    delegate, expected = lowered.original_module.module(), reference.module()
    with torch.no_grad():
        for call, args in enumerate(calls):
            (want,), (got,) = pytree.tree_leaves(expected(*args)), delegate(*args)
            assert same_bits(want, got), f"call {call}"
            state = dict(delegate.named_buffers())
            for fqn, value in expected.named_buffers():
                if fqn in CACHES:
                    assert same_bits(value, state[fqn]), f"call {call}: {fqn}"
    assert dict(delegate.named_buffers())["layers.0.attn.k_cache"].abs().sum() > 0
