"""Torch pass-infra interop both ways: our passes and manager in torch's pass manager, torch's
passes and plain functions in ours."""

import copy

import pytest
import torch
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult
from torch.fx.passes.infra.pass_manager import PassManager as TorchPassManager

from pass_manager import PassFailedError, PassManager, PassResult, first_difference, run_program
from tests.models.accumulators import Accumulate

from .conftest import ReluToAbs, targets


class TorchStyleNegToAbs(PassBase):
    def call(self, gm):
        changed = False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.relu:
                node.target = torch.abs
                changed = True
        gm.recompile()
        return TorchPassResult(gm, changed)


def test_our_pass_runs_inside_torchs_pass_manager(traced):
    result = TorchPassManager([ReluToAbs()])(traced)
    assert isinstance(result, TorchPassResult) and result.modified
    assert "abs" in result.graph_module.code


def test_our_manager_is_a_torch_style_callable(traced):
    fresh = copy.deepcopy(traced)
    result = PassManager([ReluToAbs()])(traced)
    assert isinstance(result, TorchPassResult) and result.modified
    assert not targets(result.graph_module, "relu")
    assert TorchPassManager([PassManager([ReluToAbs()])])(fresh).modified


def test_torch_pass_base_and_plain_functions_run_in_our_pipeline(traced, exported):
    result = PassManager([TorchStyleNegToAbs()]).run(traced)
    assert result.modified and result.report.records[0].name == "TorchStyleNegToAbs"

    def no_op(gm):
        return TorchPassResult(gm, False)

    result = PassManager([no_op]).run(exported)
    assert isinstance(result.program, torch.export.ExportedProgram) and not result.modified


class _AccumulateAbs(Accumulate):
    """What Accumulate computes with its relu replaced by abs (the eager reference)."""

    def forward(self, x):
        self.acc.add_(x)
        return torch.abs(self.linear(self.acc)) * 2 + 1


class TorchStyleCopyReluToAbs(PassBase):
    """Returns a rewritten copy of the graph module and wrongly claims "unmodified"."""

    def call(self, gm):
        new = copy.deepcopy(gm)
        for node in new.graph.nodes:
            if node.target is torch.ops.aten.relu.default:
                node.target = torch.ops.aten.abs.default
        new.recompile()
        return TorchPassResult(new, False)


def test_a_torch_pass_returning_a_new_graph_for_an_exported_program_has_its_claim_checked(
        exported):
    calls = [(torch.ones(4),), (torch.full((4,), -3.0),), (torch.arange(4.0),)]
    result = PassManager([TorchStyleCopyReluToAbs()]).run(exported)
    assert isinstance(result.program, torch.export.ExportedProgram) and result.modified
    assert targets(result.program, "abs") and not targets(result.program, "relu")
    assert "reported 'unmodified' but changed the program" in result.report.warnings[0]
    reference = _AccumulateAbs()
    reference.load_state_dict(Accumulate().state_dict())
    assert first_difference(run_program(reference, calls), run_program(result.program, calls)) \
        is None
    with pytest.raises(PassFailedError, match="reported 'unmodified'"):
        PassManager([TorchStyleCopyReluToAbs()], strict=True).run(exported)


def test_a_plain_function_returns_our_pass_result_with_the_graph_module_it_was_given(exported):
    calls = [(torch.ones(4),), (torch.full((4,), -3.0),), (torch.arange(4.0),)]

    def relu_to_abs(gm):  # given an ExportedProgram, a plain function gets its graph module
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default):
            node.target = torch.ops.aten.abs.default
        return PassResult(gm, True, statistics={"relu rewritten": 1})

    result = PassManager([relu_to_abs]).run(exported)
    assert result.program is exported and result.report.records[0].modified
    assert result.report.records[0].statistics == {"relu rewritten": 1}
    reference = _AccumulateAbs()
    reference.load_state_dict(Accumulate().state_dict())
    assert first_difference(run_program(reference, calls), run_program(exported, calls)) is None
