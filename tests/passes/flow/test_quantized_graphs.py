"""The output grid the main job's "within N grid steps" checks allow: the grid of the outputs
the caller gets, not of a cache a lifted program returns as a mutation output."""

from __future__ import annotations

import pytest
import torch

from pass_manager import PassManager, run_program
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch.runtime import output_grid as runtime_output_grid
from passes.executorch.runtime import within_grid_steps
from passes.flow.examples import AnnotateEveryOpQuantizer, xnnpack_quantizer
from passes.flow.factory import export_program
from passes.flow.quantized_graphs import output_grid
from passes.quantization import quantize_program


class _LoudCache(torch.nn.Module):
    """Caches ten times what it returns: the cache's grid is ten times the output's."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x * 10)
        return self.proj(x)


def _quantized(quantizer):
    torch.manual_seed(0)
    steps = [((torch.randn(1, 4), torch.tensor([i])), {}) for i in range(3)]
    exported = export_program(_LoudCache(), *steps[0]).program
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(exported).program
    return quantize_program(functional, quantizer(), steps), steps


def _user_output_scale(program) -> float:
    """The scale of the dequantize the program returns to its caller (its last output)."""
    returned = program.graph.output_node().args[0][-1]
    assert "dequantize" in str(returned.target)
    return float(returned.args[1])


def _cache_scale(program) -> float:
    """The largest scale of a dequantize the cache's new value is computed from."""
    return max(float(node.args[1]) for node in program.graph.nodes
               if "dequantize" in str(node.target) and node.args[1] != 0
               and any("index_copy" in str(user.target) for user in node.users))


@pytest.mark.parametrize("quantizer", [xnnpack_quantizer, AnnotateEveryOpQuantizer],
                         ids=["xnnpack", "every-op"])
def test_the_flows_output_grid_is_the_user_outputs_not_the_caches(quantizer):
    """The several-method job read it on the lifted graph module, whose outputs include the
    caches: a 10x looser bound (0.146 for an output grid of 0.0146)."""
    program, steps = _quantized(quantizer)
    grid = output_grid(program)
    assert grid == output_grid(program.module())  # the unlifted module returns no cache
    assert grid < _cache_scale(program) / 5
    assert output_grid(program.graph_module) >= _cache_scale(program)  # a graph: every output
    run_program(program, steps)  # still a program that runs


def test_the_runtime_output_grid_is_the_user_outputs_not_the_caches():
    """With a quantizer annotating the cache write, a lifted program returns the cache's
    dequantize as a mutation output: the runtime check allowed one step of the cache's grid
    (0.146) for an output on a grid of 0.0115, and passed a runtime off by four output steps."""
    program, _ = _quantized(AnnotateEveryOpQuantizer)
    grid = runtime_output_grid(program)
    assert grid == pytest.approx(_user_output_scale(program))
    off_by_four_steps = 4 * grid
    assert not within_grid_steps(off_by_four_steps, grid)
    loose = max(float(node.args[1]) for node in program.graph.output_node().all_input_nodes
                if "dequantize" in str(node.target))
    assert within_grid_steps(off_by_four_steps, loose)  # what the check allowed on main


class _InputLouderThanOutput(torch.nn.Module):
    """Its linear shrinks what it reads: the linear's input grid is several times the
    output's. ``reshaped``: the output is a view of the linear's."""

    def __init__(self, reshaped: bool = False):
        super().__init__()
        self.reshaped = reshaped
        self.proj = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight /= 8
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.total.add_(x.sum(0))
        y = self.proj(x)
        return y.reshape(2, 2) if self.reshaped else y


@pytest.mark.parametrize("reshaped", [False, True], ids=["dequantized", "a view of it"])
@pytest.mark.parametrize("quantizer", [xnnpack_quantizer, AnnotateEveryOpQuantizer],
                         ids=["xnnpack", "every-op"])
def test_the_runtime_output_grid_is_the_outputs_own_through_a_view(quantizer, reshaped):
    """The runtime check (one program against itself) reads the grid of the output's own
    dequantize: a reshape of it read as no grid at all, and a quantized program was held to
    float32's 1e-5 on ExecuTorch's runtime."""
    torch.manual_seed(0)
    steps = [((torch.randn(1, 4) * 8,), {}) for _ in range(3)]
    exported = export_program(_InputLouderThanOutput(reshaped), *steps[0]).program
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(exported).program
    program = quantize_program(functional, quantizer(), steps)
    returned = program.graph.output_node().args[0][-1]
    while "dequantize" not in str(returned.target):  # the reshape, when not quantized
        returned = returned.args[0]
    assert runtime_output_grid(program) == float(returned.args[1]) > 0
    run_program(program, steps)


def test_a_reshape_and_the_view_it_decomposes_to_are_one_quantized_op():
    """torchao's recipe runs run_decompositions (reshape -> view): the check said "the two
    flows quantized different graphs (quantized only with the passes: aten.reshape x1; only
    without: aten.view x1)" of one graph."""
    from collections import Counter

    from passes.flow.quantized_graphs import describe_op_difference, quantized_ops

    torch.manual_seed(0)
    steps = [((torch.randn(1, 4),), {}) for _ in range(2)]
    exported = export_program(_InputLouderThanOutput(reshaped=True), *steps[0]).program
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(exported).program
    decomposed = functional.run_decompositions({})
    counts = [quantized_ops(quantize_program(p, AnnotateEveryOpQuantizer(), steps).module())
              for p in (functional, decomposed)]
    assert counts[0]["aten.view"] == 1 and isinstance(counts[0], Counter)
    assert describe_op_difference(*counts) == ""
