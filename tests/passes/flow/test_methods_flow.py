"""The main job on several methods over one state (factory contract v3), run as users run it:
the built-in decoder and a tiny Hugging Face Llama as a prefill + a one-token decode."""

from __future__ import annotations

import warnings

import pytest
import torch

from passes.flow.cli import main
from passes.flow.examples import AnnotateEveryOpQuantizer, prefill_decode_job, xnnpack_quantizer
from passes.flow.factory import methods_spec
from passes.flow.result import FlowError
from passes.flow.run_methods import (
    FP32_METHODS,
    INTEGER_METHODS,
    ONE_GRID,
    PER_METHOD,
    run_methods_flow,
)
from tests.models import hf, main_job
from tests.models.accumulators import DividesByItsState


def _checks(result) -> dict[str, bool]:
    return {check.name: check.passed for check in result.checks}


@pytest.mark.parametrize("quantizer", [xnnpack_quantizer, AnnotateEveryOpQuantizer],
                         ids=["xnnpack", "every-op"])
def test_the_decoder_as_prefill_and_decode_keeps_one_grid_per_cache(quantizer):
    spec = methods_spec(prefill_decode_job(n_layers=1, decode_steps=4), "job", 8)
    result = run_methods_flow(spec, quantizer_factory=quantizer, quantize_state=True,
                              log=lambda line: None)
    assert result.ok, result.checks
    assert max(result.step_errors[FP32_METHODS]) <= 1e-5
    checks = _checks(result)
    assert checks["quantize_methods gives every shared buffer one grid in every method"]
    grid_detail = next(c.detail for c in result.checks if "one grid" in c.name)
    # quantized on their own, the two methods put each of the 2 caches on its own grid
    assert "2 shared buffers on one grid each; quantized per method, 2 of them" in grid_detail
    # calibrated along the deployment's calls, decode no longer reads prefill's cache on a
    # grid it never saw: the worst call is better than quantizing each method alone
    assert max(result.step_errors[ONE_GRID]) < max(result.step_errors[PER_METHOD])
    # the shared caches stored as 8-bit integers, bit for bit the fp32-stored methods
    assert checks["integer-stored methods compute exactly what the fp32-stored ones do"]
    storage = result.state_storage
    assert len(storage["buffers"]) == 2 and storage["bytes_before"] == 4 * storage["bytes_after"]
    assert result.step_errors[INTEGER_METHODS] == result.step_errors[ONE_GRID]


def test_a_hugging_face_llama_as_prefill_and_decode_through_the_command_line(capsys):
    status = main(["run", "tests.models.hf:llama_prefill_and_decode_methods", "--quiet",
                   "--runtime", "python"])
    report = capsys.readouterr().out
    assert status == 0, report
    assert "4 calls of 2 methods over one state (prefill exported strict, decode exported " \
           "strict)" in report
    assert "PASS  fp32 methods called in turn on one state match fp32 eager" in report
    assert "PASS  quantize_methods gives every shared buffer one grid" in report


def test_a_v3_factory_whose_method_cannot_be_exported_exits_two_naming_it(capsys, monkeypatch):
    import sys
    import types

    import torch

    made = prefill_decode_job(n_layers=1)
    # forward's two inputs, but an x of another width than the model's: export cannot trace
    made["methods"]["decode"]["example_args"] = (torch.ones(1, 1, 3), torch.tensor([0]))
    module = types.ModuleType("bad_methods_factory")
    module.factory = lambda: made
    monkeypatch.setitem(sys.modules, "bad_methods_factory", module)
    assert main(["run", "bad_methods_factory:factory", "--quiet"]) == 2
    assert "method 'decode': KVDecoder.forward raises on its example" in \
        capsys.readouterr().err


def test_hf_v3_factory_reads_as_two_static_methods():
    spec = methods_spec(hf.llama_prefill_and_decode_methods(), "llama", 8)
    assert [m for m, _, _ in spec.steps] == ["prefill", "decode", "decode", "decode"]
    assert spec.methods["prefill"].example_kwargs["input_ids"].shape == (1, 4)


def test_the_fp32_methods_run_from_one_pte_with_shared_buffers_like_eager():
    spec = methods_spec(prefill_decode_job(n_layers=1, decode_steps=3), "job", 8)
    result = run_methods_flow(spec, quantize=False, runtime="executorch", log=lambda line: None)
    assert result.ok, result.checks
    runtime = next(c for c in result.checks if "ExecuTorch's runtime" in c.name)
    assert "shared mutable buffers planned once: 4,096 B" in runtime.detail  # 2 caches x 2 KiB
    assert max(result.step_errors["fp32 on ExecuTorch"]) <= 1e-5


def _two_methods(module: torch.nn.Module, calls: int = 3) -> dict:
    torch.manual_seed(0)
    prompt, token = torch.randn(3, 4), torch.randn(1, 4)
    return {"module": module,
            "methods": {"prefill": {"example_args": (prompt,)},
                        "decode": {"example_args": (token,)}},
            "steps": [("prefill", (prompt,)), *(("decode", (torch.randn(1, 4),))
                                                for _ in range(calls - 1))]}


def test_a_methods_decode_off_by_inf_is_told_so():
    """The one-method job says so; the several-method job's columns read inf and its checks,
    comparing the quantized flows with each other, passed without a word."""
    spec = methods_spec(_two_methods(DividesByItsState()), "job", 8)
    result = run_methods_flow(spec, log=lambda line: None)
    assert ("off by inf from fp32 eager (an output NaN or inf, or of another shape) at some "
            f"step: {PER_METHOD!r}, {ONE_GRID!r}") in result.notes


def test_a_method_the_runtime_cannot_load_is_refused_before_quantization_naming_its_node():
    """The one-method job refuses it right after functionalization; the several-method job
    refused it only after both quantizations (tens of seconds on a real model)."""
    spec = methods_spec(_two_methods(main_job.LowBits()), "job", 8)
    with pytest.raises(FlowError) as info:
        run_methods_flow(spec, runtime="executorch", log=lambda line: None)
    failure = info.value.failure
    assert failure.node and "aten::view_copy.dtype_out" in failure.reason
    assert "y.view(torch.int32)" in failure.reason and "line" in failure.reason
    assert not [title for title, _ in info.value.result.stage_times if "quantize" in title]


def test_a_quantized_minus_inf_mask_of_several_methods_is_a_note_naming_it():
    """The one-method job notes it; the several-method job's checks passed without a word
    (quantize_program warned, once per method, among torch's warnings)."""
    steps = main_job.masked_cache_steps()
    made = {"module": main_job.MaskedCacheAttention().eval(),
            "methods": {"prefill": {"example_args": steps[0]},
                        "decode": {"example_args": steps[1]}},
            "steps": [("prefill", steps[0]), ("decode", steps[1]), ("decode", steps[2])]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_methods_flow(methods_spec(made, "job", 8), log=lambda line: None)
    (note,) = [n for n in result.notes if "inf, NaN or an extreme value" in n]
    assert "method 'prefill', calibrated on its own calls: " in note
    assert "'add' held -inf at calibration[0]" in note and "no longer masks" in note
    assert not [w for w in caught if str(w.message).startswith("quantize_program")]


def test_a_methods_pipeline_that_changes_the_inputs_fails_naming_it_not_at_the_first_call(
        capsys):
    """BuffersToInputs makes the caches inputs no step gives: the one-method job names the
    pipeline right after it ran; the several-method job failed in torch's pytree at the
    first call ('Ran into a kwarg keyword mismatch')."""
    status = main(["run", "passes.flow.examples:prefill_decode_job", "--quiet", "--runtime",
                   "python", "--skip-quantization", "--steps", "2", "--pipeline",
                   "MarkMutableBuffers,InplaceToFunctional,BuffersToInputs"])
    failed = capsys.readouterr().out.split("== failed")[1]
    assert status == 3
    assert "stage:  check the steps fit the pipeline's programs" in failed
    assert ("reason: PipelineError: the pipeline PassManager[MarkMutableBuffers, "
            "InplaceToFunctional, BuffersToInputs] changed the program's inputs from ") in failed
    assert "steps[0] (prefill) no longer fits" in failed


def test_calls_past_the_cache_fail_before_eager_naming_the_call_and_the_cache():
    """Eager raised torch's IndexError at the call (prefill 4 + 12 decodes fill the 16
    positions of the built-in decoder's caches; one more decode writes position 16)."""
    from passes import StatePastEndError
    from passes.flow.factory import export_methods
    from passes.flow.result import FlowError

    made = prefill_decode_job(n_layers=1, decode_steps=12)
    x, _ = made["steps"][-1][1]
    made["steps"].append(("decode", (x, torch.tensor([16]))))
    spec = methods_spec(made, "job", 100)
    # Not exported beforehand, eager called first and failed with torch's IndexError.
    for exported in (export_methods(spec), None):
        with pytest.raises(FlowError) as info:
            run_methods_flow(spec, exported=exported, quantize=False, log=lambda line: None)
        error = info.value.__cause__
        assert isinstance(error, StatePastEndError)
        assert (error.argument, error.state, error.position, error.length) == (
            "steps[13] (decode)", "layers.0.attn.k_cache", 16, 16)
        assert info.value.failure.stage == "check the steps stay within the state"
        assert [title for title, _ in info.value.result.stage_times] == [
            "export each method"] * (exported is None) + ["check the steps stay within the state"]


def test_a_cache_the_calls_carry_in_an_input_is_decoded_from_its_given_value():
    """A prefill and decodes passed one cache tensor they write: calibration wrote it, the
    quantized decodes then started from the calibrated cache, and both quantized columns
    read 1.58 off eager with every check passing (0.0117 from the cache as given)."""
    from tests.models.input_state import SEQ, InputCache, input_cache_calls

    cache = torch.zeros(SEQ, 6)
    calls = input_cache_calls(cache, 3, 0)
    methods = {}
    for method, args, _ in calls:
        methods.setdefault(method, {"example_args": args})
    spec = methods_spec({"module": InputCache(), "methods": methods,
                         "steps": [(m, a) for m, a, _ in calls]}, "job", 10)
    result = run_methods_flow(spec, log=lambda line: None)
    assert result.ok
    assert max(result.step_errors[ONE_GRID]) < 0.05
    assert max(result.step_errors[PER_METHOD]) < 0.05
    assert not cache.any()  # the caller's tensor: no call of the flow wrote it


class _DecodeWritesInsideACond(torch.nn.Module):
    """Prefill (3 rows) adds to its sum; decode (1 row) adds inside torch.cond's branch,
    which InplaceToFunctional refuses."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(1, 4))

    def forward(self, x):
        if x.shape[0] > 1:
            self.total.add_(x.sum(0, keepdim=True))
            return self.total * 2

        def add(x):
            self.total.add_(x)
            return x.clone()

        return torch.cond(x.sum() > 0, add, lambda x: x.clone(), (x,)) + self.total


def test_a_pass_failing_on_one_of_several_methods_names_the_method():
    """The == failed section named the stage, the pass and the node, but not which of the
    methods (here decode; prefill functionalizes) the pass failed on."""
    from passes.flow.result import FlowError

    spec = methods_spec(_two_methods(_DecodeWritesInsideACond()), "job", 8)
    with pytest.raises(FlowError) as info:
        run_methods_flow(spec, quantize=False, log=lambda line: None)
    failure = info.value.failure
    assert (failure.method, failure.pass_name, failure.node) == ("decode", "InplaceToFunctional",
                                                                 "cond")
    assert failure.lines()[:3] == ["stage:  functionalize the methods", "method: decode",
                                   "pass:   InplaceToFunctional"]


class _CacheWithAStateMethod(torch.nn.Module):
    """Four tokens fill the cache and add to a total (prefill), one fills a position
    (decode), two return the cache and the total and write nothing (a state read-back)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(1, 8, 4))
        self.register_buffer("total", torch.full((1, 4), 2.0))

    def forward(self, x: torch.Tensor, pos: torch.Tensor):
        if x.shape[1] == 4:
            self.cache.index_copy_(1, pos, self.lin(x))
            self.total.add_(x.sum(1))
            return self.lin(self.cache.sum(1)) * self.total
        if x.shape[1] == 1:
            self.cache.index_copy_(1, pos, self.lin(x))
            return self.lin(self.cache.sum(1)) + self.total
        return self.cache + 0 * x.sum(), self.total * 1


def test_a_method_reading_back_the_state_sees_every_write_and_its_integers():
    """Three methods, the read-back one writing nothing, called interleaved. Before, its
    own cache stayed zero in the Python run (the fp32 check failed: 'cache' off by 1.49
    after the first call) and storing the cache as integers raised SharedBufferError."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    def prompt():
        return torch.randn(1, 4, 4, generator=generator), torch.arange(4)
    def token(position):
        return torch.randn(1, 1, 4, generator=generator), torch.tensor([position])
    read = (torch.zeros(1, 2, 4), torch.arange(2))
    made = {"module": _CacheWithAStateMethod(),
            "methods": {"prefill": {"example_args": prompt()},
                        "decode": {"example_args": token(0)},
                        "state": {"example_args": read}},
            "steps": [("prefill", prompt()), ("state", read), ("decode", token(4)),
                      ("decode", token(5)), ("state", read), ("prefill", prompt()),
                      ("decode", token(4)), ("state", read)]}
    result = run_methods_flow(methods_spec(made, "three", 20), quantize_state=True,
                              log=lambda line: None)
    assert [check.name for check in result.checks if not check.passed] == []
    assert any("integer-stored" in check.name for check in result.checks)


def test_one_shared_buffer_is_counted_as_one():
    """The checks read "1 shared buffers on one grid each; quantized per method, 1 of them
    are on different grids" and "1 shared buffers stored as integers"."""
    spec = methods_spec(main_job.one_shared_cache(), "job", 8)
    result = run_methods_flow(spec, quantize_state=True, log=lambda line: None)
    details = " ".join(check.detail for check in result.checks)
    assert "1 shared buffer on one grid; quantized per method, it is on different grids" \
        in details
    assert "1 shared buffer stored as integers, on one grid" in details
    assert "1 shared buffers" not in details
