"""Our PassManager and passes as ExecuTorch ``transform_passes`` on the Edge dialect program.

ExecuTorch calls each transform pass as ``pass(graph_module) -> PassResult`` on the Edge
program; a PassManager (and any single pass) is such a callable. Conditions are checked
on Edge ops (``EdgeOpOverload``): their schemas are read through the ATen op they wrap.
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.exir import to_edge, to_edge_transform_and_lower
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.dialects.edge._ops import EdgeOpOverload

from pass_manager import (
    Effects,
    Pass,
    PassManager,
    PassResult,
    PreconditionError,
    assert_same_behaviour,
)
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.conditions import Functional
from passes.executorch import BufferOwningPartitioner, executorch_state
from passes.flow.examples import decode_inputs, kv_decoder
from tests.models.executorch_cases import CALLS, everything

ATOL = 1e-5  # Edge decompositions round slightly differently from eager


class RecordEdgeOps(Pass):
    """Needs a functional program; records the ops it saw."""

    requires = frozenset({Functional})
    effects = Effects(in_place=True)

    def __init__(self) -> None:
        self.seen: list = []

    def call(self, program):
        self.seen = [n.target for n in program.graph.nodes if n.op == "call_function"]
        return PassResult(program, False)


def _decoder():
    model, _ = kv_decoder(1)
    inputs = decode_inputs(model.cfg, CALLS, start=2)
    return model, inputs, torch.export.export(copy.deepcopy(model), inputs[0])


def _write_cache_in_place(gm: torch.fx.GraphModule) -> None:
    """A (wrong) user transform: the first functional cache update becomes in place."""
    node = next(n for n in gm.graph.nodes if n.target == exir_ops.edge.aten.index_put.default)
    node.target = exir_ops.edge.aten.index_put_.default
    gm.recompile()


def test_pass_manager_as_transform_pass():
    model, inputs, ep = _decoder()
    recorder = RecordEdgeOps()
    manager = PassManager([MarkMutableBuffers(), InplaceToFunctional(), recorder])
    lowered = to_edge_transform_and_lower(
        ep,
        transform_passes=[manager],
        partitioner=[BufferOwningPartitioner(everything())],
    ).exported_program()
    assert recorder.seen and all(isinstance(t, EdgeOpOverload) for t in recorder.seen
                                 if t.__class__.__module__.startswith("executorch"))
    assert exir_ops.edge.aten.index_put.default in recorder.seen
    assert_same_behaviour(model, lowered, inputs, atol=ATOL, state=executorch_state)


def test_single_passes_as_transform_passes():
    model, inputs, ep = _decoder()
    lowered = to_edge_transform_and_lower(
        ep, transform_passes=[MarkMutableBuffers(), InplaceToFunctional(), RecordEdgeOps()]
    ).exported_program()
    assert_same_behaviour(model, lowered, inputs, atol=ATOL)


def test_conditions_are_checked_on_edge_ops():
    _, _, ep = _decoder()
    edge = to_edge(ep)
    gm = edge.exported_program().graph_module
    assert Functional.check(gm) == []
    broken = copy.deepcopy(gm)
    _write_cache_in_place(broken)
    (violation,) = Functional.check(broken)
    assert violation.startswith("aten_index_put_default: ") and "writes its argument" in violation

    def in_place_update(graph_module):
        _write_cache_in_place(graph_module)
        return PassResult(graph_module, True)

    manager = PassManager([in_place_update, RecordEdgeOps()])
    with pytest.raises(Exception, match="PassManager") as info:
        edge.transform([manager])
    error = info.value.__cause__
    assert isinstance(error, PreconditionError)
    assert error.condition == "Functional" and "aten_index_put_default" in str(error)
    assert "RecordEdgeOps" in str(error)
