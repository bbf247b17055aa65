"""Hugging Face decoders and factory contract v2 through the main job, in process and as a CLI.

Tiny seeded Llama / Qwen3 / Gemma 3 configs wrapped with HF's own ExecuTorch recipe
(static cache, ``input_ids=`` / ``cache_position=`` keyword inputs), exported strict under
``torch.no_grad()`` as HF does. The every-op quantizer keeps calibration fast (min/max
observers); the CLI's default quantizer runs in test_main.py on the built-in decoder.
"""

import copy
import json

import pytest
import torch
from torch.export.graph_signature import InputKind

from pass_manager import PassManager, SemanticValidation, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers, mutable_buffers
from passes.flow.examples import AnnotateEveryOpQuantizer
from passes.flow.factory import export_program, model_spec
from passes.flow.run import FlowError, run_model
from tests.models import hf as hf_models

from .main_job_cli import run_main

STEPS = 4


def flow_on(factory, export=None, **options):
    spec = model_spec(factory(), factory.__name__, STEPS)
    spec.export = export or spec.export
    return run_model(
        spec, quantizer_factory=AnnotateEveryOpQuantizer, log=lambda line: None, **options
    )


def cache_state(module):
    """The decode state: HF's caches and their lengths (export drops the unused
    ``original_inv_freq`` buffer, which eager keeps)."""
    return {
        n: b.detach().clone() for n, b in module.named_buffers() if "_cache_" in n or "length" in n
    }


def test_hf_llama_functional_program_matches_eager_over_six_steps():
    spec = hf_models.llama()
    exported = export_program(spec["module"], (), spec["example_kwargs"], mode="strict")
    kinds = {spec.kind for spec in exported.program.graph_signature.input_specs}
    assert InputKind.CONSTANT_TENSOR not in kinds  # strict export keeps HF's caches as buffers
    manager = PassManager([MarkMutableBuffers(), InplaceToFunctional()],
                          instruments=[SemanticValidation(spec["steps"][:3])])
    functional = manager.run(exported.program).program
    mutated = set(functional.graph_signature.buffers_to_mutate.values())
    assert {"key_cache_0", "value_cache_1", "cumulative_length_0"} <= mutated
    # The exported program is exactly what the passes were given; eager differs from it by
    # export's float rounding only.
    assert_same_behaviour(exported.program, functional, spec["steps"][:6])
    assert_same_behaviour(
        spec["module"], functional, spec["steps"][:6], atol=1e-5, rtol=1e-4, state=cache_state
    )


@pytest.mark.parametrize(
    "factory",
    [
        hf_models.qwen3,
        hf_models.gemma3,
        hf_models.t5_decoder,
        hf_models.llama_prefill_then_decode,
        hf_models.no_grad_state,
    ],
)
def test_flow_passes_every_check(factory):
    result = flow_on(factory)
    assert result.ok, "\n".join(f"{c.name}: {c.detail}" for c in result.checks)
    assert len(result.checks) == 6
    assert result.delegate_summary and "none" not in result.delegate_summary[0]
    # A partitioner delegating only the cache updates (and their quantize/dequantize) owns
    # each layer's K and V cache of quantize_program's lifted program (the cache lengths are
    # updated outside).
    caches = result.cache_update_delegation
    expected = 0 if factory is hf_models.no_grad_state else 4
    assert caches["owned"] == expected
    assert len(result.step_errors["full pipeline"]) == STEPS


def test_prefill_then_decode_uses_a_dynamic_token_dimension():
    spec = hf_models.llama_prefill_then_decode()
    exported = export_program(
        spec["module"], (), spec["example_kwargs"], dynamic_shapes=spec["dynamic_shapes"]
    )
    assert exported.mode == "strict" and exported.program.range_constraints
    shapes = [kwargs["input_ids"].shape[1] for _, kwargs in spec["steps"]]
    assert shapes[0] == 4 and set(shapes[1:]) == {1}


def test_buffer_check_fails_when_the_calibration_state_is_left_behind(monkeypatch):
    import passes.quantization

    # Without reset_mutable_buffers the flow with the passes (quantize_program) starts
    # decoding from the calibration's last cache: the check against torchao's flow reset by
    # hand must see it.
    monkeypatch.setattr(passes.quantization, "reset_mutable_buffers", lambda program: [])
    result = flow_on(hf_models.llama, delegate=False)
    failed = [c for c in result.checks if not c.passed]
    assert [c.name.split(":")[0] for c in failed] == ["quantized buffers"]
    assert "with the passes vs" in failed[0].detail and "grid step" in failed[0].detail


def test_a_model_the_passes_cannot_handle_stops_with_its_partial_result():
    with pytest.raises(FlowError) as info:
        flow_on(hf_models.unsupported)
    failure = info.value.failure
    assert (failure.stage, failure.pass_name, failure.node) == (
        "functionalize",
        "InplaceToFunctional",
        "mul_",
    )
    assert "constant 'weight'" in failure.reason
    assert info.value.result.checks[0].name.startswith("exported program")


def test_cli_runs_hf_llama_through_the_whole_flow(tmp_path):
    report = tmp_path / "report.json"
    done = run_main(
        "tests.models.hf:llama",
        "--steps",
        str(STEPS),
        "--quantizer",
        "every-op",
        "--json",
        str(report),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "exported strict" in out and "FAIL" not in out and out.count("PASS") == 6
    progress = done.stderr  # stdout holds the report alone
    # One progress bar per stage, counting its calls (calibration among them).
    assert "quantize with the passes [00:0" in progress and f"call {STEPS}/{STEPS}" in progress
    assert "decode the lowered program [" in progress
    assert "key_cache_0" in out.split("== delegates")[1]
    data = json.loads(report.read_text())
    assert data["ok"] is True and data["failure"] is None
    # HF's static cache, quantized by the every-op quantizer and lifted (no re-export): a
    # partitioner delegating only the (quantized) cache updates gives every K/V cache to a
    # delegate.
    caches = data["cache_update_delegation"]
    assert caches["owned"] == 4
    assert sorted(b for owned in caches["delegates"].values() for b in owned) == [
        "key_cache_0", "key_cache_1", "value_cache_0", "value_cache_1"]
    assert "PASS  program with cache-update delegates matches its input program" in out


def test_cli_failure_after_loading_is_a_short_report_with_status_3():
    done = run_main("tests.models.hf:unsupported", "--steps", "2", timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    failed = done.stdout.split("== failed")[1].strip().splitlines()
    assert failed[:4] == [
        "stage:  functionalize",
        "pass:   InplaceToFunctional",
        "node:   mul_",
        "reason: UnsupportedMutationError: it writes the constant 'weight'; register it as a "
        "buffer",
    ]
    assert "== checks" in done.stdout  # the partial report comes first
    traced = run_main("tests.models.hf:unsupported", "--steps", "2", "--traceback")
    assert traced.returncode == 3 and "Traceback" in traced.stderr


def test_hf_recipe_exported_non_strict_is_made_functional_exactly():
    """Non-strict export of HF's old recipe lifts each ``StaticCache`` layer tensor as a
    constant beside the buffer the recipe registers for it, and writes the constant: it was
    refused ("writes the constant"). Each such constant is the buffer's very tensor, so it
    is read and written as that buffer: both forms, 4 decodes, outputs and every cache
    exactly the exported program's (which eager's are within float rounding)."""
    spec = hf_models.llama()
    exported = export_program(copy.deepcopy(spec["module"]), (), spec["example_kwargs"],
                              mode="non-strict").program
    kinds = [s.kind for s in exported.graph_signature.input_specs]
    assert kinds.count(InputKind.CONSTANT_TENSOR) == 6  # keys, values, counter per layer
    for program in (copy.deepcopy(exported), copy.deepcopy(exported).module()):
        functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            program).program
        assert {"key_cache_0", "value_cache_1", "cumulative_length_0"} <= set(
            mutable_buffers(functional))
        steps = spec["steps"][:4]
        assert_same_behaviour(copy.deepcopy(exported).module(), functional, steps,
                              state=cache_state)
        assert_same_behaviour(copy.deepcopy(spec["module"]), functional, steps, atol=1e-6,
                              state=cache_state)


def test_flow_on_the_hf_recipe_exported_non_strict_passes_its_checks():
    result = flow_on(hf_models.llama, export="non-strict", quantize=False, delegate=False)
    assert result.ok, "\n".join(f"{c.name}: {c.detail}" for c in result.checks)


def test_factory_v2_mistakes_are_load_errors():
    model = hf_models.NoGradState()
    cases = [
        ({"module": model, "example_arg": ()}, "unknown keys 'example_arg'"),
        ({"example_args": ()}, "without 'module'"),
        ({"module": model, "example_args": [1]}, "'example_args' must be a tuple"),
        ({"module": model, "export": "fast"}, "'export' must be one of"),
        ({"module": 3}, "must return an nn.Module"),
    ]
    from passes.flow.factory import ModelError

    for made, message in cases:
        with pytest.raises(ModelError, match=message.replace("(", r"\(")):
            model_spec(made, "f", 2)
    spec = model_spec({"module": copy.deepcopy(model), "example_args": (torch.ones(1, 8),)}, "f", 3)
    assert len(spec.steps) == 3 and all(
        kwargs == {} and torch.equal(args[0], torch.ones(1, 8)) for args, kwargs in spec.steps
    )


def test_a_decode_outside_the_exported_shapes_names_the_call_and_dynamic_shapes():
    def prefill_without_dynamic_shapes():
        spec = hf_models.llama_prefill_then_decode()
        del spec["dynamic_shapes"]
        return spec

    with pytest.raises(FlowError) as info:
        flow_on(prefill_without_dynamic_shapes, quantize=False, delegate=False)
    failure = info.value.failure
    # The 4-token prefill ran; the first 1-token decode call broke the export's guard.
    assert failure.stage == f"decode the exported program (call 2 of {STEPS})"
    assert "Guard failed" in failure.reason and "dynamic_shapes" in failure.reason


def test_a_factory_may_return_an_exported_program_or_its_module():
    model = hf_models.NoGradState()
    example = (torch.ones(1, 8),)
    program = torch.export.export(copy.deepcopy(model), example)
    for module in (program, program.module()):
        spec = model_spec({"module": module, "example_args": example}, "f", 2)
        assert isinstance(spec.module, torch.fx.GraphModule)  # eval() was not called on it
        exported = export_program(spec.module, spec.example_args)
        assert_same_behaviour(model, exported.program, [example] * 3)


def test_a_failure_between_stages_is_a_flow_error_too(monkeypatch):
    from passes.flow import run as flow

    def broken_checks(*args):
        raise KeyError("value_cache_9")

    monkeypatch.setattr(flow, "quantization_checks", broken_checks)
    with pytest.raises(FlowError) as info:
        flow_on(hf_models.no_grad_state, delegate=False)
    assert info.value.failure.stage == "checks after decode quantized, with passes"
    assert info.value.failure.reason == "KeyError: 'value_cache_9'"
    assert info.value.result.step_errors  # what was measured before stays in the result


def test_torchao_failing_on_its_own_skips_only_the_comparisons_with_it():
    calls = []

    def quantizer_failing_once():
        calls.append(1)
        if len(calls) == 1:  # the flow without the passes asks first
            raise RuntimeError("torchao cannot quantize this model")
        return AnnotateEveryOpQuantizer()

    spec = model_spec(hf_models.no_grad_state(), "no_grad_state", STEPS)
    result = run_model(
        spec, quantizer_factory=quantizer_failing_once, delegate=False, log=lambda line: None
    )
    assert result.ok and len(calls) == 2
    assert "torchao's flow without the passes failed" in result.notes[0]
    assert "torchao cannot quantize this model" in result.notes[0]
    assert list(result.step_errors) == ["quantized, with passes"]
    assert [c.name for c in result.checks] == [
        "exported program (strict) matches fp32 eager within float rounding",
        "functional program matches the exported program",
    ]
