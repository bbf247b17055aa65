"""InplaceToFunctional on Edge-dialect programs (issue 10): ExecuTorch's ``EdgeOpOverload``
is not an ``OpOverload``; its ATen op is read through ``passes._analysis.op_schema.target_of``, so
views, storage views and writes are recognised, and the rewrite emits Edge ops.

``to_edge`` functionalizes by itself, so an Edge program holding writes is made here by
calling each ATen op of an exported (non-functional) program through its Edge op. Both
forms, 4 calls, outputs and buffers compared with eager."""

from __future__ import annotations

import copy

import torch
from executorch.exir import to_edge
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from torch import nn

from pass_manager import PassManager, assert_same_behaviour, graph_of
from passes import InplaceToFunctional, MarkMutableBuffers, conditions, mutable_buffers

from ...models.overlapping import IndexPuts, IndexWrites


def _in_edge_dialect(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
            target.namespace == "aten"
        ):
            node.target = getattr(getattr(exir_ops.edge.aten, target._opname),
                                  target._overloadname)
    gm.recompile()


def _functionalized_edge_forms(factory, calls):
    """Both forms of ``factory()``'s program in Edge dialect, each with its functionalized
    copy compared with eager over 4 calls: ``[(program, result), ...]``."""
    ep = torch.export.export(factory(), calls[0])
    _in_edge_dialect(ep.graph_module)
    module = ep.module()
    _in_edge_dialect(module)
    pairs = []
    for program in (ep, module):
        result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            copy.deepcopy(program)).program
        assert not conditions.Functional.check(result)
        assert_same_behaviour(factory(), result, calls, calls=4)
        pairs.append((program, result))
    return pairs


class StridedReadsOfAWrittenRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(8.0).reshape(2, 4))

    def forward(self, x):
        row = self.b[1]
        row.add_(x)
        whole = self.b.as_strided((2, 2), (1, 1), 0)  # a storage view of the buffer
        return row.as_strided((2, 2), (1, 1), 0) * 1, whole * 1, self.b[0].t() * 1


class MetadataMutationsOfViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))

    def forward(self, x):
        row = self.b[1]
        row.unsqueeze_(0)  # an Edge unsqueeze_ of a view: a view, written back into b
        row.add_(x)
        t = x * 2
        t.as_strided_((2,), (2,))
        t.mul_(3)
        return t * 1, self.b * 1


def test_metadata_mutations_in_edge_dialect_programs_become_edge_views():
    calls = [(torch.randn(3),) for _ in range(4)]
    for _, result in _functionalized_edge_forms(MetadataMutationsOfViews, calls):
        names = {str(n.target).split(":")[0] for n in graph_of(result).nodes
                 if n.op == "call_function"}
        assert not {"<EdgeOpOverload: aten.unsqueeze_.default>",
                    "<EdgeOpOverload: aten.as_strided_.default>"} & names
        assert all(isinstance(n.target, EdgeOpOverload) for n in graph_of(result).nodes
                   if n.op == "call_function" and "unsqueeze" in str(n.target))


class StridedReadOfAWrittenBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(8.0).reshape(2, 4))

    def forward(self, x):
        self.b[1].add_(x)
        return self.b.as_strided((2, 2), (1, 1), 1) * 1


def test_writes_and_storage_views_in_edge_dialect_programs_are_functionalized():
    calls = [(torch.randn(4),) for _ in range(4)]
    pairs = _functionalized_edge_forms(StridedReadsOfAWrittenRow, calls)
    for index, (_, result) in enumerate(pairs):
        rewritten = [n.target for n in graph_of(result).nodes if n.op == "call_function"
                     and not isinstance(n.target, EdgeOpOverload)]
        # Only the GraphModule form's trailing write-back is an ATen op.
        assert [str(t) for t in rewritten if "getitem" not in str(t)] == (
            [] if index == 0 else ["aten.copy_.default"])


def test_to_edge_program_is_already_functional_and_its_state_is_found():
    # (to_edge's own functionalization gets StridedReadsOfAWrittenRow wrong: its
    # as_strided_copy of the fresh row reads that row, not the buffer's storage.)
    calls = [(torch.randn(4),) for _ in range(4)]
    edge = to_edge(torch.export.export(StridedReadOfAWrittenBuffer(), calls[0]))
    program = copy.deepcopy(edge.exported_program())
    result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
    assert set(mutable_buffers(result.program)) == {"b"}
    assert not conditions.Functional.check(result.program)
    assert_same_behaviour(StridedReadOfAWrittenBuffer(), result.program, calls, calls=4)


def test_index_writes_through_overlapping_views_are_written_back_with_edge_ops():
    # The write-back of an index-style write through a self-overlapping view scatters only
    # the positions it wrote, through a map of storage positions (an ``arange`` viewed
    # like the view): in an Edge program every op of it is an Edge op too.
    calls = [(torch.randn(8) * (i + 1) * (-1) ** i,) for i in range(4)]
    for factory in (IndexWrites, IndexPuts):
        pairs = _functionalized_edge_forms(factory, calls)
        for index, (_, result) in enumerate(pairs):
            targets = [n.target for n in graph_of(result).nodes if n.op == "call_function"]
            assert any("arange" in str(t) and isinstance(t, EdgeOpOverload) for t in targets)
            rewritten = [str(t) for t in targets if not isinstance(t, EdgeOpOverload)
                         and "getitem" not in str(t)]
            assert set(rewritten) <= ({"aten.copy_.default"} if index == 1 else set())
