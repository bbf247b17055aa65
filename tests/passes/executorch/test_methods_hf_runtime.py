"""A tiny random Hugging Face Llama (HF's static cache, exported strict with ``input_ids`` /
``cache_position`` keyword inputs, as HF's ExecuTorch recipe does) as prefill (4 tokens) and
one-token decode in one ``.pte`` on ExecuTorch's runtime, fp32: prefill then three decodes
match the eager module called in the same order, every cache planned once for both."""

from __future__ import annotations

from passes.executorch import run_methods_on_runtime
from tests.models.methods_on_runtime import eager_outputs, hf_llama_prefill_decode, worst


def test_hf_llama_prefill_then_decode_on_the_runtime():
    case = hf_llama_prefill_decode()
    run = run_methods_on_runtime(case.programs, case.calls)
    errors = worst(eager_outputs(case.model, case.calls), run.outputs)
    assert max(errors) <= 1e-5, errors
    fresh = eager_outputs(case.model, case.calls[1:])
    assert min(worst(fresh, run.outputs[1:])) > 0.01  # the decodes read the prefill's cache
    caches = {fqn for fqn in run.memory.shared if "cache" in fqn}
    assert len(caches) == 4  # keys and values of two layers
    for plan in run.memory.methods.values():
        assert caches <= set(plan.by_name())
    assert run.memory.state_bytes == run.memory.shared_bytes
