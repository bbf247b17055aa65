"""Core ML as a tested backend: issue 31's table, lowered on Linux with ExecuTorch 1.5.1's
``CoreMLPartitioner(take_over_mutable_buffer=True)`` (iOS 18 compile spec), alone and
inside ``BufferOwningPartitioner``, through ``to_edge_transform_and_lower`` and
``to_executorch()``.

Each case checks what ExecuTorch alone does (lowers, or the failure the issue reports,
asserted so the difference the wrapper makes stays documented), which buffers the Core
ML delegate owns (its sub-program's signature and its ``.mlpackage``'s states, fp16) and
that the lowered program run in Python (the delegate's Edge sub-program) equals eager
over several calls, outputs and every buffer. Running the ``.mlpackage`` needs macOS.
"""

from __future__ import annotations

import copy
import time
import warnings

import pytest

pytest.importorskip("coremltools")

import torch
from executorch.exir import to_edge_transform_and_lower

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch import (
    BufferOwningPartitioner,
    DelegateStateWarning,
    executorch_state,
)
from tests.models.coreml_cases import (
    CASES,
    COREML_BACKEND,
    coreml_partitioner,
    coreml_states,
    delegates,
    exported,
    owned_buffers,
)

# ExecuTorch's Edge decompositions round a little differently from eager.
ATOL = 1e-5


class Lowered:
    """One lowering of a case: the program or the error, the wrapper, seconds taken."""

    def __init__(self, name: str, wrapped: bool):
        case = CASES[name]
        self.model, self.inputs = case.make()
        partitioner = coreml_partitioner(case.skip_ops)
        self.wrapper = BufferOwningPartitioner(partitioner) if wrapped else None
        self.error: BaseException | None = None
        self.program = None
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as self.warnings:
                warnings.simplefilter("always")
                edge = to_edge_transform_and_lower(
                    exported(self.model, self.inputs),
                    partitioner=[self.wrapper or partitioner])
                edge.to_executorch()
            self.program = edge.exported_program()
        except Exception as e:  # noqa: BLE001  (the test asserts which one)
            self.error = e
        self.seconds = time.perf_counter() - start


@pytest.fixture(scope="module")
def lowered():
    """(case, wrapped) -> its lowering, made once for the module's tests."""
    done: dict[tuple[str, bool], Lowered] = {}

    def get(name: str, wrapped: bool) -> Lowered:
        if (name, wrapped) not in done:
            done[name, wrapped] = Lowered(name, wrapped)
        return done[name, wrapped]

    return get


@pytest.mark.parametrize("name", sorted(CASES))
def test_executorch_alone(name, lowered):
    case, result = CASES[name], lowered(name, wrapped=False)
    if case.alone is not None:
        error, message = case.alone
        assert isinstance(result.error, error) and message in str(result.error), result.error
        return
    assert result.error is None, result.error
    (delegate,) = delegates(result.program)
    assert owned_buffers(delegate) == case.owned
    assert_same_behaviour(result.model, result.program, result.inputs, atol=ATOL,
                          state=executorch_state)


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapped_lowers_and_the_delegate_owns_the_state(name, lowered):
    case, result = CASES[name], lowered(name, wrapped=True)
    assert result.error is None, result.error
    (delegate,) = delegates(result.program)
    assert delegate.backend_id == COREML_BACKEND
    assert owned_buffers(delegate) == case.owned
    # Nothing left for the top level to write back: Core ML keeps it as state.
    assert not result.program.graph_signature.buffers_to_mutate
    # The .mlpackage has one state per owned buffer, in fp16 (Core ML's only state type).
    assert coreml_states(delegate) == {fqn.replace(".", "_"): "FLOAT16" for fqn in case.owned}
    assert sorted(note.split("'")[1] for note in result.wrapper.notes) == sorted(case.owned)
    # Each owned fp32 buffer is said to become fp16 on the device; every one starts at zeros.
    said = [(w.message.buffer, w.message.issue) for w in result.warnings
            if isinstance(w.message, DelegateStateWarning)]
    assert sorted(said) == sorted((fqn, "fp16") for fqn in case.owned)
    if name == "mm_outside":
        top = {str(n.target) for n in result.program.graph.nodes if n.op == "call_function"}
        assert any("mm" in target for target in top)


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapped_runs_like_eager(name, lowered):
    result = lowered(name, wrapped=True)
    assert result.error is None, result.error
    assert_same_behaviour(result.model, result.program, result.inputs, atol=ATOL,
                          state=executorch_state)


def test_a_hugging_face_decoder_of_the_old_recipe_lowers_with_its_caches_owned():
    """transformers' own ExecuTorch recipe (``TorchExportableModuleWithStaticCache``): Core ML
    owns the keys and values; the int64 ``cumulative_length`` counters, which it would keep
    as fp16 state, stay at the top level (on 63577b5 the wrapper refused the program)."""
    from tests.models import hf

    model, steps = hf.llama_module(layers=1), hf.decode_steps(4)
    with torch.no_grad():
        program = torch.export.export(copy.deepcopy(model), (), steps[0][1], strict=True)
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    wrapper = BufferOwningPartitioner(coreml_partitioner())
    edge = to_edge_transform_and_lower(program, partitioner=[wrapper])
    (delegate,) = delegates(edge.exported_program())
    assert owned_buffers(delegate) == {"key_cache_0", "value_cache_0"}
    assert [n.split("'")[1] for n in wrapper.notes if n.startswith("kept ")] == [
        "cumulative_length_0"]

    def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:  # the mutable buffers
        return {k: v for k, v in executorch_state(module).items()
                if k.rsplit(".", 1)[-1].startswith(("key_cache", "value_cache", "cumulative"))}

    assert_same_behaviour(model, edge.exported_program(), steps, atol=ATOL, state=state)
    edge.to_executorch()
