"""float16 state written by index and scatter ops, owned by Core ML.

coremltools 9.0 reads each Core ML state as fp32 and keeps a value the program casts to
fp16 as fp16, so ``index_copy_`` / ``cache[pos] = v`` / ``scatter_`` of ``x.half()`` into
an fp16 buffer failed inside ExecuTorch's ``preprocess``, wrapped or not (``ValueError: ...
updates has dtype fp16 whereas data has dtype fp32``, on 91ee2ec). The wrapper now computes
such writes through fp32 (same bits); a write that adds into fp16 state is refused, typed.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("coremltools")

import torch
from executorch.exir import to_edge_transform_and_lower

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch import BufferOwningPartitioner, DelegateStateWriteError, executorch_state
from passes.executorch.coreml_fp16_state import coreml_fp16_writes
from tests.models.coreml_cases import (
    Fp16Caches,
    cache_inputs,
    coreml_ops,
    coreml_partitioner,
    coreml_states,
    delegates,
    exported,
    owned_buffers,
)

CACHES = {"k", "v", "s"}


def test_the_rewrite_computes_the_same_bits():
    """No lowering: the rewritten program equals the original, outputs and fp16 state,
    bit for bit over several calls, and writes no fp16 destination from fp16 any more."""
    program = exported(Fp16Caches(), cache_inputs())
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    rewritten = coreml_fp16_writes(program)
    assert rewritten is not program
    writes = [n for n in rewritten.graph.nodes if n.op == "call_function" and any(
        name in str(n.target) for name in ("index_copy", "index_put", "scatter"))]
    assert len(writes) == 3
    assert all(n.meta["val"].dtype == torch.float32 for n in writes)
    assert_same_behaviour(Fp16Caches(), rewritten, cache_inputs(), atol=0)
    assert coreml_fp16_writes(rewritten) is rewritten  # nothing left to rewrite


def test_fp16_caches_lower_with_core_ml_owning_them():
    model = Fp16Caches()
    edge = to_edge_transform_and_lower(
        exported(model, cache_inputs()),
        partitioner=[BufferOwningPartitioner(coreml_partitioner())])
    program = edge.exported_program()
    (delegate,) = delegates(program)
    assert owned_buffers(delegate) == CACHES
    assert coreml_states(delegate) == dict.fromkeys(CACHES, "FLOAT16")
    # Each state is written once, in the order the program writes them.
    written = [next(a for a in args if a in CACHES) for op, args in coreml_ops(delegate)
               if op == "write_state"]
    assert written == ["k", "v", "s"]
    assert_same_behaviour(model, program, cache_inputs(), atol=0, state=executorch_state)
    edge.to_executorch()


def test_adding_into_fp16_state_owned_by_core_ml_is_refused_naming_the_write():
    with pytest.raises(DelegateStateWriteError) as info:
        to_edge_transform_and_lower(
            exported(Fp16Caches(accumulate=True), cache_inputs()),
            partitioner=[BufferOwningPartitioner(coreml_partitioner())])
    error = info.value
    assert (error.buffer, error.backend) == ("s", "CoreMLBackend")
    assert error.node.startswith("aten_index_put") and "aten::index_put" in str(error)
    assert "store the buffer as float32" in str(error)
