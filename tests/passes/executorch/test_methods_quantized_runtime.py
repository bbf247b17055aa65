"""Integer-stored caches shared by prefill and decode in one ``.pte``.

The decoder's prefill and decode quantized together (``quantize_methods``, XNNPACK
quantizer: one calibration along the deployment's calls over one state, one grid per shared
cache) and its caches stored as int8 (``quantize_state=True``), so the integers the prefill
writes mean the same to the decode.
Lowered once: the caches are planned once, at their integer size, and every call on the
runtime is within one step of the output's grid of the Python programs sharing one state.
"""

from __future__ import annotations

import pytest

from passes import mutable_buffers
from passes.executorch import run_methods_on_runtime
from passes.executorch.runtime import output_grid
from tests.models.methods_on_runtime import quantized_prefill_decode, run_sharing_state, worst

CACHES = ("layers.0.attn.k_cache", "layers.0.attn.v_cache")
INT8_CACHE_BYTES = 1 * 2 * 16 * 16


@pytest.fixture(scope="module")
def case():
    return quantized_prefill_decode()


@pytest.fixture(scope="module")
def run(case):
    return run_methods_on_runtime(case.programs, case.calls)


def test_each_cache_has_one_grid_and_integer_storage_in_both_methods(case):
    grids = {name: {fqn: mutable_buffers(ep)[fqn].grid for fqn in CACHES}
             for name, ep in case.programs.items()}
    for fqn in CACHES:
        prefill, decode = grids["prefill"][fqn], grids["decode"][fqn]
        assert prefill.same(decode), (prefill, decode)
    for ep in case.programs.values():
        assert all(str(ep.state_dict[fqn].dtype) == "torch.int8" for fqn in CACHES)


def test_integer_caches_are_planned_once_at_their_size(run):
    assert set(run.memory.shared) == set(CACHES)
    for fqn in CACHES:
        planned = run.memory.shared[fqn]
        assert planned.dtype == "int8" and planned.nbytes == INT8_CACHE_BYTES
    assert run.memory.shared_bytes == run.memory.state_bytes == 2 * INT8_CACHE_BYTES
    for plan in run.memory.methods.values():
        assert {b.name: b.dtype for b in plan.mutable_buffers} == dict.fromkeys(CACHES, "int8")


def test_runtime_decodes_like_python_within_one_grid_step(case, run):
    expected = run_sharing_state(case.programs, case.calls)
    grids = {name: output_grid(ep) for name, ep in case.programs.items()}
    errors = worst(expected, run.outputs)
    for index, (method, _, _) in enumerate(case.calls):
        assert errors[index] <= grids[method], (index, errors, grids)
    # The decodes read the prefill's integers: from a fresh cache they would differ.
    fresh = run_sharing_state(case.programs, case.calls[1:])
    assert min(worst(fresh, run.outputs[1:])) > max(grids.values())
