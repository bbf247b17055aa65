"""Torch pass-infra interop both ways: our passes and manager in torch's pass manager, torch's
passes and plain functions in ours."""

import copy

import torch
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult
from torch.fx.passes.infra.pass_manager import PassManager as TorchPassManager

from pass_manager import PassManager

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
