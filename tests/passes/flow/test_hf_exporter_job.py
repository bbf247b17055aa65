"""The main job on programs another exporter made (contract v3 with ``programs``): Hugging
Face's exporter's tiny Llama, its ``StaticCache`` made resident by the factory's ``carried``
options, checked call by call against HF's own programs with the cache threaded as HF
threads it; and what a malformed such factory is told."""

from __future__ import annotations

import pytest
import torch

from passes.flow.cli import main
from passes.flow.examples import prefill_decode_job
from passes.flow.factory import ModelError, model_spec


def test_hf_exporters_llama_through_the_command_line(capsys):
    """fp32 only, to stay cheap: the quantized stages on these resident methods are
    tests/passes/executorch/test_hf_exporter_flow.py's."""
    pytest.importorskip("transformers.exporters")
    status = main(["run", "tests.models.hf_exporter_job:llama", "--runtime", "python",
                   "--steps", "4", "--skip-quantization", "--quiet"])
    report = capsys.readouterr().out
    assert status == 0, report
    assert ("4 calls of 2 methods over one state (prefill exported by the factory, decode "
            "exported by the factory)") in report
    assert "input 'cache_0' -> buffer 'cache.layers.0.keys' (written in place)" in report
    assert ("PASS  fp32 methods called in turn on one state match fp32 eager within float "
            "rounding: 4 calls, worst output difference 0, every shared buffer equal") in report


def _programs() -> dict:
    made = prefill_decode_job(n_layers=1)
    module = made["module"]
    with torch.no_grad():
        return {name: torch.export.export(module, entry["example_args"])
                for name, entry in made["methods"].items()}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(methods={"decode": {}}), "both 'methods'"),
        (lambda m: m.update(programs={"decode": torch.ones(1)}), "'programs' must map"),
        (lambda m: m.update(carried={"generate": {}}), "'carried' names 'generate'"),
        (lambda m: m.update(carried={"decode": ["h"]}), "'carried' must map"),
        (lambda m: m.pop("steps"), "'steps' must list the calls"),
        # A tensor has no truth value: read for one, these raised a RuntimeError traceback.
        (lambda m: m.update(steps=torch.ones(2)), "'steps' must list the calls"),
        (lambda m: m.update(carried=torch.ones(2)), "'carried' must map"),
    ],
)
def test_a_malformed_programs_factory_is_a_model_error_saying_what_to_change(edit, message):
    made = prefill_decode_job(n_layers=1)
    programs = _programs()
    made = {"module": made["module"], "programs": programs,
            "steps": [(m, e["example_args"]) for m, e in made["methods"].items()]}
    edit(made)
    with pytest.raises(ModelError, match=message):
        model_spec(made, "job", 8)
