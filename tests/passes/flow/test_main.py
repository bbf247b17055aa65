"""The main job: `python -m passes run` on the smallest decoder, and its failure paths."""

import json

import pytest

from .main_job_cli import run_main


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("no_such_package.models:factory", "cannot import 'no_such_package.models'"),
        ("passes.examples:missing", "has no attribute 'missing'"),
        ("passes.examples:__doc__", "not a factory function"),
        ("tests.models.static_cache:ROWS", "tests.models.static_cache:ROWS is an int, not a "
         "factory function"),
        # Called without them, it failed with Python's "missing 1 required positional argument".
        ("passes.flow.examples:decode_inputs", "passes.flow.examples:decode_inputs takes cfg, "
         "steps: a factory takes no arguments"),
        ("passes.examples", "MODEL must be package.module:factory"),
        ("tests.models.main_job:not_exportable", "is not exportable"),
        ("tests.models.main_job:not_exportable",
         "(forward branches on a tensor's value, which torch.export cannot capture: write the "
         "branch with torch.cond, or compute both sides and pick with torch.where)"),
        ("tests.models.main_job:wrong_return", "must return (module, example_inputs)"),
        # Found before export and the decode: the inputs against forward's signature.
        ("tests.models.main_job:keyword_only_given_positionally",
         "the example does not fit KeywordOnly.forward(*, x): too many positional arguments "
         "(contract v1 gives inputs by position: keyword inputs go in a mapping's "
         "'example_kwargs' and in steps as (args, kwargs) pairs)"),
        ("tests.models.main_job:a_step_that_does_not_fit",
         "steps[1] does not fit KVDecoder.forward(x, input_pos): too many positional arguments"),
        ("tests.models.main_job:the_class_not_a_module",
         "must return an nn.Module, got the class KeywordOnly: return an instance, "
         "KeywordOnly(...)"),
    ],
)
def test_bad_model_gets_one_clear_line(model, message):
    done = run_main(model, timeout=180)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message in lines[0]
    assert "Traceback" not in done.stderr


def test_main_job_on_one_layer_decoder(tmp_path):
    dot, report = tmp_path / "plan.dot", tmp_path / "report.json"
    done = run_main(
        "tests.models.main_job:one_layer_decoder",
        "--steps",
        "8",
        "--dot",
        str(dot),
        "--json",
        str(report),
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    sections = ["== pass plan", "== passes", "== delegates", "== decode", "== checks"]
    positions = [out.index(s) for s in sections]
    assert positions == sorted(positions)
    assert "MarkMutableBuffers" in out and "InplaceToFunctional" in out
    assert "layers.0.attn.k_cache" in out.split("== delegates")[1]
    assert "FAIL" not in out and out.count("PASS") >= 3
    assert dot.read_text().startswith("digraph")
    data = json.loads(report.read_text())
    assert data["ok"] is True
    assert len(data["step_errors"]["full pipeline"]) == 8
    # Issue 10, pattern 8 is gone with the re-export: quantize_program's lifted program
    # writes each cache through its index_copy, so the index_copy delegates own both caches
    # and decode like their input program.
    caches = data["cache_update_delegation"]
    assert "owned_before_copy_rewrite" not in caches
    assert (caches["owned"], caches["mutated"]) == (2, 2)
    assert caches["delegates"] == {
        "cache_update_0": ["layers.0.attn.k_cache"], "cache_update_1": ["layers.0.attn.v_cache"]}
    assert "delegate(s) own 2 of 2 mutated buffers" in out
    assert "PASS  program with cache-update delegates matches its input program" in out


def test_fp32_only_flow_is_exact(tmp_path):
    report = tmp_path / "report.json"
    done = run_main(
        "tests.models.main_job:one_layer_decoder",
        "--skip-quantization",
        "--json",
        str(report),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(report.read_text())
    assert data["step_errors"]["fp32 pipeline"] == [0.0] * 8
    assert "quantized, no passes" not in data["step_errors"]
    assert data["delegates"] and all(c["passed"] for c in data["checks"])
    assert data["cache_update_delegation"]["owned"] == 2


def test_a_failing_check_makes_the_exit_status_non_zero(monkeypatch, capsys):
    from passes.flow import cli
    from passes.flow import run as flow

    def failing_flow(*args, **kwargs):
        result = flow.FlowResult(plan="0. SomePass")
        result.checks.append(flow.Check("a check", False, "it failed"))
        return result

    monkeypatch.setattr(flow, "run_flow", failing_flow)
    status = cli.main(["run", "--runtime", "python",
                       "tests.models.main_job:one_layer_decoder", "--steps", "2"])
    assert status == 1
    assert "FAIL  a check: it failed" in capsys.readouterr().out
