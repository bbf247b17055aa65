"""Small real programs for the pass-manager tests (tests/models/accumulators.py's
``Accumulate``, exported and symbolically traced), and the conditions and pass they use."""

import pytest
import torch

from pass_manager import Condition, Pass, PassResult, graph_of
from tests.models.accumulators import Accumulate


@pytest.fixture
def exported():
    return torch.export.export(Accumulate(), (torch.ones(4),))


@pytest.fixture
def traced():
    return torch.fx.symbolic_trace(Accumulate())


def targets(program, name):
    return [n for n in graph_of(program).nodes if n.op == "call_function" and name in str(n.target)]


NoRelu = Condition("NoRelu", lambda p: [n.name for n in targets(p, "relu")], doc="no relu node")
HasMul = Condition(
    "HasMul",
    lambda p: [] if targets(p, "mul") else ["no mul node in the graph"],
    doc="a mul exists",
)


class ReluToAbs(Pass):
    """Replaces relu with abs (a real rewrite used to exercise the manager)."""

    provides = frozenset({NoRelu})

    def call(self, program):
        changed = False
        for node in graph_of(program).nodes:
            if node.op == "call_function" and node.target in (
                torch.relu,
                torch.ops.aten.relu.default,
            ):
                node.target = torch.abs if node.target is torch.relu else torch.ops.aten.abs.default
                changed = True
        return PassResult(program, changed)
