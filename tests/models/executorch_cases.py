"""The buffer-ownership cases where ExecuTorch 1.5.1 alone fails, as tiny models.

Shared by the tests and ``benchmarks/bench_executorch.py``: each case is a stateful
model, its decode inputs and an ExecuTorch partitioner; ``whole_buffer_copies`` counts
what a lowered program copies of its buffers per call. ``OpPartitioner`` tags ops by
name and then calls ExecuTorch's ``tag_constant_data`` / ``tag_mutated_buffer``, as a
backend that owns state does; its delegates use ExecuTorch's demo backend, whose
delegates run their sub-program in Python (``lowered.exported_program().module()``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import executorch.exir.backend.test.demo_backend  # noqa: F401  (registers DemoBackend)
import torch
from executorch.exir.backend.canonical_partitioners.all_node_partitioner import (
    AllNodePartitioner,
)
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
from torch import nn

from passes.flow.examples import decode_inputs, kv_decoder

__all__ = [
    "CASES",
    "DEMO_BACKEND",
    "Case",
    "OpPartitioner",
    "ReturnsBuffer",
    "SharedReader",
    "TwoWriters",
    "everything",
    "whole_buffer_copies",
]

DEMO_BACKEND = "DemoBackend"
CALLS = 4


class OpPartitioner(Partitioner):
    """Tags ops by ATen name (``{"index_put": "update"}``), then ExecuTorch's buffer tagging."""

    def __init__(self, tags: dict[str, str]):
        super().__init__()
        self.tags = tags
        self.delegation_spec = DelegationSpec(DEMO_BACKEND, [])

    def __repr__(self) -> str:
        return f"OpPartitioner({self.tags})"

    def partition(self, exported_program) -> PartitionResult:
        partition_tags = {}
        for node in exported_program.graph.nodes:
            if node.op != "call_function":
                continue
            name = getattr(getattr(node.target, "_op", node.target), "__name__", "")
            tag = self.tags.get(name.split(".")[0])
            if tag is not None:
                node.meta["delegation_tag"] = tag
                partition_tags[tag] = self.delegation_spec
        tag_constant_data(exported_program)
        tag_mutated_buffer(exported_program)
        return PartitionResult(exported_program, partition_tags)


def everything() -> Partitioner:
    """ExecuTorch's AllNodePartitioner on the demo backend: one delegate owns all state."""
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


def _decoder() -> tuple[nn.Module, list[tuple]]:
    model, _ = kv_decoder(1)
    return model, decode_inputs(model.cfg, CALLS, start=2)


@dataclass(frozen=True)
class Case:
    """A model with state, its inputs (one tuple per call) and the partitioner lowering it."""

    description: str
    make: Callable[[], tuple[nn.Module, list[tuple]]]
    partitioner: Callable[[], Partitioner]
    alone: str  # what ExecuTorch 1.5.1 alone does: an error type, "wrong" or "correct"


CASES = {
    "user_output": Case(
        "a mutated buffer also returned as a user output (everything delegated)",
        lambda: (ReturnsBuffer(), vector_inputs()), everything, "AssertionError"),
    "cache_update_only": Case(
        "only the KV-cache update delegated, attention outside",
        _decoder, lambda: OpPartitioner({"index_put": "update"}), "RuntimeError"),
    "two_partitions_mutate": Case(
        "one buffer mutated in two partitions",
        lambda: (TwoWriters(), vector_inputs()),
        lambda: OpPartitioner({"add": "a", "mul": "b"}), "SpecViolationError"),
    "read_in_two_mutated_in_one": Case(
        "a buffer read in two partitions, mutated in one",
        lambda: (SharedReader(), vector_inputs()),
        lambda: OpPartitioner({"mul": "a", "add": "b"}), "wrong"),
    "whole_kv_cache": Case(
        "the delegate owns the whole KV cache (everything delegated)",
        _decoder, everything, "correct"),
}


# Ops whose result is their input's value, copied whole: the clones that carry a new buffer
# value out of a delegate, the top level's write-backs (``copy_``), dtype/layout copies.
VALUE_COPY_OPS = frozenset(
    {"clone", "_clone_dim_order", "copy", "copy_", "_to_copy", "_to_dim_order_copy",
     "alias_copy"}
)


def _copies(program, shapes: set, where: str, found: Counter) -> None:
    for node in program.graph.nodes:
        if node.op == "get_attr" and node.target.startswith("lowered_module"):
            lowered = getattr(program.graph_module, node.target)
            _copies(lowered.original_module, shapes, "delegate", found)
        name = str(getattr(node.target, "__name__", node.target))
        value = node.meta.get("val")
        if (node.op == "call_function" and VALUE_COPY_OPS.intersection(name.split("."))
                and isinstance(value, torch.Tensor)
                and (tuple(value.shape), value.dtype) in shapes):
            found[where] += 1


def whole_buffer_copies(executorch_program, model: nn.Module | torch.export.ExportedProgram
                        ) -> Counter:
    """Where a ``to_executorch()`` program copies a whole buffer of ``model`` on each call.

    Counts the value copies (``VALUE_COPY_OPS``) whose result has the shape and dtype of one
    of ``model``'s buffers, by place: ``"top level"`` (its write-backs included) and
    ``"delegate"`` (a delegate's lowered sub-program, which the demo backend runs; a
    delegate writing back the buffer it owns is its backend's business, in place on a
    stateful one, and not counted). Each runs once per call: these programs have no loops.
    """
    shapes = {(tuple(b.shape), b.dtype) for b in model.buffers()}
    found: Counter = Counter()
    _copies(executorch_program.exported_program(), shapes, "top level", found)
    return found
