"""float16 state written by index and scatter ops, owned by Core ML.

coremltools 9.0 reads each Core ML state as fp32 and keeps a value the program casts to
fp16 as fp16, so ``index_copy_`` / ``cache[pos] = v`` / ``scatter_`` / ``index_add_`` of
``x.half()`` into an fp16 buffer failed inside ExecuTorch's ``preprocess``, wrapped or not
(``ValueError: ... updates has dtype fp16 whereas data has dtype fp32``, on 91ee2ec). The
wrapper now reads such state as fp16 explicitly (``.float().half()``, same bits).
"""

from __future__ import annotations

import pytest

pytest.importorskip("coremltools")

import torch
from executorch.exir import to_edge_transform_and_lower

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch import BufferOwningPartitioner, executorch_state
from passes.executorch.coreml_fp16_state import coreml_fp16_state_reads
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

CACHES = ("k", "v", "s", "a")


def test_the_rewrite_computes_the_same_bits():
    """No lowering: every read of a written fp16 buffer goes through fp32 and back, and
    the program equals eager, outputs and fp16 state, bit for bit over several calls."""
    program = exported(Fp16Caches(), cache_inputs())
    program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    rewritten = coreml_fp16_state_reads(program)
    assert rewritten is not program
    for state in rewritten.graph.find_nodes(op="placeholder"):
        if state.name.startswith("b_"):
            (wide,) = state.users
            (narrow,) = wide.users
            assert (wide.kwargs["dtype"], narrow.kwargs["dtype"]) == (torch.float32,
                                                                      torch.float16)
    assert_same_behaviour(Fp16Caches(), rewritten, cache_inputs(), atol=0)
    assert_same_behaviour(Fp16Caches(), program, cache_inputs(), atol=0)  # left as it was


def test_fp16_caches_lower_with_core_ml_owning_them():
    model = Fp16Caches()
    edge = to_edge_transform_and_lower(
        exported(model, cache_inputs()),
        partitioner=[BufferOwningPartitioner(coreml_partitioner())])
    program = edge.exported_program()
    (delegate,) = delegates(program)
    assert owned_buffers(delegate) == set(CACHES)
    assert coreml_states(delegate) == dict.fromkeys(CACHES, "FLOAT16")
    # Each state is read once and written once, in the order the program writes them.
    ops = [(op, next(a for a in args if a in CACHES)) for op, args in coreml_ops(delegate)
           if op in ("read_state", "write_state")]
    first_reads = [name for op, name in ops[:4]]
    assert first_reads == list(CACHES) and all(op == "read_state" for op, _ in ops[:4])
    assert [name for op, name in ops if op == "write_state"] == list(CACHES)
    assert_same_behaviour(model, program, cache_inputs(), atol=0, state=executorch_state)
    edge.to_executorch()
