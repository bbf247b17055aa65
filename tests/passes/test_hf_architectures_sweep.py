"""Other Hugging Face architectures through transformers' own exporter (a tiny random Mistral,
all sliding-window layers; a Gemma3 and a Cohere2, one sliding and one global layer; a
GPT-NeoX and a Falcon (fused query-key-value projection), other module layouts; a GPT-Neo,
whose decode returns each layer's keys as the cast its attention reads them through,
``to(float32)`` of the written cache):
MarkMutableBuffers + InplaceToFunctional, then InputsToBuffers with the cache
mapping read from the programs' call specs makes the prefill's and the decode's cache one
resident state; called in turn, the two methods give HF's own programs' logits and cache bit
for bit, call after call; BuffersToInputs gives each program back exactly.

HF's decode of a sliding-window layer is exported with the window not yet full (its Python
``cumulative_length_int`` is baked in): past the window HF's own program fails
(``index_copy_`` out of bounds), so the sliding architectures are compared over the decodes
that fit in the window."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree

from pass_manager import PassManager
from passes import BuffersToInputs, InplaceToFunctional, InputsToBuffers, MarkMutableBuffers

pytest.importorskip("transformers.exporters")

from tests.models import hf_exporter

FORMS = ["exported", "module"]
DECODES = 4  # the prompt is 4 tokens, the sliding window 8


@pytest.fixture(scope="module", params=["mistral", "gemma3", "gpt_neox", "falcon", "cohere2",
                                                "gpt_neo"])
def hf(request):
    return hf_exporter.export(request.param)


def functional(program):
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


def runnable(program):
    return program.module() if isinstance(program, torch.export.ExportedProgram) else program


def test_the_mapping_names_every_layers_leaves(hf):
    options = hf_exporter.cache_options(hf)
    layers = hf.model.config.num_hidden_layers
    expected = {f"cache.layers.{i}.{leaf}" for i in range(layers)
                for leaf in ("keys", "values", "cumulative_length")}
    assert set(options["decode"]["buffers"].values()) == expected
    prefill = options["prefill"]
    assert set(prefill["buffers"].values()) | set(prefill["created"].values()) == expected


@pytest.mark.parametrize("form", FORMS)
def test_prefill_and_decode_share_one_resident_cache(hf, form):
    assert_resident_methods_follow_hf(hf, form)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("architecture", hf_exporter.STATE_LAYOUTS)
def test_other_state_layouts_share_one_resident_state(architecture, form):
    """T5's EncoderDecoderCache (the cross-attention cache created by the prefill and only
    read by the decode, which returns it as it was), Mamba's convolution and SSM states,
    LFM2's convolution state beside an attention cache: the same options read from the call
    specs make them one resident state, and the methods follow HF's own programs bit for
    bit, logits and every state leaf, call after call."""
    assert_resident_methods_follow_hf(hf_exporter.export(architecture), form)


def assert_resident_methods_follow_hf(hf, form):
    """The prefill and the decode made resident with :func:`hf_exporter.cache_options`,
    sharing one state, called in turn as HF threads its own programs: the same logits and
    state, bit for bit, after every call."""
    options = hf_exporter.cache_options(hf)
    methods = {}
    for name in ("prefill", "decode"):
        program = copy.deepcopy(getattr(hf, name))
        program = functional(program if form == "exported" else program.module())
        methods[name] = runnable(PassManager([InputsToBuffers(**options[name])]).run(
            program).program)
    state = {n: t for n, t in methods["decode"].named_buffers() if n.startswith("cache.")}
    for name, tensor in state.items():  # one resident state for both methods
        owner, leaf = name.rsplit(".", 1)
        methods["prefill"].get_submodule(owner)._buffers[leaf] = tensor

    def without_cache(module):
        def call(**kwargs):
            if "cache" not in module._in_spec.child(1).context:  # Mamba's prefill takes an
                kwargs.pop("cache")  # empty cache: no leaf to move, the keyword stays
            return module(**kwargs)[0], None
        return call

    expected = hf_exporter.thread_calls(
        hf, hf.prefill.module(), hf_exporter.exported_cache_calls(hf, hf.decode.module()),
        DECODES)
    got = hf_exporter.thread_calls(hf, without_cache(methods["prefill"]),
                                   without_cache(methods["decode"]), DECODES)
    paths = hf_exporter.cache_paths(hf)
    calls = 0
    for (logits, cache), (resident_logits, _) in zip(expected, got, strict=True):
        assert torch.equal(resident_logits, logits)
        for path, leaf in zip(paths, pytree.tree_leaves(cache), strict=True):
            assert torch.equal(state[f"cache.{path}"], leaf), path
        calls += 1
    assert calls == DECODES + 1


@pytest.mark.parametrize("method", ["prefill", "decode"])
def test_each_program_round_trips_exactly(hf, method):
    options = hf_exporter.cache_options(hf)[method]
    program = functional(copy.deepcopy(getattr(hf, method)))
    resident = PassManager([InputsToBuffers(**options)]).run(program).program
    back = PassManager([BuffersToInputs()]).run(resident).program
    assert back.call_spec.in_spec == program.call_spec.in_spec
    assert back.call_spec.out_spec == program.call_spec.out_spec
    kwargs = getattr(hf, f"{method}_kwargs")
    first, second = copy.deepcopy(kwargs), copy.deepcopy(kwargs)
    for _ in range(3):  # the decode advances its cache in place; each prefill starts afresh
        out_first, out_second = program.module()(**first), back.module()(**second)
        torch.testing.assert_close(pytree.tree_leaves(out_second), pytree.tree_leaves(out_first),
                                   rtol=0, atol=0)
        torch.testing.assert_close(pytree.tree_leaves(second), pytree.tree_leaves(first),
                                   rtol=0, atol=0)
        if method == "prefill":
            first, second = copy.deepcopy(kwargs), copy.deepcopy(kwargs)


@pytest.mark.parametrize("method", ["prefill", "decode"])
def test_each_programs_own_call_fits_it_as_a_calibration_call(hf, method):
    """Gemma3's prefill takes ``{"full_attention": None, "sliding_attention": mask}``: the
    ``None`` is an input but no placeholder, and HF's call writes the masks in another key
    order than the program's call spec (quantize_methods refused the call before)."""
    from passes._methods.calibration import check_calibration_call

    program = functional(copy.deepcopy(getattr(hf, method)))
    resident = PassManager([InputsToBuffers(**hf_exporter.cache_options(hf)[method])]).run(
        program).program
    kwargs = getattr(hf, f"{method}_kwargs")
    check_calibration_call(program, (), kwargs, "quantize_methods", 0, method)
    without_cache = {k: v for k, v in kwargs.items() if k != "cache"}
    check_calibration_call(resident, (), without_cache, "quantize_methods", 0, method)


def test_a_resident_hf_decode_alone_runs_on_the_runtime():
    """HF's caches carry a 0-d int64 counter per layer; resident, they lower with
    BufferOwningPartitioner(XnnpackPartitioner()) (the 0-d rule is for quantized state)."""
    pytest.importorskip("executorch")
    from passes.executorch import decode_on_runtime

    hf = hf_exporter.export("mistral")
    options = hf_exporter.cache_options(hf)["decode"]
    resident = PassManager([InputsToBuffers(**options)]).run(functional(hf.decode)).program
    steps = []
    for position in range(4, 4 + DECODES):
        kwargs = hf_exporter.decode_kwargs(hf.decode_kwargs, 3, position, None)
        del kwargs["cache"]
        steps.append(((), kwargs))
    reference = copy.deepcopy(resident).module()  # its own state: calls advance it
    expected = [reference(**kwargs) for _, kwargs in steps]
    on_runtime = decode_on_runtime(resident, None, steps)
    for outputs, logits in zip(on_runtime.outputs, expected, strict=True):
        torch.testing.assert_close(outputs[0], logits[0], rtol=1e-5, atol=1e-5)
