"""State written whole from another dtype or shape, after torch's decomposition dropped the
conversion (a user's ``ep.run_decompositions()``, or ``to_edge``'s): the runtime computed
silently wrong (float32 ``2.5`` where eager returns int32 ``2``; a broadcast row returned
where eager returns the matrix). The helpers and ``BufferOwningPartitioner`` refuse such a
program, typed, naming the state and the node; a ``copy_`` still converting is made
explicit by the wrapper too, so lowering by hand computes what eager does."""

from __future__ import annotations

import re

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower

from passes.executorch import (
    BufferOwningPartitioner,
    ExecuTorchInputError,
    decode_on_runtime,
    run_methods_on_runtime,
)


class ConvertingCopy(torch.nn.Module):
    """State written whole by ``copy_`` from a float value: int32 state from a value of its
    shape, or float state from a broadcast row."""

    def __init__(self, dtype: torch.dtype, broadcast: bool):
        super().__init__()
        self.broadcast = broadcast
        self.register_buffer("state", torch.zeros(2, 4, dtype=dtype))

    def forward(self, x):
        self.state.copy_(x[0] * 1.5 if self.broadcast else x * 1.5 + self.state)
        return self.state + 1


STEPS = [(torch.arange(8.0).view(2, 4) + 0.3 * i,) for i in range(3)]


def _exported(dtype: torch.dtype, broadcast: bool) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(ConvertingCopy(dtype, broadcast), STEPS[0])


@pytest.mark.parametrize("dtype, broadcast, node", [(torch.int32, False, "add"),
                                                    (torch.float32, True, "mul")],
                         ids=["int32-from-float", "broadcast-row"])
def test_a_decomposed_program_whose_write_lost_its_conversion_is_refused(dtype, broadcast,
                                                                          node):
    # Base: int32 state returned float32 [2.5, 4.0, ...] where eager returns [2, 4, ...];
    # the broadcast row came back as a [4] output where eager returns [2, 4].
    decomposed = _exported(dtype, broadcast).run_decompositions()
    with pytest.raises(ExecuTorchInputError) as caught:
        decode_on_runtime(decomposed, None, STEPS)
    error = caught.value
    assert (error.helper, error.argument) == ("decode_on_runtime", "program")
    assert f"buffer 'state' ({str(dtype)[6:]} [2, 4])" in error.reason
    assert f"node {node!r}" in error.reason and "run_decompositions" in error.reason
    assert "value.to(state.dtype).expand_as(state)" in error.reason


def test_methods_refuse_a_decomposed_method_naming_it():
    programs = {"decode": _exported(torch.int32, False).run_decompositions()}
    with pytest.raises(ExecuTorchInputError, match="buffer 'state' of method 'decode'"):
        run_methods_on_runtime(programs, [("decode", STEPS[0], {})])


def test_an_edge_program_lowered_by_hand_from_a_converting_copy_is_refused():
    # to_edge's own decomposition drops the conversion: base ran it, silently wrong.
    with torch.no_grad():
        edge = to_edge_transform_and_lower(_exported(torch.int32, False),
                                           partitioner=[XnnpackPartitioner()])
    with pytest.raises(ExecuTorchInputError, match=re.escape("buffer 'state' (int32 [2, 4]) gets")):
        decode_on_runtime(edge, None, STEPS)


def test_the_wrapper_refuses_a_decomposed_program_and_converts_a_copy_by_hand():
    decomposed = _exported(torch.int32, False).run_decompositions()
    with pytest.raises(ExecuTorchInputError, match="BufferOwningPartitioner: program: buffer"):
        to_edge_transform_and_lower(decomposed, partitioner=[
            BufferOwningPartitioner(XnnpackPartitioner(), own_buffers=False)])
    # As exported, the wrapper makes the copy_'s conversion explicit before to_edge (base:
    # float32 outputs, 2.5 where eager returns 2); the caller's program is not edited.
    exported = _exported(torch.int32, False)
    before = exported.graph_module.code
    with torch.no_grad():
        edge = to_edge_transform_and_lower(exported, partitioner=[
            BufferOwningPartitioner(XnnpackPartitioner(), own_buffers=False)])
    assert exported.graph_module.code == before
    eager = ConvertingCopy(torch.int32, False)
    decoded = decode_on_runtime(edge, None, STEPS)
    for step, out in zip(STEPS, decoded.outputs, strict=True):
        expected = eager(*step)
        assert out[0].dtype == torch.int32 and torch.equal(out[0], expected)



class WrittenInABranch(torch.nn.Module):
    """State written inside torch.cond's branches, not by the program around them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(3))

    def forward(self, x):
        def grow(x):
            self.acc.add_(x)
            return x * 2

        def shrink(x):
            self.acc.sub_(x)
            return x * 3

        return torch.cond(x.sum() > 0, grow, shrink, (x,)), self.acc + 0


def test_state_written_in_a_cond_branch_is_refused_before_lowering():
    """On 91ee2ec ExecuTorch's to_edge failed on it inside the helpers, untyped
    (SpecViolationError: operator 'aten.copy_.default' is not functional)."""
    with torch.no_grad():
        program = torch.export.export(WrittenInABranch(), (torch.ones(3),))
    steps = [(torch.ones(3),)]
    with pytest.raises(ExecuTorchInputError, match=r"writes b_acc.*torch\.where") as info:
        decode_on_runtime(program, None, steps)
    assert info.value.argument == "program" and info.value.node == "cond"
    with pytest.raises(ExecuTorchInputError, match="of method 'step'"):
        run_methods_on_runtime({"step": program}, [("step", steps[0], {})])
