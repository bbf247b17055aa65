"""The Functional condition: every node that writes an argument is reported, in graph order,
whatever kind of node writes (an ATen op, a method call, a higher-order op's subgraph);
the trailing write-backs of the GraphModule form are the only writes allowed. The
MutableBuffersMarked condition speaks of buffers as buffers, in every form a user holds."""

import torch
from torch import nn

from pass_manager import PassManager, assert_same_behaviour
from passes import InplaceToFunctional, MarkMutableBuffers, conditions

aten = torch.ops.aten


class TwoWrites(nn.Module):
    """A counter and a cache, written by two different in-place ops."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, pos: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.cache.index_copy_(0, pos, value)
        return self.cache.sum(0) * self.count


def _calls():
    return [(torch.tensor([p]), torch.full((1, 3), float(p + 1))) for p in (0, 2, 1)]


def _exported():
    with torch.no_grad():
        return torch.export.export(TwoWrites(), _calls()[0], strict=True)


def test_in_place_ops_are_reported_in_graph_order():
    violations = conditions.Functional.check(_exported())
    assert [v.split(":")[0] for v in violations] == ["add_", "index_copy_"]
    assert all("writes its argument" in v for v in violations)


def test_trailing_write_backs_are_allowed_and_a_write_before_them_is_not():
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        _exported().module()).program
    assert_same_behaviour(TwoWrites(), functional, _calls())
    write_backs = [n for n in functional.graph.nodes if n.target is aten.copy_.default]
    assert len(write_backs) == 2  # count and cache, right before the output
    assert conditions.Functional.check(functional) == []
    # The same write one node earlier, before a node that is not a write-back, is an
    # in-place write; the write-back still right before the output is not.
    moved = write_backs[0]
    moved.prev.prepend(moved)
    violations = conditions.Functional.check(functional)
    assert len(violations) == 1 and violations[0].startswith(f"{moved.name}:")


def test_in_place_method_calls_are_reported():
    class MethodWrite(nn.Module):
        def forward(self, x):
            y = x * 2
            y.add_(1)
            return y.relu_()

    traced = torch.fx.symbolic_trace(MethodWrite())
    assert conditions.Functional.check(traced) == [
        "add_: in-place method 'add_'", "relu_: in-place method 'relu_'"]


def test_a_higher_order_op_whose_subgraph_writes_is_reported():
    body_graph = torch.fx.Graph()
    x = body_graph.placeholder("x")
    body_graph.output((body_graph.call_function(aten.add_.Tensor, (x, 1)),))
    root = nn.Module()
    root.body = torch.fx.GraphModule(nn.Module(), body_graph)
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    doubled = graph.call_function(aten.mul.Tensor, (a, 2))
    body = graph.get_attr("body")
    region = graph.call_function(torch.ops.higher_order.wrap_with_set_grad_enabled,
                                 (False, body, doubled))
    graph.output(graph.call_function(aten.sum.default, (doubled,)))
    gm = torch.fx.GraphModule(root, graph)
    (violation,) = conditions.Functional.check(gm)
    assert violation.startswith(f"{region.name}:") and doubled.name in violation
    assert "inside its subgraph" in violation


def test_unmarked_state_is_named_by_its_kind_in_each_form():
    ep = _exported()
    by_form = {"exported": ep, "ep.module()": ep.module()}
    for form, program in by_form.items():
        violations = conditions.MutableBuffersMarked.check(program)
        assert [v.split(" is written")[0].split(": ", 1)[1] for v in violations] == [
            "buffer 'count'", "buffer 'cache'"], form


def test_the_lifted_graph_of_an_exported_program_is_said_to_have_no_buffers():
    """``ep.graph_module`` holds the caches as inputs: the condition says so and what to
    pass instead, and so does MarkMutableBuffers, which marks them as the inputs they are."""
    ep = _exported()
    violations = conditions.MutableBuffersMarked.check(ep.graph_module)
    assert len(violations) == 2
    assert violations[1].startswith(
        "b_cache: input 'b_cache', named like a buffer torch.export lifted to an input, is "
        "written by index_copy_ but not marked")
    assert all(v.endswith(
        "the GraphModule of a lifted ExportedProgram (ep.graph_module) has no buffers, only "
        "inputs; pass the ExportedProgram, or ep.module(), for its buffers to be buffers")
        for v in violations)
    result = PassManager([MarkMutableBuffers()]).run(ep.graph_module)
    notes = result.report.records[0].notes
    assert len(notes) == 2 and all("named like a buffer torch.export lifted" in n for n in notes)
    # The inputs of ep.module() are the user's, however named: inputs and nothing more.
    module = torch.export.export(WritesInput(), (torch.ones(3),)).module()
    (violation,) = conditions.MutableBuffersMarked.check(module)
    assert violation == ("b_x: user input 'b_x' is written by add_ but not marked "
                         "(meta['mutable_user_input'])")
    assert not PassManager([MarkMutableBuffers()]).run(module).report.records[0].notes


class WritesInput(nn.Module):
    def forward(self, b_x: torch.Tensor) -> torch.Tensor:
        return b_x.add_(1)
