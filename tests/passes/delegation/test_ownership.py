"""Buffer ownership: one analysis, the same verdicts on a tagged and on a lowered program.

``tagged_buffer_ownership`` (what ``passes.executorch.BufferOwningPartitioner`` reads,
before ExecuTorch lowers) and ``buffer_ownership`` (what
``ConsumeBufferMutationsInDelegate`` reads, after ``to_delegate``) must agree on every
buffer for every partitioning: which partition owns it, who mutates it, and why not.
"""

from __future__ import annotations

import copy

import networkx as nx
import pytest
import torch

from pass_manager import assert_same_behaviour
from passes import ConsumeBufferMutationsInDelegate
from passes.delegation import (
    DELEGATION_TAG,
    AllNodePartitioner,
    OpSupportPartitioner,
    ownership,
    program_state,
    to_delegate,
)
from passes.delegation.ownership import buffer_ownership, tagged_buffer_ownership
from passes.flow.examples import kv_decoder

aten = torch.ops.aten


def _by_op(tags):
    """Tag each op of ``tags`` (an OpOverloadPacket -> tag) with its own partition."""

    def partition(ep):
        for node in ep.graph.nodes:
            packet = getattr(node.target, "overloadpacket", None)
            if node.op == "call_function" and packet in tags:
                node.meta[DELEGATION_TAG] = tags[packet]

    return partition


PARTITIONERS = {
    "everything": AllNodePartitioner(),
    "cache_update": OpSupportPartitioner([aten.index_copy]),
    "mul": OpSupportPartitioner([aten.mul]),
    "add": OpSupportPartitioner([aten.add]),
    "add+sin": OpSupportPartitioner([aten.add, aten.sin]),
    "mul|add": _by_op({aten.mul: "reads", aten.add: "updates"}),
}


class SharedReader(torch.nn.Module):
    """One buffer read by two ops and updated by a third: partitions decide who owns it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        seen = self.acc * 2
        self.acc.add_(x)
        return seen - self.acc.sin()


def _verdict_rows(verdicts, word):
    return [
        (v.fqn, v.owner_tag, v.mutated_by, v.partitions,
         None if v.reason is None else v.reason.replace(word, "<partition>"))
        for v in verdicts
    ]


CASES = [
    ("decoder", "everything"),
    ("decoder", "cache_update"),
    ("decoder", "mul"),
    ("shared", "everything"),
    ("shared", "mul"),
    ("shared", "add"),
    ("shared", "add+sin"),
    ("shared", "mul|add"),
]


def _program(model: str):
    if model == "decoder":
        module, example = kv_decoder(2)
    else:
        module, example = SharedReader(), (torch.ones(4),)
    return torch.export.export(copy.deepcopy(module), example).run_decompositions({})


@pytest.mark.parametrize(("model", "partitioning"), CASES)
def test_tagged_and_lowered_verdicts_agree(model, partitioning):
    ep = _program(model)
    partitioner = PARTITIONERS[partitioning]
    tagged = copy.deepcopy(ep)
    partitioner(tagged)
    lowered = to_delegate(ep, partitioner)
    expected = _verdict_rows(buffer_ownership(lowered), "delegate")
    assert _verdict_rows(tagged_buffer_ownership(tagged), "partition") == expected
    owned = {row[0] for row in expected if row[1] is not None}
    assert owned == OWNED[model, partitioning]


OWNED = {
    ("decoder", "everything"): {f"layers.{i}.attn.{c}_cache" for i in range(2) for c in "kv"},
    ("decoder", "cache_update"): {f"layers.{i}.attn.{c}_cache" for i in range(2) for c in "kv"},
    ("decoder", "mul"): set(),
    ("shared", "everything"): {"acc"},
    ("shared", "mul"): set(),
    ("shared", "add"): set(),  # the mul outside reads the old value
    ("shared", "add+sin"): set(),
    ("shared", "mul|add"): set(),
}


def test_reasons_name_the_partitions():
    ep = _program("shared")
    PARTITIONERS["mul|add"](ep)
    (verdict,) = tagged_buffer_ownership(ep)
    assert verdict.owner_tag is None
    assert verdict.mutated_by == ["updates"] and verdict.partitions == ["reads", "updates"]
    assert verdict.reason == (
        "it is read outside the partition that mutates it, by partition 'reads'"
    )


class ManyBuffers(torch.nn.Module):
    """``groups`` x four buffers, one per ownership verdict: updated by one op (``own``), read
    before its update (``read``), updated by two ops (``two``), updated by an op few
    partitioners take (``sin``)."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = groups
        for i in range(groups):
            for kind in ("own", "read", "two", "sin"):
                self.register_buffer(f"{kind}{i}", torch.zeros(4))

    def forward(self, x):
        out = x
        for i in range(self.groups):
            own, read, two, sin = (getattr(self, f"{k}{i}") for k in ("own", "read", "two", "sin"))
            own.add_(out)
            seen = read * 2
            read.add_(x)
            two.mul_(2)
            two.add_(out)
            sin.sin_()
            out = out + own + seen + two + sin
        return out


def _reference_paths(ep, flow, verdicts):
    """The update paths as one graph search per buffer (networkx): what ``_update_paths``
    computes for all buffers in one walk."""
    forward, backward = nx.DiGraph(), nx.DiGraph()
    for node in ep.graph.nodes:
        forward.add_node(node)
        backward.add_node(node)
        forward.add_edges_from((node, user) for user in flow.users(node))
        backward.add_edges_from((node, source) for source in flow.inputs(node))
    return [
        nx.descendants(forward, v.placeholder)
        & (nx.descendants(backward, v.value) | {v.value})
        for v in verdicts
    ]


MANY_PARTITIONERS = {
    "everything": AllNodePartitioner(),
    "add": OpSupportPartitioner([aten.add]),
    "mul|add": _by_op({aten.mul: "reads", aten.add: "updates"}),
    "add+mul": OpSupportPartitioner([aten.add, aten.mul]),
}


@pytest.mark.parametrize("partitioning", sorted(MANY_PARTITIONERS))
def test_many_buffers_get_the_verdicts_of_one_search_per_buffer(partitioning):
    groups = 12
    ep = torch.export.export(ManyBuffers(groups), (torch.ones(4),)).run_decompositions({})
    partitioner = MANY_PARTITIONERS[partitioning]
    tagged = copy.deepcopy(ep)
    partitioner(tagged)
    lowered = to_delegate(copy.deepcopy(ep), partitioner)
    for program, flow in ((tagged, ownership._Tagged(DELEGATION_TAG)),
                          (lowered, ownership._Lowered())):
        verdicts = ownership._verdicts(program, flow)
        assert len(verdicts) == 4 * groups
        ends = [(v.placeholder, v.value) for v in verdicts]
        paths = [set(p) for p in ownership._update_paths(program.graph, flow, ends)]
        assert paths == _reference_paths(program, flow, verdicts)
    lowered_rows = _verdict_rows(buffer_ownership(lowered), "delegate")
    assert _verdict_rows(tagged_buffer_ownership(tagged), "partition") == lowered_rows
    owned = {fqn for fqn, owner, *_ in lowered_rows if owner is not None}
    expected_kinds = {"everything": ("own", "read", "two", "sin"), "add": ("own",),
                      "mul|add": ("own",), "add+mul": ("own", "read", "two")}[partitioning]
    assert owned == {f"{k}{i}" for k in expected_kinds for i in range(groups)}
    # The lowered program, with the buffers handed over, still behaves as eager does.
    consumed = ConsumeBufferMutationsInDelegate().call(copy.deepcopy(lowered)).program
    assert_same_behaviour(ManyBuffers(groups), consumed, [(torch.rand(4),) for _ in range(3)],
                          state=program_state)
