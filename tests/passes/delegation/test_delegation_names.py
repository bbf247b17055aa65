"""Delegation of programs the functionalization passes accept (issue 10): a user input
called like a Python builtin, and programs exported with preserve_module_call_signature.
Each lowered program runs 4 calls like eager (outputs and state, delegates' included),
and buffer ownership then moves into the delegates."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pass_manager import PassManager, assert_same_behaviour
from passes import ConsumeBufferMutationsInDelegate, InplaceToFunctional, MarkMutableBuffers
from passes.delegation import (
    AllNodePartitioner,
    OpSupportPartitioner,
    delegates,
    program_state,
    to_delegate,
)

aten = torch.ops.aten
PARTITIONERS = {
    "all": AllNodePartitioner,
    "cache_updates": lambda: OpSupportPartitioner(
        [aten.add.Tensor, aten._native_batch_norm_legit_functional.default, aten.mul.Tensor]),
}


def _functional(model, calls, **export_kwargs):
    ep = torch.export.export(copy.deepcopy(model), copy.deepcopy(calls[0]), **export_kwargs)
    # deep-copying renames a placeholder called ``input`` to ``input_1`` (torch keeps the
    # signature's name): the passes and to_delegate pair placeholders with specs by position
    ep = copy.deepcopy(ep)
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program


class InputNamedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, input):
        self.seen.add_(input.mean((0, 2, 3)))
        input.mul_(2)
        return self.bn(input)


def _calls(*shape):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=gen),) for _ in range(4)]


@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_user_input_named_input(partitioner):
    model, calls = InputNamedInput().train(), _calls(2, 3, 4, 4)
    program = _functional(model, calls)
    assert sorted(program.graph_signature.buffers_to_mutate.values()) == [
        "bn.num_batches_tracked", "bn.running_mean", "bn.running_var", "seen"]
    # the signature names the input as the graph does
    assert list(program.graph_signature.user_inputs_to_mutate.values()) == list(
        program.graph_signature.user_inputs)
    program.validate()
    assert_same_behaviour(model, program, calls)
    lowered = to_delegate(program, PARTITIONERS[partitioner]())
    assert delegates(lowered)
    assert_same_behaviour(model, lowered, calls, state=program_state)
    consumed = PassManager([ConsumeBufferMutationsInDelegate()]).run(lowered).program
    assert_same_behaviour(model, consumed, calls, state=program_state)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x) * self.calls


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.register_buffer("acc", torch.zeros(3))

    def forward(self, x):
        self.acc.add_(x)
        return self.inner(self.acc) + self.acc


@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_preserved_module_call_signature(partitioner):
    model, calls = Outer(), _calls(3)
    program = _functional(model, calls, preserve_module_call_signature=("inner",))
    program.validate()  # the signature names the functional values, not the in-place ones
    names = {n.name for n in program.graph.nodes}
    entry = next(e for e in program.module_call_graph if e.fqn == "inner")
    assert {a.name for a in entry.signature.inputs + entry.signature.outputs} <= names
    lowered = to_delegate(program, PARTITIONERS[partitioner]())
    lowered.validate()
    assert_same_behaviour(model, lowered, calls, state=program_state)
    names = {n.name for n in lowered.graph.nodes}
    entry = next(e for e in lowered.module_call_graph if e.fqn == "inner")
    assert {a.name for a in entry.signature.inputs + entry.signature.outputs} <= names
