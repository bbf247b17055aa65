"""Factory contract v3 (several methods over one state): what is read, and what is refused."""

from __future__ import annotations

import pytest
import torch

from passes.flow.examples import prefill_decode_job
from passes.flow.factory import MethodsSpec, ModelError, export_methods, methods_spec, model_spec


def test_the_builtin_prefill_decode_job_reads_as_two_methods_and_its_calls_in_order():
    spec = model_spec(prefill_decode_job(n_layers=1, prefill=4, decode_steps=3), "job", 8)
    assert isinstance(spec, MethodsSpec)
    assert list(spec.methods) == ["prefill", "decode"]
    assert [(m, args[0].shape[1], args[1].tolist()) for m, args, _ in spec.steps] == [
        ("prefill", 4, [0, 1, 2, 3]), ("decode", 1, [4]), ("decode", 1, [5]), ("decode", 1, [6])]
    # --steps keeps the first calls of the sequence
    assert [m for m, _, _ in model_spec(prefill_decode_job(1), "job", 2).steps] == [
        "prefill", "decode"]


def test_without_steps_each_method_example_is_called_once_in_order():
    made = prefill_decode_job(n_layers=1)
    del made["steps"]
    spec = methods_spec(made, "job", 8)
    assert [m for m, _, _ in spec.steps] == ["prefill", "decode"]
    assert spec.steps[0][1][0].shape == (1, 4, 32)


def test_steps_take_args_args_and_kwargs_or_a_keyword_mapping():
    made = prefill_decode_job(n_layers=1)
    x, pos = made["steps"][1][1]
    made["steps"] = [("decode", (x, pos)), ("decode", (x,), {"input_pos": pos}),
                     ("decode", {"x": x, "input_pos": pos})]
    spec = methods_spec(made, "job", 8)
    assert [(len(args), sorted(kwargs)) for _, args, kwargs in spec.steps] == [
        (2, []), (1, ["input_pos"]), (0, ["input_pos", "x"])]


def test_every_method_is_exported_from_the_one_module_with_the_same_buffer_names():
    spec = methods_spec(prefill_decode_job(n_layers=1), "job", 8)
    exported = export_methods(spec)
    names = {m: set(e.program.state_dict) for m, e in exported.items()}
    assert names["prefill"] == names["decode"]
    assert any("k_cache" in name for name in names["decode"])
    inputs = {m: [tuple(s.meta["val"].shape) for s in e.program.graph.find_nodes(op="placeholder")
                  if s.name == "x"] for m, e in exported.items()}
    assert inputs == {"prefill": [(1, 4, 32)], "decode": [(1, 1, 32)]}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(methods={}), "'methods' must map method names"),
        (lambda m: m.update(methods={"decode": (torch.ones(1),)}), r"methods\['decode'\] must "
         "be a mapping"),
        (lambda m: m["methods"]["decode"].update(shapes=None), r"unknown keys 'shapes'"),
        (lambda m: m.update(steps=[("generate", (torch.ones(1),))]), "calls 'generate', which "
         "is not one of the methods"),
        (lambda m: m.update(steps=[(torch.ones(1),)]), r"steps\[0\] must be \(method, args\)"),
        (lambda m: m.update(steps="prefill"), "'steps' must be a list"),
        (lambda m: m.update(example_args=()), "unknown keys 'example_args' beside 'methods'"),
        (lambda m: m["methods"]["prefill"].update(export="eager"), "must be one of"),
        (lambda m: m.update(module=torch.ones(1)), "must return an nn.Module"),
        (lambda m: m["methods"]["decode"].update(example_args=(torch.ones(3),)),
         r"methods\['decode'\]'s example does not fit KVDecoder.forward\(x, input_pos\): "
         "missing a required argument: 'input_pos'"),
        (lambda m: m.update(steps=[("decode", (torch.ones(1, 1, 32),))]),
         r"steps\[0\] does not fit KVDecoder.forward\(x, input_pos\)"),
    ],
)
def test_a_malformed_v3_result_is_a_model_error_saying_what_to_change(edit, message):
    made = prefill_decode_job(n_layers=1)
    edit(made)
    with pytest.raises(ModelError, match=message):
        model_spec(made, "job", 8)


def test_a_method_export_cannot_trace_is_named():
    made = prefill_decode_job(n_layers=1)
    # forward's two inputs, but an x of another width than the model's: eager fails on it
    # (found before export, which cannot trace it either)
    made["methods"]["decode"]["example_args"] = (torch.ones(1, 1, 3), torch.tensor([0]))
    with pytest.raises(ModelError, match=r"method 'decode': KVDecoder\.forward raises on its "
                       "example in eager, before export: RuntimeError"):
        export_methods(methods_spec(made, "job", 8))
