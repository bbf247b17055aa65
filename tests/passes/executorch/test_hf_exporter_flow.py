"""The Hugging Face exporter's programs through this library's flow onto ExecuTorch's runtime.

transformers 5.24's ``ExecutorchExporter.export_for_generation`` exports a tiny random Llama
and Qwen3 as a prefill and a decode whose ``StaticCache`` is carried through the call
(:mod:`tests.models.hf_exporter`, stopped where HF would lower). Here each program goes
through MarkMutableBuffers + InplaceToFunctional, then InputsToBuffers with
``resident_cache_options`` (both methods write one resident cache), optionally
``quantize_methods`` (XNNPACK quantizer, calibrated along the deployment's calls: the prefill,
then decodes), and ``run_methods_on_runtime(..., partitioner=XnnpackPartitioner())`` (which
wraps it in ``BufferOwningPartitioner`` told both methods): one ``.pte``, loaded once, the
prefill and 7 decodes called in turn on the runtime, each call passing only its token inputs.

Greedy generation: the calls feed HF eager ``generate``'s tokens (greedy, the export's
``GenerationConfig``, static cache) and each call's runtime logits must pick the next of
those tokens. A closed greedy loop on the runtime (each decode fed the argmax of the previous
runtime logits) then makes exactly these calls, so the 8 tokens are HF's, token for token.

Quantized: the bound is the quantized baseline, the same quantized methods run in Python
sharing one state (``run_sharing_state``), and each call's logits on the runtime must lie
within one step of the logits' output grid of it (``within_grid_steps``: one step, plus
float32 rounding slack of 2**-8 step).
"""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, InputsToBuffers, MarkMutableBuffers, QuantizeMutableBuffers
from passes.examples import xnnpack_quantizer
from passes.executorch import run_methods_on_runtime
from passes.executorch.runtime import output_grid, within_grid_steps
from passes.quantization import quantize_methods

pytest.importorskip("transformers.exporters")

from tests.models import hf_exporter
from tests.models.methods_on_runtime import run_sharing_state, worst

NEW_TOKENS = 8
CACHES = [f"cache.layers.{layer}.{leaf}" for layer in range(2) for leaf in ("keys", "values")]
COUNTERS = [f"cache.layers.{layer}.cumulative_length" for layer in range(2)]
FP32_CACHE_BYTES = 4 * 1 * 1 * hf_exporter.MAX_CACHE * 8 * 4  # 4 caches [1, 1, 16, 8] fp32
COUNTER_BYTES = 2 * 8  # two int64 counters


def resident_methods(hf: hf_exporter.HfExport) -> dict[str, torch.export.ExportedProgram]:
    """HF's prefill and decode, functional, sharing one resident cache."""
    options = hf_exporter.resident_cache_options(hf)
    methods = {}
    for name in ("prefill", "decode"):
        program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            copy.deepcopy(getattr(hf, name))).program
        methods[name] = PassManager([InputsToBuffers(**options[name])]).run(program).program
    return methods


def generation_calls(hf: hf_exporter.HfExport, tokens: torch.Tensor) -> list:
    """The prefill, then one decode per token but the last, as keyword calls without the
    cache (it is resident now)."""
    prefill = {k: v for k, v in hf.prefill_kwargs.items() if k != "cache"}
    calls = [("prefill", (), prefill)]
    position = prefill["input_ids"].shape[-1]
    for step, token in enumerate(tokens[:-1].tolist()):
        decode = hf_exporter.decode_kwargs(hf.decode_kwargs, token, position + step, None)
        del decode["cache"]
        calls.append(("decode", (), decode))
    return calls


def greedy_tokens(outputs: list) -> list[int]:
    """The argmax of each call's last logits (the logits are each call's first output)."""
    return [int(call[0][0, -1].argmax()) for call in outputs]


def state_bytes(program: torch.export.ExportedProgram, names: list[str]) -> int:
    found = {**program.state_dict, **program.constants}
    return sum(found[n].numel() * found[n].element_size() for n in names)


class Case:
    def __init__(self, architecture: str):
        self.hf = hf_exporter.export(architecture)
        self.tokens = hf_exporter.eager_generate(self.hf, NEW_TOKENS)
        self.methods = resident_methods(self.hf)
        self.calls = generation_calls(self.hf, self.tokens)


@pytest.fixture(scope="module")
def llama():
    return Case("llama")


@pytest.fixture(scope="module")
def qwen3():
    return Case("qwen3")


@pytest.fixture(scope="module")
def llama_quantized(llama):
    return quantize_methods(llama.methods, xnnpack_quantizer(), llama.calls)


@pytest.fixture(scope="module")
def llama_stored(llama_quantized):
    """Both quantized methods with their caches stored as int8 (QuantizeMutableBuffers run
    once for the module: the tests below only read the programs; lowering and
    ``run_sharing_state`` work on private copies)."""
    stored = PassManager([QuantizeMutableBuffers()]).run(copy.deepcopy(dict(llama_quantized)))
    return {name: run.program for name, run in stored.items()}


def _runtime(methods, calls):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return run_methods_on_runtime(methods, calls, partitioner=XnnpackPartitioner())


def _assert_shared_resident_cache(run):
    assert set(run.memory.shared) == set(CACHES + COUNTERS)
    for plan in run.memory.methods.values():
        assert {b.name for b in plan.mutable_buffers} == set(CACHES + COUNTERS)
    assert run.memory.state_bytes == run.memory.shared_bytes == FP32_CACHE_BYTES + COUNTER_BYTES


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_fp32_greedy_generation_on_the_runtime_is_hf_eager_generate(architecture, request):
    case = request.getfixturevalue(architecture)
    run = _runtime(case.methods, case.calls)
    assert greedy_tokens(run.outputs) == case.tokens.tolist()
    # Both methods in one .pte, every cache planned once at one place both read and write.
    _assert_shared_resident_cache(run)
    assert all(count > 0 for count in run.delegates.values())
    # The decodes read the cache the prefill wrote: called alone from a fresh cache, they differ.
    fresh = run_sharing_state(case.methods, case.calls[1:])
    assert min(worst(fresh, run.outputs[1:])) > 1e-3


def test_resident_programs_take_only_their_token_inputs(llama):
    for name, program in llama.methods.items():
        sig = program.graph_signature
        assert "cache" not in "".join(sig.user_inputs), (name, sig.user_inputs)
        assert len(sig.user_outputs) == 1  # the logits; the cache stays on the device
        assert set(sig.buffers_to_mutate.values()) == set(CACHES + COUNTERS)


def test_quantize_methods_calibrates_along_one_shared_cache(llama, llama_quantized):
    assert set(llama_quantized.shared_buffers) == set(CACHES + COUNTERS)
    for fqn in CACHES + COUNTERS:
        assert sorted(llama_quantized.shared_buffers[fqn]) == ["decode", "prefill"]


def test_quantized_logits_on_the_runtime_within_one_grid_step_of_python(llama, llama_quantized):
    methods = dict(llama_quantized)
    run = _runtime(methods, llama.calls)
    expected = run_sharing_state(methods, llama.calls)
    grids = {name: output_grid(ep) for name, ep in methods.items()}
    assert all(grid is not None for grid in grids.values())
    for index, (difference, (method, _, _)) in enumerate(
            zip(worst(expected, run.outputs), llama.calls, strict=True)):
        assert within_grid_steps(difference, grids[method]), (index, difference, grids)
    _assert_shared_resident_cache(run)  # fp32-stored caches here; int8 below


def test_quantize_mutable_buffers_stores_the_decodes_caches_as_int8(llama_quantized):
    decode = llama_quantized["decode"]
    before = state_bytes(decode, CACHES)
    result = PassManager([QuantizeMutableBuffers()]).run(copy.deepcopy(decode))
    after = state_bytes(result.program, CACHES)
    assert (before, after) == (FP32_CACHE_BYTES, FP32_CACHE_BYTES // 4)
    found = {**result.program.state_dict, **result.program.constants}
    assert all(found[n].dtype == torch.int8 for n in CACHES)


def test_both_methods_store_their_caches_as_int8(llama_stored):
    assert sorted(llama_stored) == ["decode", "prefill"]
    for program in llama_stored.values():
        assert state_bytes(program, CACHES) == FP32_CACHE_BYTES // 4


def test_both_methods_int8_caches_run_from_one_pte_like_python(llama, llama_stored):
    """Both methods store the caches as int8 (the prefill writes them into a fresh tensor of
    zeros, which lies on every grid), one .pte plans them once at a quarter of the bytes,
    and the runtime computes what the int8-stored methods compute in Python. (ExecuTorch's
    emitter started the prefill's counters from a key cache's int8 bytes here until
    ``repair_initial_state``.)"""
    methods = llama_stored
    for program in methods.values():
        assert state_bytes(program, CACHES) == FP32_CACHE_BYTES // 4
    run = _runtime(methods, llama.calls)
    assert run.memory.shared_bytes == FP32_CACHE_BYTES // 4 + COUNTER_BYTES
    expected = run_sharing_state(methods, llama.calls)
    grids = {name: output_grid(ep) for name, ep in methods.items()}
    for difference, (method, _, _) in zip(worst(expected, run.outputs), llama.calls,
                                          strict=True):
        assert within_grid_steps(difference, grids[method]), (difference, grids)


def test_quantize_mutable_buffers_says_why_it_leaves_cache_inputs_float(llama):
    decode = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        copy.deepcopy(llama.hf.decode)).program
    record = PassManager([QuantizeMutableBuffers()]).run(decode).report.records[0]
    assert sum("cache_" in note for note in record.notes) == len(CACHES + COUNTERS), record.notes


def test_the_resident_decode_lowers_with_core_ml_owning_its_caches(llama):
    """Core ML owns the float caches as fp16 state; the int64 ``cumulative_length`` counters,
    which Core ML would round as fp16 state, stay at the top level (refused before)."""
    pytest.importorskip("coremltools")
    from executorch.exir import to_edge_transform_and_lower

    from passes.executorch import BufferOwningPartitioner, executorch_state
    from tests.models.coreml_cases import (
        coreml_partitioner,
        coreml_states,
        delegates,
        owned_buffers,
    )

    decode = llama.methods["decode"]
    wrapper = BufferOwningPartitioner(coreml_partitioner())
    edge = to_edge_transform_and_lower(copy.deepcopy(decode), partitioner=[wrapper])
    program = edge.exported_program()
    (delegate,) = delegates(program)
    assert owned_buffers(delegate) == set(CACHES)
    assert coreml_states(delegate) == {c.replace(".", "_"): "FLOAT16" for c in CACHES}
    kept = [n for n in wrapper.notes if n.startswith("kept ")]
    assert [n.split("'")[1] for n in kept] == COUNTERS
    calls = [(args, kwargs) for name, args, kwargs in llama.calls if name == "decode"]
    assert_same_behaviour(decode, program, calls, atol=1e-5, state=executorch_state)
    edge.to_executorch()
