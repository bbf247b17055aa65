"""quantize_program: an ExportedProgram in, a quantized ExportedProgram out, state intact.

The reference is the flow the steps stand for, run by hand on the graph module (prepare
with PassQuantizer, calibrate, reset, convert, UnfreezeMutableBuffer): the program
quantize_program returns must compute exactly what that graph module computes, call after
call, outputs and buffers, and stay within quantization error of eager.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pass_manager import PassManager
from pass_manager.validation import copy_program, first_difference, output_errors, run_program
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
    conditions,
    reset_mutable_buffers,
)
from passes.flow.examples import AnnotateEveryOpQuantizer, decoder_job, xnnpack_quantizer
from passes.quantization import PassQuantizer, quantize_program
from tests.models.lifting import DecayAccumulator, accumulator_calls
from tests.models.qnn import qnn_quantizer

CACHES = ["layers.0.attn.k_cache", "layers.0.attn.v_cache"]


def by_hand(program, calibration, fold=True, quantizer=None):
    """The steps quantize_program stands for, on the graph module, without the lift."""
    quantizer = PassQuantizer(quantizer or AnnotateEveryOpQuantizer(),
                              transform=[MarkMutableBuffers(), InplaceToFunctional()],
                              after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_pt2e(copy_program(program).module(), quantizer)
    with torch.no_grad():
        for args in calibration:
            prepared(*args)
    reset_mutable_buffers(prepared)
    converted = convert_pt2e(prepared, fold_quantize=fold)
    return PassManager([UnfreezeMutableBuffer()]).run(converted).program


@pytest.fixture(scope="module")
def decoder():
    model, example, steps = decoder_job(n_layers=1, steps=5)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), example, strict=True)
    return model, steps, ep


def test_a_plain_export_comes_back_quantized_and_functional(decoder):
    """Straight from torch.export (in-place cache writes, no mutation in the signature)."""
    model, steps, ep = decoder
    assert not ep.graph_signature.buffers_to_mutate
    program = copy_program(ep)
    before = {name: value.clone() for name, value in program.state_dict.items()}
    quantized = quantize_program(program, AnnotateEveryOpQuantizer(), steps)
    assert isinstance(quantized, torch.export.ExportedProgram)
    assert list(quantized.graph_signature.buffers_to_mutate.values()) == CACHES
    assert not conditions.Functional.check(quantized)
    targets = {str(n.target) for n in quantized.graph.nodes}
    assert "quantized_decomposed.dequantize_per_tensor.default" in targets
    reference = by_hand(ep, steps)
    assert first_difference(run_program(reference, steps), run_program(quantized, steps)) is None
    # Quantized, not broken: within 8-bit error of fp32 at every step, the caches included.
    assert max(output_errors(run_program(model, steps), run_program(quantized, steps))) < 0.1
    # The calibration wrote the program's (shared) caches; the reset put them back.
    for name, value in before.items():
        assert torch.equal(program.state_dict[name], value), name
    assert quantized.state_dict[CACHES[0]] is program.state_dict[CACHES[0]]


def test_the_result_is_a_program_torch_can_save_load_and_decompose(decoder):
    """torch.export.save / load and run_decompositions take the lifted program as they take
    an exported one, and the programs they give compute exactly the same."""
    _, steps, ep = decoder
    quantized = quantize_program(copy_program(ep), AnnotateEveryOpQuantizer(), steps)
    archive = io.BytesIO()
    torch.export.save(quantized, archive)
    archive.seek(0)
    loaded = torch.export.load(archive)
    decomposed = copy_program(quantized).run_decompositions({})
    expected = run_program(quantized, steps)
    for program in (loaded, decomposed):
        assert list(program.graph_signature.buffers_to_mutate.values()) == CACHES
        assert first_difference(expected, run_program(program, steps)) is None


def test_folding_keeps_reading_the_live_state():
    """torchao folds the quantized read of a buffer updated in place (``acc.add_``) into a
    frozen constant. quantize_program functionalizes before annotation (torchao then sees
    the write-back and leaves the read alone) and runs UnfreezeMutableBuffer after convert;
    the folded program computes exactly what the unfolded one does, call after call."""
    model, calls = DecayAccumulator(), accumulator_calls(6)
    ep = torch.export.export(copy.deepcopy(model), calls[0])
    folded = quantize_program(copy_program(ep), AnnotateEveryOpQuantizer(), calls[:3])
    unfolded = quantize_program(copy_program(ep), AnnotateEveryOpQuantizer(), calls[:3],
                                fold=False)

    # Compared on the model's own state: folding changes which constants are buffers.
    def trace(program):
        return run_program(program, calls, state=lambda m: {"acc": m.get_buffer("acc").clone()})

    assert first_difference(trace(unfolded), trace(folded)) is None
    assert first_difference(trace(by_hand(ep, calls[:3])), trace(folded)) is None
    assert list(folded.graph_signature.buffers_to_mutate.values()) == ["acc"]

    def quantized_weights(program):
        return sum(1 for n in program.graph.nodes if "quantize_per_tensor" in str(n.target)
                   and n.args[0].op == "placeholder" and n.args[0].name.startswith("p_"))

    assert quantized_weights(folded) == 0 < quantized_weights(unfolded)


class FlipsAParameter(torch.nn.Module):
    """A parameter written by an op the quantizer leaves unannotated (``neg_``): torchao's
    folding takes the parameter for a constant and folds its update."""

    def __init__(self, requires_grad):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.sign = torch.nn.Parameter(torch.ones(4), requires_grad=requires_grad)

    def forward(self, x):
        with torch.no_grad():
            self.sign.neg_()
        return self.proj(x) * self.sign


@pytest.mark.parametrize("requires_grad", [False, True])
def test_folding_leaves_a_written_parameters_update_to_the_calls(requires_grad):
    """Folding ran the update's ``copy_`` on the parameter at convert time: the program
    started one step ahead (silently), or torch refused the in-place write of a leaf that
    requires grad. Folded, it computes exactly what the unfolded program computes."""
    torch.manual_seed(0)
    calls = [(torch.randn(2, 4),) for _ in range(4)]
    model = FlipsAParameter(requires_grad)
    ep = torch.export.export(copy.deepcopy(model), calls[0])
    folded = quantize_program(copy_program(ep), xnnpack_quantizer(), calls)
    unfolded = quantize_program(copy_program(ep), xnnpack_quantizer(), calls, fold=False)
    assert torch.equal(folded.state_dict["sign"], torch.ones(4))

    def trace(program):
        return run_program(program, calls, state=lambda m: {"sign": m.sign.detach().clone()})

    assert first_difference(trace(unfolded), trace(folded)) is None
    eager, quantized = trace(model), trace(folded)
    assert all(torch.equal(q["sign"], e["sign"])
               for q, e in zip(quantized.buffers, eager.buffers, strict=True))
    assert max(output_errors(eager, quantized)) < 0.1  # a flipped sign: 2 and more


def test_calibration_calls_in_every_form(decoder):
    """Argument tuples, (args, kwargs) pairs and keyword mappings calibrate alike."""
    _, steps, ep = decoder
    pairs = [(args, {}) for args in steps]
    keywords = [{"x": x, "input_pos": pos} for x, pos in steps]
    results = [quantize_program(copy_program(ep), AnnotateEveryOpQuantizer(), calls)
               for calls in (steps, pairs, keywords)]
    traces = [run_program(r, steps) for r in results]
    assert first_difference(traces[0], traces[1]) is None
    assert first_difference(traces[0], traces[2]) is None


def test_bad_input(decoder):
    _, steps, ep = decoder
    with pytest.raises(TypeError, match="takes an ExportedProgram"):
        quantize_program(ep.module(), AnnotateEveryOpQuantizer(), steps)
    with pytest.raises(ValueError, match="at least one calibration call"):
        quantize_program(ep, AnnotateEveryOpQuantizer(), [])


def test_the_report_says_what_each_stage_did(decoder):
    """return_report=True: the same program, and each stage's report (the pipelines'
    PassManager reports, the buffers reset, the frozen reads repaired, the steps' times)."""
    _, steps, ep = decoder
    calls = []
    program, report = quantize_program(copy_program(ep), AnnotateEveryOpQuantizer(), steps,
                                       return_report=True, on_call=calls.append)
    plain = quantize_program(copy_program(ep), AnnotateEveryOpQuantizer(), steps)
    assert first_difference(run_program(plain, steps), run_program(program, steps)) is None
    assert calls == list(range(len(steps)))
    assert [(stage, [r.name for r in r_.records]) for stage, r_ in report.passes] == [
        ("before annotation", ["MarkMutableBuffers", "InplaceToFunctional"]),
        ("after annotation", ["SkipAnnotateDataMovementOps"]),
        ("after convert", ["UnfreezeMutableBuffer"]),
    ]
    marked, functionalized = report.passes[0][1].records
    assert marked.statistics["mutable buffers marked"] == 2
    assert functionalized.statistics["in-place ops rewritten: aten.index_copy_"] == 2
    assert report.reset_buffers == CACHES
    # Functional before annotation, torchao folds no buffer read: nothing to repair.
    assert report.repaired_reads == []
    assert list(report.seconds) == ["prepare", "calibrate", "reset", "convert", "unfreeze",
                                    "lift"]
    summary = report.summary()
    assert summary[1] == f"reset after calibration (2): {', '.join(CACHES)}"
    assert summary[2] == "frozen buffer reads repaired: none"
    data = report.to_dict()
    assert set(data["passes"]) == {"before annotation", "after annotation", "after convert"}
    assert data["reset_buffers"] == CACHES


def test_the_report_names_the_frozen_reads_it_repaired(monkeypatch):
    """A read torchao folds anyway (here: no InplaceToFunctional before annotation, so
    torchao does not see the accumulator's write) is repaired and named in the report."""
    import passes.quantization as quantization

    model, calls = DecayAccumulator(), accumulator_calls(4)
    ep = torch.export.export(copy.deepcopy(model), calls[0])
    real = quantization.PassQuantizer

    def without_functionalization(quantizer, transform=(), after_annotate=(), **options):
        return real(quantizer, [p for p in transform if not isinstance(p, InplaceToFunctional)],
                    after_annotate, **options)

    monkeypatch.setattr(quantization, "PassQuantizer", without_functionalization)
    _, report = quantize_program(copy_program(ep), AnnotateEveryOpQuantizer(), calls[:3],
                                       return_report=True)
    assert report.reset_buffers == ["acc"]
    assert len(report.repaired_reads) == 1 and "acc" in report.repaired_reads[0]
    assert report.summary()[2] == "frozen buffer reads repaired: 1"


@pytest.mark.parametrize("make_quantizer", [xnnpack_quantizer, qnn_quantizer],
                         ids=["xnnpack", "qnn"])
@pytest.mark.parametrize("functional", [False, True], ids=["exported", "functional"])
def test_an_integer_counter_stays_integer_through_the_quantizer(functional, make_quantizer):
    """XNNPACK's quantizer turns the scalar of ``add(pos, 1)`` into a float32 constant in
    its transform_for_annotation; on a program already functional (``add``, not ``add_``)
    the counter's update became ``add(int64, float32)``. It keeps an int64 operand, and so
    through ExecuTorch's Qualcomm quantizer, which annotates every op it knows."""
    from tests.models.counters import CountedCache, counted_cache_calls

    module = CountedCache()
    reference = copy.deepcopy(module)
    calls = counted_cache_calls(6, seed=1)
    with torch.no_grad():
        program = torch.export.export(module, calls[0])
    if functional:
        program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    quantized = quantize_program(program, make_quantizer(), calls)
    update = {fqn: name for name, fqn in quantized.graph_signature.buffers_to_mutate.items()}
    nodes = {node.name: node for node in quantized.graph.nodes}
    counter_update = nodes[update["pos"]]
    for node in (counter_update, *counter_update.all_input_nodes):
        assert node.meta["val"].dtype == torch.int64, (node.name, node.meta["val"].dtype)
    assert quantized.state_dict["pos"].dtype == torch.int64
    assert not quantized.state_dict["pos"].any()  # reset after calibration
    program_module = quantized.module()
    with torch.no_grad():
        for step, args in enumerate(counted_cache_calls(5, seed=2)):
            (want, want_pos), (got, got_pos) = reference(*args), program_module(*args)
            assert got_pos.dtype == torch.int64 and torch.equal(got_pos, want_pos), step
            assert torch.equal(program_module.get_buffer("pos"), reference.pos), step
            assert program_module.get_buffer("pos").dtype == torch.int64
            if make_quantizer is qnn_quantizer:
                # QNN's moving-average observers keep the range of the first calibration
                # calls (sums of one or two rows): later sums leave it, state or not.
                continue
            assert (got - want).abs().max() < 0.1, step
            assert (program_module.get_buffer("cache") - reference.cache).abs().max() < 0.1


class _RingCache(torch.nn.Module):
    """A ring buffer of 4 rows written at ``pos % 4`` (a sliding-window cache)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(4)
        self.proj = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(4, 4, generator=generator) / 2)
            self.proj.bias.copy_(torch.randn(4, generator=generator) / 4)
        self.register_buffer("cache", torch.zeros(4, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos % 4, self.proj(x))
        return self.cache.sum(0)


def test_a_ring_position_stays_integer_through_qnns_remainder_decomposition():
    """QnnQuantizer's transform rewrites ``pos % 4`` as ``pos - floor(pos / 4) * 4``, a
    true division of integers, so the ring position became a float and the first
    calibration call failed (``CalibrationInputError: ... index_copy_(): Expected a long
    tensor for index, but got Float``). The position is cast back for the write and
    never quantized: each call writes the row eager writes, wrapping around."""
    generator = torch.Generator().manual_seed(5)
    calls = [(torch.rand(1, 4, generator=generator) * 2 - 1, torch.tensor([step]))
             for step in range(6)]
    module = _RingCache()
    with torch.no_grad():
        program = torch.export.export(copy.deepcopy(module), calls[0])
    quantized = quantize_program(program, qnn_quantizer(), calls)
    program_module = quantized.module()
    with torch.no_grad():
        for step, args in enumerate(calls):
            module(*args)
            program_module(*args)
            cache = program_module.get_buffer("cache")
            # Every row eager wrote, none elsewhere; the values within QNN's averaging
            # input observer (its range stays near the first calls': 0.19 off at most),
            # far closer than another row's (0.5-1.9 apart).
            assert (cache - module.cache).abs().max() < 0.25, step
            assert torch.equal(cache.abs().sum(1) > 0, module.cache.abs().sum(1) > 0), step


def test_the_report_prints_as_its_summary_and_tables():
    """``print(report)`` is for a person: the steps, the reset buffers, each stage's table."""
    model, example, steps = decoder_job(n_layers=1, steps=2)
    with torch.no_grad():
        ep = torch.export.export(model, example)
    _, report = quantize_program(ep, AnnotateEveryOpQuantizer(), steps, return_report=True)
    text = str(report)
    assert text.startswith("steps: prepare ") and "reset after calibration (2)" in text
    assert "before annotation:\n#" in text and "after convert:\n#" in text


class _Converts(torch.nn.Module):
    """A decaying state written from a token's embedding, read through a ``.to`` that
    converts nothing when ``convert`` (as GPT-2 adds its position embeddings), else
    directly."""

    def __init__(self, convert: bool):
        super().__init__()
        self.convert = convert
        self.embed = torch.nn.Embedding(8, 4)
        with torch.no_grad():
            self.embed.weight.copy_(torch.linspace(-1, 1, 32).reshape(8, 4))
        self.register_buffer("state", torch.zeros(1, 4))

    def forward(self, token: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(token)
        if self.convert:
            h = h.to(device=x.device, dtype=torch.float32)
        self.state.copy_(self.state * 0.5 + h + x)
        return self.state * 2


@pytest.mark.parametrize("make_quantizer", [xnnpack_quantizer, qnn_quantizer],
                         ids=["xnnpack", "qnn"])
def test_a_conversion_that_converts_nothing_quantizes_as_if_absent(make_quantizer):
    """QnnQuantizer observed the no-op ``.to``'s output on a grid of its own: one more
    rounding than torchao's recipe (whose run_decompositions drops the node) makes."""
    generator = torch.Generator().manual_seed(3)
    calls = [(torch.tensor([step % 8]), torch.randn(1, 4, generator=generator))
             for step in range(6)]
    quantized = {}
    for convert in (True, False):
        with torch.no_grad():
            program = torch.export.export(_Converts(convert), calls[0])
        quantized[convert] = quantize_program(program, make_quantizer(), calls)
    assert first_difference(run_program(quantized[False], calls),
                            run_program(quantized[True], calls)) is None


def test_per_block_weights_lift_and_compute_what_pt2e_computes():
    """torchao converts per-block (affine) observers, QnnQuantizer's ``use_16a4w_block``,
    to the overload packet ``torchao.dequantize_affine``, which an ExportedProgram's
    verifier refuses (a LiftError on 8dcccbe): quantize_program gives each its overload, and
    the program equals the converted graph module bit for bit, outputs and state."""
    pytest.importorskip("executorch")
    model = DecayAccumulator(dim=8)
    calls = accumulator_calls(5, dim=8)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), calls[0])

    def quantizer():
        from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
        from torchao.quantization.pt2e import MinMaxObserver

        made = QnnQuantizer()
        # Min-max activation observers: QNN's moving averages (1% a call) keep about the
        # first call's range over a 5-call calibration, and clip the later calls'.
        made.set_default_quant_config(QuantDtype.use_16a4w_block, is_linear_per_channel=True,
                                      act_observer=MinMaxObserver)
        made.set_block_size_map({"linear": (1, 4), "linear_1": (1, 4)})
        return made

    quantized = quantize_program(copy_program(ep), quantizer(), calls)
    targets = {str(n.target) for n in quantized.graph.nodes}
    assert "torchao.dequantize_affine.default" in targets
    assert list(quantized.graph_signature.buffers_to_mutate.values()) == ["acc"]
    reference = by_hand(ep, calls, quantizer=quantizer())
    assert first_difference(run_program(reference, calls), run_program(quantized, calls)) is None
    # 4-bit weights in blocks of 4, 16-bit activations: near eager (measured 0.04-0.08;
    # per-channel 4-bit weights 0.06-0.13), the state included.
    assert max(output_errors(run_program(model, calls), run_program(quantized, calls))) < 0.12


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_calibration_puts_back_the_callers_carried_cache(by_keyword):
    """A cache the caller passes and the program writes in place is threaded through the
    calibration calls, then put back bit for bit: it held the last call's state, and a
    decode from it started there (a CarriedStateWarning said "pass fresh tensors")."""
    import warnings

    from passes.errors import CarriedStateWarning
    from tests.models.quantized_state import CarriedCache, carried_cache, grid_inputs

    calls = grid_inputs()
    model = CarriedCache()
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), (*calls[0], carried_cache()))
    cache = carried_cache() + 0.25  # a non-zero start, put back exactly
    before = cache.clone()
    calibration = [((*args,), {"cache": cache}) if by_keyword else (*args, cache)
                   for args in calls[:4]]
    seen = []  # the caller's cache after each calibration call
    with warnings.catch_warnings():
        warnings.simplefilter("error", CarriedStateWarning)
        quantized = quantize_program(copy_program(ep), xnnpack_quantizer(), calibration,
                                     on_call=lambda index: seen.append(cache.clone()))
    assert torch.equal(cache, before)
    # The calls were threaded along one cache, as eager runs them (the prepared program
    # computes in fp32): after the last, it held what eager's four calls leave.
    eager_cache = before.clone()
    with torch.no_grad():
        for args in calls[:4]:
            model(*args, eager_cache)
    assert len(seen) == 4 and not torch.equal(seen[-1], before)
    assert torch.allclose(seen[-1], eager_cache, atol=1e-6)
    # A decode from the caller's tensor starts from the state it was given.
    module, fresh = quantized.module(), before.clone()
    with torch.no_grad():
        for args in calls:
            assert torch.equal(module(*args, cache), module(*args, fresh))
            assert torch.equal(cache, fresh)


class _HalfState(torch.nn.Module):
    """A float16 cache written from a float32 activation (``QnnQuantizer`` puts the cast
    and the write on its grid, read as float16)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("h", torch.zeros(2, 4, dtype=torch.float16))

    def forward(self, x, pos):
        self.h.index_copy_(0, pos, (2 * x).to(torch.float16))
        return self.h.float().sum(0) + 1


def test_a_16_bit_grid_read_as_float16_is_dequantized_in_float32():
    """torch's reference dequantize casts a 16-bit grid's integers to float16 before
    subtracting the zero point: the calibration maximum (65535) became ``inf`` and a value
    near the zero point 32 steps off, where ExecuTorch's kernel (float32, then cast) is
    exact. The program now computes the grid's value rounded once, as the kernel does."""
    x = torch.tensor([[-1.0, -0.3, 0.3, 1.0]])
    calibration = [(x, torch.tensor([0]))]
    with torch.no_grad():
        program = torch.export.export(_HalfState(), calibration[0])
    quantized = quantize_program(program, qnn_quantizer("use_16a8w"), calibration)
    module = quantized.module()
    module(*calibration[0])
    written = module.h[0]
    assert torch.isfinite(written).all(), written  # was inf where 2 * x is the maximum
    grid = [n for n in quantized.graph.nodes if n.target == torch.ops.aten.index_copy.default]
    (value,) = [n.args[3] for n in grid]  # the write: the grid's value, cast once
    wide = value.args[0]
    q = torch.ops.quantized_decomposed.quantize_per_tensor(2 * x[0], *wide.args[1:6])
    expected = torch.ops.quantized_decomposed.dequantize_per_tensor(q, *wide.args[1:6])
    assert torch.equal(written, expected.half()), (written, expected)
