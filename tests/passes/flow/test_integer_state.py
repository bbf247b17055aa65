"""Issue 25 in the main job: ``--quantize-state`` / ``run_model(quantize_state=True)``.

QuantizeMutableBuffers after quantize_program: per buffer dtype and bytes before and after,
an exact check against the fp32-stored quantized program, then delegation of the
integer-stored program; failures the flow's way.
"""

from __future__ import annotations

import json

import pytest

from passes.flow import cli, model_spec, run_model
from passes.flow.examples import AnnotateEveryOpQuantizer, xnnpack_quantizer
from tests.models import main_job

CACHES = ["layers.0.attn.k_cache", "layers.0.attn.v_cache"]
EXACT = "integer-stored state computes exactly what the fp32-stored quantized program does"


def report_of(out: str, title: str) -> list[str]:
    return out.split(f"== {title}\n")[1].split("\n== ")[0].splitlines()


@pytest.mark.parametrize(("quantizer", "dtype"), [(xnnpack_quantizer, "int8"),
                                                   (AnnotateEveryOpQuantizer, "uint8")])
def test_caches_take_a_quarter_of_the_bytes_and_compute_exactly_the_same(quantizer, dtype):
    spec = model_spec(main_job.one_layer_decoder(), "one_layer_decoder", 4)
    result = run_model(spec, quantizer_factory=quantizer, quantize_state=True,
                       log=lambda line: None)
    assert result.ok, "\n".join(f"{c.name}: {c.detail}" for c in result.checks)
    (exact,) = [c for c in result.checks if c.name == EXACT]
    assert "atol 0" in exact.detail and "2 of 2 mutable buffers" in exact.detail
    storage = result.state_storage
    for fqn in CACHES:
        buffer = storage["buffers"][fqn]
        assert (buffer["dtype_before"], buffer["dtype_after"]) == ("float32", dtype)
        # [1, 2 heads, 16 positions, 16] in float32, then one byte an element
        assert buffer["bytes_after"] * 4 == buffer["bytes_before"] == 2048
        assert buffer["grid"].startswith(dtype) and buffer["kept"] is None
    assert storage["bytes_after"] * 4 == storage["bytes_before"]
    # The integer caches go on into delegation: the delegate owns them and decodes exactly
    # like the integer-stored program (state compared dequantized), and the full pipeline
    # stays within 8-bit error of fp32 eager.
    assert "owns layers.0.attn.k_cache, layers.0.attn.v_cache" in result.delegate_summary[0]
    assert result.cache_update_delegation["owned"] == 2
    assert result.step_errors["full pipeline"] == result.step_errors["quantized, with passes"]
    assert max(result.buffer_errors["full pipeline"].values()) < 0.05
    assert [stage for stage, _ in result.reports][-2:] == ["quantize state", "delegation"]
    assert "QuantizeMutableBuffers" in result.plan


def test_the_cli_prints_each_buffer_and_keeps_the_accumulator_float(tmp_path, capsys):
    report = tmp_path / "report.json"
    status = cli.main(["run", "--runtime", "python",
                       "tests.models.main_job:cache_and_running_sum", "--steps", "4",
                       "--quantize-state", "--quantizer", "every-op", "--json", str(report),
                       "--quiet"])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = report_of(out, "state storage (QuantizeMutableBuffers)")
    cache, running_sum, total = lines
    assert cache.split()[:7] == ["cache", "float32", "512", "B", "->", "uint8", "128"]
    assert "÷4.00" in cache and "on uint8 [0, 255]" in cache
    assert running_sum.split()[:7] == ["running_sum", "float32", "64", "B", "->", "float32",
                                       "64"]
    assert "kept: its contents and its initial value not on the grid" in running_sum
    assert total == "total: 576 B -> 192 B (÷3.00)"
    assert f"PASS  {EXACT}" in out
    # The JSON report carries the same numbers.
    data = json.loads(report.read_text())["state_storage"]
    assert data["bytes_before"] == 576 and data["bytes_after"] == 192
    assert data["buffers"]["running_sum"]["kept"].startswith("its contents")
    assert data["buffers"]["cache"]["bytes_after"] == 128


def test_a_wrong_integer_state_fails_the_check_with_status_1(monkeypatch, capsys):
    """If the integer state were read without dequantizing, it would not be the fp32-stored
    program's: the check says where, and the job exits 1."""
    from passes.delegation.ownership import program_state
    from passes.flow import integer_state

    monkeypatch.setattr(integer_state, "dequantized_state", lambda grids: program_state)
    status = cli.main(["run", "--runtime", "python",
                       "tests.models.main_job:one_layer_decoder", "--steps", "2",
                       "--quantize-state", "--skip-delegation", "--quantizer", "every-op",
                       "--quiet"])
    out = capsys.readouterr().out
    assert status == 1
    (failed,) = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert failed.startswith(f"FAIL  {EXACT}: call 0: buffer 'layers.0.attn.k_cache': dtype")


def test_a_failing_pass_is_a_short_report_with_status_3(monkeypatch, capsys):
    from passes import QuantizeMutableBuffers
    from passes.errors import QuantizedStateError

    def refuse(self, program):
        raise QuantizedStateError("dequantize_per_tensor_3", "quant_min 127 > quant_max -128")

    monkeypatch.setattr(QuantizeMutableBuffers, "call", refuse)
    status = cli.main(["run", "--runtime", "python",
                       "tests.models.main_job:one_layer_decoder", "--steps", "2",
                       "--quantize-state", "--skip-delegation", "--quantizer", "every-op",
                       "--quiet"])
    captured = capsys.readouterr()
    assert status == 3
    assert "Traceback" not in captured.out + captured.err
    failed = report_of(captured.out, "failed")
    assert failed[:3] == ["stage:  store quantized state as integers (QuantizeMutableBuffers)",
                          "pass:   QuantizeMutableBuffers", "node:   dequantize_per_tensor_3"]
    assert failed[3].startswith("reason: QuantizedStateError: ")
    assert "quant_min 127 > quant_max -128" in failed[3]


def test_quantize_state_needs_quantization(capsys):
    status = cli.main(["run", "--runtime", "python", "--quantize-state", "--skip-quantization"])
    assert status == 2
    assert "--quantize-state" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs quantize=True"):
        run_model(model_spec(main_job.one_layer_decoder(), "f", 1), quantize=False,
                  quantize_state=True)


def test_planned_bytes_of_both_pte_files(tmp_path, capsys):
    pytest.importorskip("executorch")
    report = tmp_path / "report.json"
    status = cli.main(["run", "--runtime", "python",
                       "tests.models.main_job:one_layer_decoder", "--steps", "3",
                       "--quantize-state", "--runtime", "executorch", "--skip-delegation",
                       "--json", str(report), "--quiet"])
    out = capsys.readouterr().out
    assert status == 0, out
    planned = json.loads(report.read_text())["state_storage"]["planned_mutable_buffer_bytes"]
    # Read from each .pte's execution plan: the fp32-stored caches plan 4 bytes an element,
    # the integer-stored ones 1.
    assert planned == {"quantized": 4096, "quantized, integer state": 1024}
    lines = report_of(out, "state storage (QuantizeMutableBuffers)")
    assert "planned mutable-buffer bytes of the quantized .pte: 4,096 B" in lines
    assert "planned mutable-buffer bytes of the quantized, integer state .pte: 1,024 B" in lines
    assert "PASS  ExecuTorch runtime decodes the quantized, integer state program like Python" \
        in out
