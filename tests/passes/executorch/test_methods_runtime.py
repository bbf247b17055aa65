"""run_methods_on_runtime: prefill and decode in one ``.pte`` over one KV cache, fp32, XNNPACK.

The main job's decoder exported as prefill (``x[1, 4, dim]``, positions 0-3) and decode
(``x[1, 1, dim]``), lowered once with ``BufferOwningPartitioner(XnnpackPartitioner(),
methods=...)`` and run on ExecuTorch's runtime: prefill, then three decodes, each reading
what the calls before wrote. Compared with the eager module called in the same order; the
caches are planned once, in the arena the methods share. Bad inputs fail before lowering.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from passes.executorch import ExecuTorchInputError, run_methods_on_runtime
from passes.executorch.methods import lower_methods_to_pte
from passes.flow.examples import kv_decoder, xnnpack_quantizer
from passes.quantization import quantize_methods
from tests.models.methods_on_runtime import (
    accumulator_methods,
    eager_outputs,
    prefill_decode,
    read_only_state_methods,
    run_sharing_state,
    worst,
)
from tests.models.shared_values import TiedBuffers

CACHES = {"layers.0.attn.k_cache", "layers.0.attn.v_cache"}
CACHE_BYTES = 1 * 2 * 16 * 16 * 4  # [1, heads, max_seq, head_dim] fp32


@pytest.fixture(scope="module")
def case():
    return prefill_decode()


@pytest.fixture(scope="module")
def run(case):
    return run_methods_on_runtime(case.programs, case.calls)


def test_decode_reads_what_prefill_wrote(case, run):
    assert run.methods == ["prefill", "decode", "decode", "decode"]
    errors = worst(eager_outputs(case.model, case.calls), run.outputs)
    assert max(errors) <= 1e-5, errors
    # Without the prefill's cache the decodes would differ: the check can fail.
    fresh = eager_outputs(case.model, case.calls[1:])
    assert min(worst(fresh, run.outputs[1:])) > 0.01


def test_the_caches_are_planned_once_for_both_methods(run):
    assert set(run.memory.shared) == CACHES
    assert run.memory.shared_bytes == run.memory.state_bytes == 2 * CACHE_BYTES
    for plan in run.memory.methods.values():
        placed = plan.by_name()
        assert {fqn: (placed[fqn].memory_id, placed[fqn].offset) for fqn in CACHES} == {
            fqn: (b.memory_id, b.offset) for fqn, b in run.memory.shared.items()}
    assert all(count > 0 for count in run.delegates.values())
    assert sum("the methods 'prefill', 'decode' use it" in n for n in run.notes) == 4


def test_the_callers_programs_are_left_as_they_were(case, run):
    for ep in case.programs.values():
        assert all(not bool(ep.state_dict[fqn].any()) for fqn in CACHES)


def _bad_calls(case):
    prompt = case.calls[0][1]
    return [
        ("not a list", "calls", "a list of (method, args, kwargs)"),
        ([("generate", prompt, {})], "calls[0]", "no method 'generate'"),
        ([("prefill", prompt, {"scale": 2.0})], "calls[0]", "no keyword argument"),
        ([("decode", prompt, {})], "calls[0]",
         "'x' has shape [1, 4, 32], the program was exported for [1, 1, 32]"),
        ([("decode", (prompt[0],), {})], "calls[0]", "positional argument"),
        ([("prefill",)], "calls[0]", "a (method, args, kwargs) tuple"),
    ]


@pytest.mark.parametrize("index", range(6))
def test_bad_calls_name_the_call(case, index):
    calls, argument, reason = _bad_calls(case)[index]
    with pytest.raises(ExecuTorchInputError, match=re.escape(reason)) as info:
        run_methods_on_runtime(case.programs, calls)
    assert info.value.argument == argument and info.value.helper == "run_methods_on_runtime"


def test_programs_must_be_a_mapping_sharing_one_state(case):
    with pytest.raises(ExecuTorchInputError) as info:
        run_methods_on_runtime(list(case.programs.values()), case.calls)
    assert info.value.argument == "programs"
    other = copy.deepcopy(case.programs)
    other["decode"].state_dict["layers.0.attn.k_cache"].fill_(1.0)
    with pytest.raises(ExecuTorchInputError, match=re.escape(
            "buffer 'layers.0.attn.k_cache': methods 'prefill' and 'decode' differ in "
            "initial value")):
        run_methods_on_runtime(other, case.calls)
    with pytest.raises(ExecuTorchInputError) as info:
        run_methods_on_runtime(case.programs, case.calls, partitioner="xnnpack")
    assert info.value.argument == "partitioner"
    torch.testing.assert_close(case.programs["prefill"].state_dict["layers.0.attn.k_cache"],
                               torch.zeros(1, 2, 16, 16))


def test_lower_methods_to_pte_names_itself_in_what_it_refuses(case):
    """Before, its refusals of the programs (a mapping of methods, one shared state) and of
    the partitioner said "run_methods_on_runtime: ...", a function the caller never called."""
    other = copy.deepcopy(case.programs)
    other["decode"].state_dict["layers.0.attn.k_cache"] = torch.zeros(
        1, 2, 16, 16, dtype=torch.float16)
    for programs, partitioner, argument in [
            (list(case.programs.values()), None, "programs"),
            (other, None, "programs"),
            (case.programs, "xnnpack", "partitioner")]:
        with pytest.raises(ExecuTorchInputError) as info:
            lower_methods_to_pte(programs, partitioner)
        assert (info.value.helper, info.value.argument) == ("lower_methods_to_pte", argument)
        assert str(info.value).startswith(f"lower_methods_to_pte: {argument}: ")
        assert "run_methods_on_runtime" not in str(info.value)


def test_methods_from_separate_instances_are_refused_before_lowering(case):
    """The prefill and decode exported from two instances of the decoder, one initialized
    otherwise: the caches agree (zeros), the weights do not. Before, the .pte was lowered
    and ran, each method with its own weights (the four-method decoder from two instances:
    11.0 off the one model's eager calls, on the runtime as in Python)."""
    with torch.no_grad():
        decode = torch.export.export(kv_decoder(1, seed=1)[0], case.calls[1][1])
    programs = {"prefill": case.programs["prefill"], "decode": decode}
    with pytest.raises(ExecuTorchInputError, match=r"methods 'prefill' and 'decode' share "
                       r"state but hold parameter '.*' differently.*separate instances") as info:
        run_methods_on_runtime(programs, case.calls)
    assert info.value.argument == "programs"


def test_state_starts_from_its_initial_value_and_a_reader_sees_the_writes():
    """A non-zero initial state (the total starts at 3) is serialized and shared: the
    narrow method only reads it, first its initial value, then what the wide one wrote."""
    acc = accumulator_methods()
    run = run_methods_on_runtime(acc.programs, acc.calls)
    errors = worst(eager_outputs(acc.model, acc.calls), run.outputs)
    assert max(errors) <= 1e-5, errors
    assert set(run.memory.shared) == {"total"} and run.memory.shared_bytes == 4


def test_quantized_state_a_method_only_reads_is_shared_on_the_runtime():
    """quantize_methods(quantize_state=True) with a total, a count and a mask the read
    method only reads: one int8 total, one count, one mask in the ``.pte``, and each read
    sees what the writes stored (8-bit error; the frozen reads were off by up to 8.1)."""
    case = read_only_state_methods()
    quantized = quantize_methods(case.programs, xnnpack_quantizer(), case.calls,
                                 quantize_state=True)
    run = run_methods_on_runtime(quantized, case.calls)
    errors = worst(eager_outputs(case.model, case.calls), run.outputs)
    assert max(errors) < 0.1, errors
    assert set(run.memory.shared) == {"total", "count", "seen"}


def test_float_state_a_method_only_reads_is_quantized_live_there_on_the_runtime():
    """quantize_methods with float-stored state: the read method quantizes the total it
    only reads inside its XNNPACK partition. BufferOwningPartitioner took that for a weight
    left unfolded and refused the valid methods (UnfoldedQuantizeError naming 'total');
    the total is state another method writes, so the runtime now computes what the methods
    compute in Python sharing one state, call after call."""
    case = read_only_state_methods()
    quantized = dict(quantize_methods(case.programs, xnnpack_quantizer(), case.calls))
    run = run_methods_on_runtime(quantized, case.calls)
    expected = run_sharing_state(quantized, case.calls)
    assert max(worst(expected, run.outputs)) == 0
    assert max(worst(eager_outputs(case.model, case.calls), run.outputs)) < 0.1
    assert set(run.memory.shared) == {"total", "count", "seen"}


def test_a_buffer_registered_under_two_names_is_one_state_of_the_methods():
    """One tensor registered as ``a`` and ``b``, written through ``a`` by both methods:
    lowering failed in torch (an untyped AssertionError); the unused name is dropped and
    the methods share the one state."""
    model = TiedBuffers()
    generator = torch.Generator().manual_seed(0)
    four, one = (torch.randn(4, generator=generator),), (torch.randn(1, generator=generator),)
    with torch.no_grad():
        programs = {"four": torch.export.export(model, four),
                    "one": torch.export.export(model, one)}
    calls = [("four", four, {}), ("one", one, {}), ("four", four, {}), ("one", one, {})]
    run = run_methods_on_runtime(programs, calls)
    assert max(worst(eager_outputs(model, calls), run.outputs)) == 0
    assert sum("a second name of" in note for note in run.notes) == 2, run.notes
