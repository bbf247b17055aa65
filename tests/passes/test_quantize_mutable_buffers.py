"""QuantizeMutableBuffers: state holding only quantized values is stored as integers.

The reference of every behaviour test is the same quantized program before the pass (its
state in fp32): called ``STEPS`` times in a row, the transformed program must return the
same outputs bit for bit, and its buffers, dequantized on their grids, must hold the same
values bit for bit after every call. Programs come from real modules: the main job's
decoder and a tiny Hugging Face Llama through torchao's pt2e flow with the passes, and
small modules quantized by hand (``quantized_decomposed`` ops in ``forward``), one per way
of writing a cache. Forms: the converted GraphModule (in-place writes), the GraphModule of
a functional program (trailing ``copy_`` write-backs) and the functional ExportedProgram;
the modules quantized by hand also as exported (in-place writes in the ExportedProgram).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

from pass_manager import PassFailedError, PassManager, parse_pipeline, run_program
from pass_manager.program import program_text
from passes import (
    ConsumeBufferMutationsInDelegate,
    QuantizedStateError,
    QuantizeMutableBuffers,
    conditions,
    mutable_buffers,
    reset_mutable_buffers,
)
from passes._analysis.grids import same_bits
from passes._analysis.quantized_state import state_storage
from passes.delegation import AllNodePartitioner, delegates, program_state, to_delegate
from tests.models.hf import decode_steps, llama_module
from tests.models.quantized_state import (
    FORMS,
    HAND_FORMS,
    QUANTIZERS,
    STEPS,
    CacheAndAccumulator,
    ComputedAfterDequantize,
    EmptyPartOnAnotherGrid,
    GridCache,
    MalformedGrid,
    MaskedRead,
    PerChannelCache,
    ReadBeforeWrite,
    SharedStorage,
    TwoGrids,
    accumulator_inputs,
    bit_identical,
    exported,
    grid_inputs,
    in_form,
    on_grid_initial,
    quantize,
    quantized_decoder,
)

CACHES = ("layers.0.attn.k_cache", "layers.0.attn.v_cache")


def quantize_state(program, **options):
    """Run the pass on ``program`` (in place, its declared effects checked); its record."""
    result = PassManager([QuantizeMutableBuffers(**options)], strict=True).run(program)
    assert result.program is program
    return result, result.report.records[0]


def stored_as_integers(program, fqn: str, dtype: torch.dtype) -> None:
    """``fqn`` is held as ``dtype`` integers, its nodes say so, and mutable_buffers gives
    its grid."""
    info = mutable_buffers(program)[fqn]
    assert info.grid is not None and info.grid.dtype == dtype
    storage = state_storage(program)[fqn]
    assert storage.dtype == dtype and storage.grid is info.grid
    graph = program.graph
    for name in info.nodes:
        node = next(n for n in graph.nodes if n.name == name)
        val = node.meta.get("val")
        assert val is None or val.dtype == dtype, name


def decoder(cache_update: str, quantizer: str, form: str):
    """``(program, calls)``: the decoder quantized, in ``form``; ``functional_graph_module``
    is what torchao returns when the flow starts from the functionalized program."""
    gm, example, calls = quantized_decoder(cache_update, quantizer,
                                           functional=form == "functional_graph_module")
    return (gm if form != "exported_program" else in_form(gm, example, form)), calls


# -- the main job's decoder ---------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
@pytest.mark.parametrize("cache_update", ["index_copy", "index_put"])
def test_decoder_caches_are_stored_as_integers_bit_for_bit(cache_update, quantizer, form):
    program, calls = decoder(cache_update, quantizer, form)
    reference = copy.deepcopy(program)
    before = state_storage(program)
    _, record = quantize_state(program)

    dtype = torch.int8 if quantizer == "xnnpack" else torch.uint8
    assert record.statistics["buffers stored as integers"] == 2
    assert "buffers left float" not in record.statistics
    after = state_storage(program)
    for fqn in CACHES:
        stored_as_integers(program, fqn, dtype)
        assert before[fqn].dtype == torch.float32
        assert after[fqn].nbytes * 4 == before[fqn].nbytes
        assert record.statistics[f"{fqn}: bytes float32"] == before[fqn].nbytes
    assert record.statistics["state bytes after"] * 4 == record.statistics["state bytes before"]
    bit_identical(reference, program, calls)
    if form != "graph_module":
        assert conditions.Functional.check(program) == []
    assert conditions.MutableBuffersMarked.check(program) == []


def test_every_write_stores_integers_and_reads_dequantize_where_they_read():
    """The GraphModule torchao returns for the every-op quantizer: the cache update's result
    was re-quantized onto the cache's grid, so that read takes the integers directly."""
    program, _ = decoder("index_copy", "every_op", "graph_module")
    quantize_state(program)
    qd = torch.ops.quantized_decomposed
    for write in program.graph.find_nodes(op="call_function",
                                           target=torch.ops.aten.index_copy_.default):
        assert write.args[3].target is qd.quantize_per_tensor.default  # stores q itself
        assert not [u for u in write.users if u.target is qd.quantize_per_tensor.default]
        assert all(u.target is qd.dequantize_per_tensor.default for u in write.users)


# -- write forms, initial values, grids ------------------------------------------------------
@pytest.fixture(scope="module")
def hand_quantized():
    """``(program, calls)`` for a module quantized by hand, exported once per form."""

    @functools.cache
    def build(name: str, form: str):
        model = HAND_QUANTIZED[name]()
        calls = grid_inputs()
        return exported(model, calls[0], form), calls

    def get(name: str, form: str):
        program, calls = build(name, form)
        return copy.deepcopy(program), calls

    return get


HAND_QUANTIZED = {
    **{f"write_{w}": functools.partial(GridCache, w)
       for w in ("index_copy", "index_put", "slice", "select", "shift", "where",
                 "where_broadcast")},
    "read_before_write": ReadBeforeWrite,
    "initial_on_grid": lambda: GridCache("index_copy", on_grid_initial()),
    "initial_off_grid": lambda: GridCache("index_copy", on_grid_initial(offset=1e-3)),
    "two_grids": TwoGrids,
    "empty_part_on_another_grid": EmptyPartOnAnotherGrid,
    "empty_part_of_another_dtype": lambda: EmptyPartOnAnotherGrid(
        (0.04, 128, 0, 255, torch.uint8)),
    "computed_after_dequantize": ComputedAfterDequantize,
    "per_channel": PerChannelCache,
    "per_channel_axis_lost": lambda: PerChannelCache(split=True),
    # Its zeros stored per channel (each channel's zero point): QuantizedStateError before.
    "per_channel_fresh_cache": lambda: PerChannelCache(fresh=True),
    # A masked read's zeros re-quantized: QuantizedStateError (no grid) before.
    "masked_read": MaskedRead,
    "shared_storage": SharedStorage,
}
STAY_FLOAT = {
    "initial_off_grid": "its contents and its initial value not on the grid",
    "two_grids": "two grids",
    "empty_part_of_another_dtype": "an empty value of another integer dtype",
    "computed_after_dequantize": "computed by mul.Tensor",
    "per_channel_axis_lost": "does not keep the channel axis",
    "shared_storage": "shares its storage with 'cache'",
}


@pytest.mark.parametrize("form", HAND_FORMS)
@pytest.mark.parametrize("name", sorted(HAND_QUANTIZED))
def test_each_write_form_is_stored_as_integers_or_left_float(hand_quantized, name, form):
    program, calls = hand_quantized(name, form)
    reference = copy.deepcopy(program)
    result, record = quantize_state(program)
    (fqn,) = mutable_buffers(program)  # export names an aliased buffer once: "alias"
    if name in STAY_FLOAT:
        assert not result.modified
        assert record.statistics == {"buffers left float": 1, f"{fqn}: left float": 1,
                                     "state bytes before": 256, "state bytes after": 256}
        (note,) = record.notes
        assert note.startswith(f"{fqn}: stays float32: ") and STAY_FLOAT[name] in note
        assert mutable_buffers(program)[fqn].grid is None
        assert program_text(program) == program_text(reference)
    else:
        assert result.modified
        stored_as_integers(program, "cache", torch.int8)
        assert record.statistics["state bytes after"] == 64
    bit_identical(reference, program, calls)


@pytest.mark.parametrize("form", FORMS)
def test_reset_restores_the_integer_initial_value(hand_quantized, form):
    program, calls = hand_quantized("initial_on_grid", form)
    quantize_state(program)
    info = mutable_buffers(program)["cache"]
    initial = on_grid_initial()
    assert torch.equal(info.initial, info.grid.quantize(initial))
    assert same_bits(info.grid.dequantize(info.initial), initial)
    module = program.module() if form == "exported_program" else program
    with torch.no_grad():
        for args in calls[:3]:
            module(*args)
    cache = dict(module.named_buffers())["cache"]
    assert cache.dtype == torch.int8 and not torch.equal(cache, info.initial)
    assert reset_mutable_buffers(module) == ["cache"]
    assert torch.equal(dict(module.named_buffers())["cache"], info.initial)


def test_per_channel_grid_keeps_its_axis(hand_quantized):
    program, _ = hand_quantized("per_channel", "exported_program")
    quantize_state(program)
    grid = mutable_buffers(program)["cache"].grid
    assert grid.axis == 2 and grid.scale.tolist() == pytest.approx([0.02, 0.05, 0.1, 0.03])
    assert program.state_dict["cache"].dtype == torch.int8


# -- state that must stay float, and what the pass refuses ------------------------------------
@functools.cache
def _accumulator(quantizer: str):
    model, calls = CacheAndAccumulator(), accumulator_inputs()
    return quantize(model, calls[0], calls[:4], quantizer), calls


@pytest.mark.parametrize("form", ["graph_module", "exported_program"])
@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
def test_accumulator_stays_float_beside_an_integer_cache(quantizer, form):
    gm, calls = _accumulator(quantizer)
    program = in_form(copy.deepcopy(gm), calls[0], form)
    reference = copy.deepcopy(program)
    _, record = quantize_state(program)
    assert record.statistics["buffers stored as integers"] == 1
    assert record.statistics["acc: left float"] == 1
    assert any(n.startswith("acc: stays float32: ") and "add" in n for n in record.notes)
    assert mutable_buffers(program)["acc"].grid is None
    assert state_storage(program)["acc"].dtype == torch.float32
    stored_as_integers(program, "cache", torch.int8 if quantizer == "xnnpack" else torch.uint8)
    bit_identical(reference, program, calls)


def test_strict_refuses_a_buffer_that_must_stay_float():
    program = copy.deepcopy(_accumulator("xnnpack")[0])
    before = program_text(program)
    with pytest.raises(PassFailedError) as error:
        quantize_state(program, strict=True)
    cause = error.value.__cause__
    assert isinstance(cause, QuantizedStateError) and cause.node == "acc"
    assert "add" in cause.reason
    assert program_text(program) == before


@pytest.mark.parametrize("form", FORMS)
def test_malformed_dequantize_is_a_typed_error_naming_the_node(form):
    calls = grid_inputs()
    program = exported(MalformedGrid(), calls[0], form)
    before = program_text(program)
    with pytest.raises(PassFailedError) as error:
        quantize_state(program)
    cause = error.value.__cause__
    assert isinstance(cause, QuantizedStateError)
    assert cause.node.startswith("dequantize_per_tensor") and "quant_min 127 > quant_max -128" \
        in cause.reason
    assert program_text(program) == before
    assert state_storage(program)["cache"].dtype == torch.float32


def test_a_second_run_changes_nothing(hand_quantized):
    program, calls = hand_quantized("write_index_put", "exported_program")
    quantize_state(program)
    reference = copy.deepcopy(program)
    result, record = quantize_state(program)
    assert not result.modified and record.statistics == {}
    assert record.notes == ["cache: left as it is (stored as integers on int8 [-128, 127], "
                            "scale=0.05, zero_point=3)"]
    bit_identical(reference, program, calls)


def test_pipeline_text():
    manager = parse_pipeline("QuantizeMutableBuffers{strict=true}")
    assert manager.pipeline_text() == "QuantizeMutableBuffers{strict=true}"
    assert repr(QuantizeMutableBuffers()) == (
        "QuantizeMutableBuffers(strict=False, carried_state=False, state_owner=None, "
        "owned_buffers=None, next_values=None, pair_by_name=None, keep_float=None)")
    text = ("QuantizeMutableBuffers{carried_state=true,state_owner='coreml',"
            "owned_buffers=('k_cache',)}")
    (pass_,) = parse_pipeline(text).plan()
    assert (pass_.carried_state, pass_.state_owner, pass_.owned_buffers) == (
        True, "coreml", ("k_cache",))
    assert parse_pipeline(text).pipeline_text() == text
    text = "QuantizeMutableBuffers{keep_float={'total': 'another method resets it to 0.3'}}"
    assert parse_pipeline(text).pipeline_text() == text


# -- a Hugging Face Llama with a static cache ---------------------------------------------------
@functools.cache
def _hf_llama():
    steps = decode_steps(STEPS)
    # The every-op quantizer's min/max observers: XNNPACK's histogram observers take 30 s
    # to convert even this tiny model.
    return quantize(llama_module(), (), steps[:3], "every_op", kwargs=steps[0][1],
                    strict=True), steps


@pytest.mark.parametrize("form", ["graph_module", "exported_program"])
def test_hugging_face_static_cache(form):
    gm, steps = _hf_llama()
    program = in_form(copy.deepcopy(gm), (), form, kwargs=steps[0][1])
    reference = copy.deepcopy(program)
    _, record = quantize_state(program)
    caches = [f"{kind}_cache_{layer}" for layer in (0, 1) for kind in ("key", "value")]
    assert record.statistics["buffers stored as integers"] == 4
    assert "buffers left float" not in record.statistics  # the position counters are int64
    for fqn in caches:
        stored_as_integers(program, fqn, torch.uint8)
    assert sum("left as it is (torch.int64 state" in n for n in record.notes) == 2
    assert record.statistics["state bytes after"] * 4 == record.statistics["state bytes before"]
    bit_identical(reference, program, steps)


# -- delegation -----------------------------------------------------------------------------------
def test_delegate_owns_the_integer_caches():
    program, calls = decoder("index_put", "xnnpack", "exported_program")
    reference = copy.deepcopy(program)  # its caches in fp32
    quantize_state(program)
    grids = {fqn: info.grid for fqn, info in mutable_buffers(program).items()}
    lowered = to_delegate(program, AllNodePartitioner())
    owned = PassManager([ConsumeBufferMutationsInDelegate(strict=True)]).run(lowered).program
    assert set(CACHES).isdisjoint(owned.graph_signature.inputs_to_buffers.values())
    assert not [s for s in owned.graph_signature.output_specs
                if s.kind == OutputKind.BUFFER_MUTATION]
    (delegate,) = delegates(owned)
    held = {s.target for s in delegate.program.graph_signature.input_specs
            if s.kind == InputKind.BUFFER}
    assert held == set(CACHES)
    assert all(delegate.program.state_dict[fqn].dtype == torch.int8 for fqn in CACHES)

    def dequantized(module):
        state = program_state(module)
        return {fqn: grids[fqn].dequantize(state[fqn]) if state[fqn].dtype == torch.int8
                else state[fqn] for fqn in CACHES}

    expected = run_program(reference, calls, state=dequantized)
    actual = run_program(owned, calls, state=dequantized)
    for want, got in zip(expected.outputs, actual.outputs, strict=True):
        assert all(same_bits(a, b) for a, b in zip(want, got, strict=True))
    for want, got in zip(expected.buffers, actual.buffers, strict=True):
        assert all(same_bits(want[fqn], got[fqn]) for fqn in CACHES)
