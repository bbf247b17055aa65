"""The main job on several methods over one state (factory contract v3), run as users run it:
the built-in decoder and a tiny Hugging Face Llama as a prefill + a one-token decode."""

from __future__ import annotations

import pytest

from passes.flow.cli import main
from passes.flow.examples import AnnotateEveryOpQuantizer, prefill_decode_job, xnnpack_quantizer
from passes.flow.factory import methods_spec
from passes.flow.run_methods import (
    FP32_METHODS,
    INTEGER_METHODS,
    ONE_GRID,
    PER_METHOD,
    run_methods_flow,
)
from tests.models import hf


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
    assert "method 'decode' is not exportable" in capsys.readouterr().err


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
