"""MarkMutableBuffers: every mutated buffer is found (as run_decompositions would list it),
marked in meta on both program forms, and can be reset to its initial value."""

import copy

import pytest
import torch

from pass_manager import PassManager, PreconditionError, assert_same_behaviour
from passes import MarkMutableBuffers, conditions, mutable_buffers, reset_mutable_buffers
from passes._analysis.buffers import MUTABLE_BUFFER_META


def _reference_mutations(ep):
    sig = copy.deepcopy(ep).run_decompositions({}).graph_signature
    return set(sig.buffers_to_mutate.values()), set(sig.user_inputs_to_mutate.values())


def _found(program):
    found = mutable_buffers(program)
    return ({k for k, v in found.items() if v.kind == "buffer"},
            {k for k, v in found.items() if v.kind == "user_input"})


@pytest.mark.parametrize("form", ["exported", "module"])
def test_finds_what_run_decompositions_lists(mutation_model, form):
    _, eager, calls, ep = mutation_model
    expected = _reference_mutations(ep)
    program = ep if form == "exported" else ep.module()
    assert conditions.MutableBuffersMarked.check(program) or expected == (set(), set())
    result = PassManager([MarkMutableBuffers()]).run(program)
    assert _found(result.program) == expected
    assert not conditions.MutableBuffersMarked.check(result.program)
    assert result.modified == (expected != (set(), set()))
    # Marking changes only meta: the program still behaves like the eager module.
    assert_same_behaviour(eager, result.program, calls, calls=4)


def test_marks_survive_module_and_deepcopy_and_reset_restores(zoo):
    eager, calls, ep = zoo("counters")
    marked = PassManager([MarkMutableBuffers()]).run(ep).program
    gm = copy.deepcopy(marked.module())
    marks = {n.meta[MUTABLE_BUFFER_META] for n in gm.graph.nodes if MUTABLE_BUFFER_META in n.meta}
    assert marks == {"acc", "decay", "step"}
    info = mutable_buffers(gm)
    assert info["step"].writers and all(w in {n.name for n in gm.graph.nodes}
                                        for w in info["step"].writers)
    initial = {k: v.initial.clone() for k, v in info.items()}
    for args in calls[:3]:
        gm(*args)
    assert gm.step.item() == 3 and not torch.equal(gm.acc, initial["acc"])
    assert sorted(reset_mutable_buffers(gm)) == ["acc", "decay", "step"]
    for fqn in initial:
        assert torch.equal(gm.get_buffer(fqn), initial[fqn])
    # The reset program behaves like a fresh eager module again.
    assert_same_behaviour(eager, gm, calls, calls=4)


def test_reset_on_exported_program_and_first_value_is_kept(zoo):
    _, calls, ep = zoo("kv_index_copy")
    marked = PassManager([MarkMutableBuffers()]).run(ep).program
    marked.module()(*calls[0])  # shares buffers with the EP: the cache is now non-zero
    k = "layers.0.attn.k_cache"
    assert marked.state_dict[k].abs().sum() > 0
    again = PassManager([MarkMutableBuffers()]).run(marked)
    assert not again.modified  # the kept copy is the first one, not the dirty cache
    reset_mutable_buffers(again.program)
    assert marked.state_dict[k].abs().sum() == 0


def test_add_and_mul_updates_are_found_where_name_heuristics_miss_them(zoo):
    _, _, ep = zoo("counters")
    gm = PassManager([MarkMutableBuffers()]).run(ep.module()).program
    writers = {k: v.writers for k, v in mutable_buffers(gm).items()}
    names = {w for ws in writers.values() for w in ws}
    targets = {str(n.target) for n in gm.graph.nodes if n.name in names}
    assert targets == {"aten.add_.Tensor", "aten.mul_.Tensor"}


def test_views_and_out_variant_writers(zoo):
    _, _, ep = zoo("view_zoo")
    info = mutable_buffers(PassManager([MarkMutableBuffers()]).run(ep).program)
    assert info["total"].writers == ["add"]  # aten.add.out(..., out=b_total)
    assert len(info["w"].writers) == 4  # through reshape+slice, diagonal, permute+select, split


def test_functional_program_is_read_from_its_signature(zoo):
    _, _, ep = zoo("many_writes")
    functional = copy.deepcopy(ep).run_decompositions({})
    info = mutable_buffers(PassManager([MarkMutableBuffers()]).run(functional).program)
    assert info["buf"].writers == ["clamp"] and info["y"].kind == "user_input"
    # ... and in the GraphModule form, from the trailing copy_ write-backs.
    info = mutable_buffers(PassManager([MarkMutableBuffers()]).run(functional.module()).program)
    assert {k: v.kind for k, v in info.items()} == {"buf": "buffer", "y": "user_input"}


@pytest.mark.parametrize("form", ["exported", "module"])
def test_a_written_parameter_is_marked_and_reset_like_a_buffer(parameter_writer, form):
    # torch lists it as a PARAMETER_MUTATION: state the program writes, like a buffer.
    ep = parameter_writer
    program = ep if form == "exported" else ep.module()
    assert conditions.MutableBuffersMarked.check(program)  # unmarked: a violation
    result = PassManager([MarkMutableBuffers()]).run(program)
    (info,) = mutable_buffers(result.program).values()
    assert (info.fqn, info.kind, info.writers) == ("w", "parameter", ["add_"])
    assert result.report.records[0].statistics == {"written parameters marked": 1}
    assert not conditions.MutableBuffersMarked.check(result.program)
    marked = result.program
    module = marked.module() if form == "exported" else marked
    initial = module.w.detach().clone()
    module(torch.ones(3))  # an ExportedProgram's module() shares its parameters
    assert not torch.equal(module.w, initial)
    assert reset_mutable_buffers(marked) == ["w"]
    assert torch.equal(module.w, initial)


def test_a_written_constant_is_reported_not_marked(constant_writer):
    result = PassManager([MarkMutableBuffers()]).run(constant_writer)
    assert mutable_buffers(result.program) == {}
    assert result.report.records[0].statistics == {"written constants (not marked)": 1}
    assert any("constant 'c'" in note for note in result.report.records[0].notes)


def test_pipeline_requiring_marks_fails_clearly_without_the_pass(zoo):
    from pass_manager import Pass

    class NeedsMarks(Pass):
        requires = frozenset({conditions.MutableBuffersMarked})

        def call(self, program):
            return None

    _, _, ep = zoo("counters")
    with pytest.raises(PreconditionError, match="MutableBuffersMarked") as info:
        PassManager([NeedsMarks()]).run(ep)
    assert "b_acc" in str(info.value) and "MarkMutableBuffers" in str(info.value)


def test_marks_survive_torchao_prepare_and_convert(zoo):
    import warnings

    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    _, calls, ep = zoo("kv_index_copy")
    gm = PassManager([MarkMutableBuffers()]).run(ep.module()).program
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config())
        prepared = prepare_pt2e(gm, quantizer)
    caches = {"layers.0.attn.k_cache", "layers.0.attn.v_cache"}
    assert set(mutable_buffers(prepared)) == caches
    for args in calls[:3]:  # calibration fills the caches ...
        prepared(*args)
    assert prepared.get_buffer("layers.0.attn.k_cache").abs().sum() > 0
    assert set(reset_mutable_buffers(prepared)) == caches  # ... and the reset empties them
    assert prepared.get_buffer("layers.0.attn.k_cache").abs().sum() == 0
    converted = convert_pt2e(prepared)
    info = mutable_buffers(converted)
    assert set(info) == caches and all(v.writers for v in info.values())


class _FilledAndNot(torch.nn.Module):
    """A zero cache, a cache of 3s, a random state, a counter and a buffer of +0.0/-0.0
    (equal values, different bits): every one is written each call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("zeros", torch.zeros(2, 8, 4))
        self.register_buffer("threes", torch.full((8, 4), 3.0))
        self.register_buffer("noise", torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("signed_zeros", torch.tensor([0.0, -0.0, 0.0]))

    def forward(self, x, pos):
        self.zeros.index_copy_(1, pos, x.expand(2, 1, 4))
        self.threes.mul_(x.mean())
        self.noise.add_(x[0])
        self.step.add_(1)
        self.signed_zeros.add_(1.0)
        return self.zeros.sum(1) + self.threes.sum() + self.noise.sum() + self.signed_zeros.sum()


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("form", ["exported", "module"])
def test_reset_keeps_a_filled_buffer_as_one_value_and_restores_every_buffer_exactly(form):
    eager = _FilledAndNot()
    calls = [(torch.randn(1, 1, 4), torch.tensor([i])) for i in range(4)]
    ep = torch.export.export(copy.deepcopy(eager), calls[0])
    program = PassManager([MarkMutableBuffers()]).run(ep if form == "exported" else ep.module())
    program = program.program
    info = mutable_buffers(program)
    state = program.state_dict if form == "exported" else dict(program.named_buffers())
    first = {fqn: state[fqn].clone() for fqn in info}
    # What is stored: the fills are one element each, broadcast to the buffer's shape ...
    for fqn in ("zeros", "threes", "step"):
        kept = info[fqn].initial
        assert kept.shape == state[fqn].shape and all(s == 0 for s in kept.stride())
        assert kept.untyped_storage().nbytes() == kept.element_size()
    # ... the others (random values, +0.0 next to -0.0) are full copies of their own.
    for fqn in ("noise", "signed_zeros"):
        kept = info[fqn].initial
        assert kept.untyped_storage().nbytes() == state[fqn].untyped_storage().nbytes()
        assert kept.untyped_storage().data_ptr() != state[fqn].untyped_storage().data_ptr()
    run = program.module() if form == "exported" else program
    for args in calls[:3]:
        run(*args)
    assert all(not torch.equal(_bits(state[fqn]), _bits(first[fqn])) for fqn in info)
    assert sorted(reset_mutable_buffers(program)) == sorted(first)
    for fqn, value in first.items():
        assert torch.equal(_bits(state[fqn]), _bits(value)), fqn
    # After the reset the program runs like a fresh eager module again.
    assert_same_behaviour(eager, run, calls, calls=4)


class _UnsignedAndLarge(torch.nn.Module):
    """A uint16 buffer filled with 7s (no ``aminmax`` kernel for uint16 on CPU) and a
    float buffer larger than the two-element peek, all zeros but one element."""

    def __init__(self):
        super().__init__()
        self.register_buffer("codes", torch.full((4, 3), 7, dtype=torch.uint16))
        big = torch.zeros(70_000)
        big[-2] = 1.0  # first and last elements agree: only a full read tells
        self.register_buffer("big", big)
        self.register_buffer("big_zeros", torch.zeros(70_000))

    def forward(self, x):
        self.codes.copy_(x.to(torch.uint16))
        self.big[:3].copy_(x[0].float())
        self.big_zeros[-3:].copy_(x[1].float())
        return self.codes.to(torch.float32).sum() + self.big.sum() + self.big_zeros.sum()


@pytest.mark.parametrize("form", ["exported", "module"])
def test_unsigned_fills_and_large_buffers_are_kept_and_reset_bit_for_bit(form):
    eager = _UnsignedAndLarge()
    calls = [(torch.full((4, 3), i + 1, dtype=torch.int32),) for i in range(4)]
    ep = torch.export.export(copy.deepcopy(eager), calls[0])
    program = PassManager([MarkMutableBuffers()]).run(ep if form == "exported" else ep.module())
    program = program.program
    info = mutable_buffers(program)
    assert set(info) == {"codes", "big", "big_zeros"}
    for fqn, filled in (("codes", True), ("big", False), ("big_zeros", True)):
        kept = info[fqn].initial
        one_element = kept.untyped_storage().nbytes() == kept.element_size()
        assert one_element == filled, fqn
    state = program.state_dict if form == "exported" else dict(program.named_buffers())
    first = {fqn: state[fqn].clone() for fqn in info}
    run = program.module() if form == "exported" else program
    for args in calls[:3]:
        run(*args)
    assert sorted(reset_mutable_buffers(program)) == sorted(first)
    for fqn, value in first.items():
        assert torch.equal(state[fqn], value), fqn
    assert_same_behaviour(eager, run, calls, calls=4)


def test_reset_of_a_program_never_marked_is_refused_and_nothing_is_reset():
    """torchao prepared straight from ``torch.export.export(...).module()``: the buffers'
    starting values were never recorded. The reset used to return [] and leave the
    calibration's cache and counter in place; marking before preparing makes it work."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from passes.errors import QuantizationInputError
    from passes.flow.examples import xnnpack_quantizer
    from tests.models.counters import CountedCache, counted_cache_calls

    calls = counted_cache_calls(4, seed=1)
    with torch.no_grad():
        ep = torch.export.export(CountedCache(), calls[0])

    def calibrated(program):
        prepared = prepare_pt2e(copy.deepcopy(program).module(), xnnpack_quantizer())
        with torch.no_grad():
            for args in calls:
                prepared(*args)
        return prepared

    unmarked = calibrated(ep)
    left = {name: value.clone() for name, value in unmarked.named_buffers()}
    with pytest.raises(QuantizationInputError) as info:
        reset_mutable_buffers(unmarked)
    assert info.value.helper == "reset_mutable_buffers"
    assert "'cache', 'pos'" in str(info.value) and "MarkMutableBuffers" in str(info.value)
    assert all(torch.equal(value, left[name]) for name, value in unmarked.named_buffers())
    assert left["pos"].item() == len(calls)

    marked = calibrated(PassManager([MarkMutableBuffers()]).run(ep).program)
    assert sorted(reset_mutable_buffers(marked)) == ["cache", "pos"]
    fresh = CountedCache()
    for name in ("cache", "pos"):  # exactly the values export saw
        assert torch.equal(marked.get_buffer(name), fresh.get_buffer(name)), name
