"""Issue 24 in the main job: it quantizes through quantize_program and never traces again.

torch.export.export (and torch's _export under it, which every export mode goes through) are
counted while the whole flow runs; each call is attributed to the stage the flow had logged
last. The only export is the model's own, before quantization.
"""

from __future__ import annotations

import torch
import torch.export._trace

from passes.flow import model_spec, run_model
from passes.flow.examples import AnnotateEveryOpQuantizer
from tests.models import main_job

CACHES = ["layers.0.attn.k_cache", "layers.0.attn.v_cache"]


def test_the_flow_exports_once_and_quantizes_through_quantize_program(monkeypatch):
    stages: list[str] = []
    exports: list[tuple[str, str]] = []

    def counting(name, real):
        def call(*args, **kwargs):
            exports.append((name, stages[-1] if stages else "setup"))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(torch.export, "export", counting("export", torch.export.export))
    monkeypatch.setattr(torch.export._trace, "_export",
                        counting("_export", torch.export._trace._export))

    def log(line: str) -> None:
        if line.endswith("] ..."):  # a stage starts
            stages.append(line[1:-len("] ...")])

    spec = model_spec(main_job.one_layer_decoder(), "one_layer_decoder", 3)
    result = run_model(spec, quantizer_factory=AnnotateEveryOpQuantizer, log=log)
    assert result.ok, "\n".join(f"{c.name}: {c.detail}" for c in result.checks)
    # One strict export of the model (torch.export.export, then _export under it), all in
    # the flow's "export" stage; none in quantization, delegation or the decodes after.
    assert exports == [("export", "export"), ("_export", "export")]
    assert "quantize with the passes" in stages and "to_delegate" in stages
    assert not [s for s in stages if "re-export" in s or "again" in s]
    # quantize_program ran and reported each stage; the flow keeps its reports by stage.
    report = result.quantization
    assert report.reset_buffers == CACHES
    assert list(report.seconds) == ["prepare", "calibrate", "reset", "convert", "unfreeze",
                                    "lift"]
    assert [stage for stage, _ in result.reports] == [
        "functionalize", "before annotation", "after annotation", "after convert", "delegation"]
    assert result.to_dict()["quantization"]["reset_buffers"] == CACHES
    # The lifted program's cache updates are its mutation outputs: the cache-update
    # delegates own both caches with no functionalization in between.
    assert result.cache_update_delegation["owned"] == 2


def test_the_report_prints_quantize_programs_stages(capsys):
    from passes.flow import cli

    status = cli.main(["run", "--runtime", "python",
                       "tests.models.main_job:one_layer_decoder", "--steps", "2",
                       "--skip-delegation", "--quantizer", "every-op", "--quiet"])
    out = capsys.readouterr().out
    assert status == 0, out
    section = out.split("== quantization\n")[1].split("\n== ")[0].splitlines()
    assert section[0].startswith("with the passes: quantize_program")
    assert "lift" in section[1] and section[2] == (
        f"  reset after calibration (2): {', '.join(CACHES)}")
    assert section[3] == "  frozen buffer reads repaired: none"
    assert section[-1].startswith("without the passes (the reference for today's way)")
    table = out.split("== passes\n")[1]
    for row in ("before annotation: InplaceToFunctional", "after convert: UnfreezeMutableBuffer"):
        assert row in table
    assert "functionalize quantized" not in out
