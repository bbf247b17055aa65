"""Running programs for several calls: keyword inputs, programs torch cannot deep-copy, errors."""

import copy
import math

import pytest
import torch

from pass_manager import (
    PassManager,
    PassResult,
    SemanticsError,
    SemanticValidation,
    function_pass,
    graph_of,
)
from pass_manager.validation import (
    Trace,
    as_call,
    assert_same_behaviour,
    buffer_errors,
    call_inputs,
    copy_program,
    first_difference,
    output_errors,
    run_program,
)
from tests.models.input_state import WritesItsInput


class KeywordDecoder(torch.nn.Module):
    """Takes keyword inputs the way Hugging Face's exportable modules do; writes a cache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 8, 4))
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, input_ids=None, cache_position=None):
        value = self.proj(input_ids)
        self.cache.index_copy_(1, cache_position, value)
        return self.cache.sum(dim=1)


def keyword_steps(n):
    generator = torch.Generator().manual_seed(0)
    return [
        (
            (),
            {
                "input_ids": torch.randn(1, 1, 4, generator=generator),
                "cache_position": torch.tensor([i]),
            },
        )
        for i in range(n)
    ]


def test_one_call_is_a_tuple_a_pair_or_a_mapping():
    x = torch.ones(2)
    assert as_call((x,)) == ((x,), {})
    assert as_call(((x,), {"y": x})) == ((x,), {"y": x})
    assert as_call({"y": x}) == ((), {"y": x})
    assert as_call(x) == ((x,), {})
    assert as_call(as_call((x, x))) == ((x, x), {})  # normalizing twice changes nothing
    assert call_inputs(((x,), {"y": x}), 3) == [((x,), {"y": x})] * 3
    assert call_inputs([(x,), {"y": x}]) == [((x,), {}), ((), {"y": x})]
    with pytest.raises(ValueError, match="asked for 3 calls"):
        call_inputs([(x,)], 3)


def test_keyword_inputs_run_on_every_program_form():
    model = KeywordDecoder()
    steps = keyword_steps(4)
    args, kwargs = steps[0]
    ep = torch.export.export(copy.deepcopy(model), args, kwargs)
    eager = run_program(model, steps)
    assert len(eager.outputs) == 4 and not torch.equal(eager.buffers[-1]["cache"], model.cache)
    assert_same_behaviour(model, ep, steps)
    assert_same_behaviour(model, ep.module(), steps)
    assert first_difference(eager, run_program(ep, steps)) is None


def test_a_keyword_input_difference_is_named():
    model = KeywordDecoder()
    steps = keyword_steps(3)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.proj.bias.add_(1.0)
    with pytest.raises(AssertionError, match="call 0: output 0"):
        assert_same_behaviour(model, other, steps)


def test_manager_validates_with_keyword_inputs():
    model = KeywordDecoder()
    steps = keyword_steps(3)
    ep = torch.export.export(copy.deepcopy(model), *steps[0])

    @function_pass()
    def drop_cache_write(program):
        graph = graph_of(program)
        for node in graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.index_copy_.default:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        return PassResult(program, True)

    with pytest.raises(SemanticsError, match="call 0"):
        PassManager([drop_cache_write], instruments=[SemanticValidation(steps)]).run(ep)


class HoldsComputedTensor(torch.nn.Module):
    """Holds a tensor computed from a parameter outside any module attribute torch tracks.

    Exported outside ``torch.no_grad()`` (non-strict), it becomes a lifted constant with a
    ``grad_fn``: a tensor ``copy.deepcopy`` refuses.
    """

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("acc", torch.zeros(3))
        self.holder = [self.weight * 2]

    def forward(self, x):
        self.acc.add_(x)
        return x + self.holder[0] + self.acc


def test_programs_holding_non_leaf_constants_copy_and_run():
    model = HoldsComputedTensor()
    ep = torch.export.export(model, (torch.ones(3),), strict=False)
    assert any(not t.is_leaf for t in ep.constants.values())
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(ep)
    for program in (ep, ep.module()):
        copied = copy_program(program)
        assert isinstance(copied, (torch.export.ExportedProgram, torch.fx.GraphModule))
    inputs = [(torch.full((3,), float(i)),) for i in range(3)]
    assert_same_behaviour(HoldsComputedTensor(), ep, inputs)


def test_error_sizes_per_call():
    model = KeywordDecoder()
    steps = keyword_steps(3)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.proj.bias.add_(0.5)
    expected, actual = run_program(model, steps), run_program(other, steps)
    assert output_errors(expected, expected) == [0.0, 0.0, 0.0]
    outputs = output_errors(expected, actual)
    # Each call writes one more shifted row into the cache: the summed output drifts by 0.5
    # per written row.
    assert outputs == pytest.approx([0.5, 1.0, 1.5])
    per_call = buffer_errors(expected, actual)
    assert [round(step["cache"], 6) for step in per_call] == [0.5, 0.5, 0.5]


def test_state_carried_in_an_input_carries_across_calls_and_the_caller_keeps_its_tensor():
    """Input-carried state (Hugging Face's exporter passes its caches so): the calls share
    one copy of the tensor they all pass, as eager does, and the caller's stays as it was."""
    cache = torch.zeros(3)
    expected = [[2.0] * 3, [4.0] * 3, [6.0] * 3]
    trace = run_program(WritesItsInput(), [((torch.ones(3), cache), {})] * 3)
    assert [out[0].tolist() for out in trace.outputs] == expected
    assert cache.tolist() == [0.0] * 3


def test_a_difference_that_is_not_finite_is_infinite_not_the_largest_float():
    """nan_to_num(inf) left +inf to its default, the largest float: a quantized output of inf
    was reported as 'off by 1.8e+308', a 309-digit number in the main job's decode table."""
    finite = Trace(outputs=[[torch.ones(2)]] * 2, buffers=[{"b": torch.ones(2)}] * 2)
    broken = Trace(outputs=[[torch.tensor([1.0, float("inf")])], [torch.tensor([float("nan"),
                                                                               1.0])]],
                   buffers=[{"b": torch.tensor([float("inf"), 1.0])}] * 2)
    assert output_errors(finite, broken) == [math.inf, math.inf]
    assert buffer_errors(finite, broken) == [{"b": math.inf}] * 2


def test_an_integer_output_that_differs_is_an_error_not_left_out():
    """Only floating-point outputs were compared: a decoder returning token ids or the
    position it wrote at was 'off by 0' (the main job's quantized decode) whatever it gave."""
    expected = Trace(outputs=[[torch.ones(2), torch.tensor(1), torch.tensor([True])]])
    actual = Trace(outputs=[[torch.ones(2), torch.tensor(4), torch.tensor([False])]])
    assert output_errors(expected, actual) == [3.0]
    assert output_errors(expected, expected) == [0.0]
