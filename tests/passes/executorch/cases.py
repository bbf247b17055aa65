"""Tiny stateful models and ExecuTorch partitioners the ExecuTorch tests share."""

from __future__ import annotations

# Registers ExecuTorch's demo backend: its delegates run their sub-program in Python.
import executorch.exir.backend.test.demo_backend  # noqa: F401
import torch
from executorch.exir.backend.canonical_partitioners.all_node_partitioner import (
    AllNodePartitioner,
)
from executorch.exir.backend.partitioner import (
    DelegationSpec,
    Partitioner,
    PartitionResult,
)
from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
from torch import nn

DEMO_BACKEND = "DemoBackend"
CALLS = 4


class OpPartitioner(Partitioner):
    """Tags ops by their ATen name (``{"index_put": "update"}``) the way a backend that
    owns state does: then ``tag_constant_data`` and ExecuTorch's ``tag_mutated_buffer``."""

    def __init__(self, tags: dict[str, str]):
        super().__init__()
        self.tags = tags
        self.spec_ = DelegationSpec(DEMO_BACKEND, [])

    def partition(self, exported_program):
        partition_tags = {}
        for node in exported_program.graph.nodes:
            if node.op != "call_function":
                continue
            name = getattr(getattr(node.target, "_op", node.target), "__name__", "")
            tag = self.tags.get(name.split(".")[0])
            if tag is not None:
                node.meta["delegation_tag"] = tag
                partition_tags[tag] = self.spec_
        tag_constant_data(exported_program)
        tag_mutated_buffer(exported_program)
        return PartitionResult(exported_program, partition_tags)


def everything() -> Partitioner:
    return AllNodePartitioner(DEMO_BACKEND, [])


class ReturnsBuffer(nn.Module):
    """The mutated buffer is also a user output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        self.acc.add_(x)
        return self.acc


class TwoWriters(nn.Module):
    """One buffer updated by two ops (two partitions when each op is its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        self.acc.add_(x)
        self.acc.mul_(2)
        return self.acc.sin()


class SharedReader(nn.Module):
    """The old value is read by one op, the buffer updated by another."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        seen = self.acc * 2
        self.acc.add_(x)
        return seen


def vector_inputs(seed: int = 0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, generator=generator),) for _ in range(CALLS)]
