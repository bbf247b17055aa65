"""Tensor data: copied for a rollback only when a pass's effects declare ``writes_state``; an
undeclared write is a typed error that names the tensors, never a silent change."""

import dataclasses

import pytest
import torch

from pass_manager import (
    Effects,
    EffectsError,
    Pass,
    PassFailedError,
    PassManager,
    PassResult,
    graph_of,
)

from ..conftest import targets


def buffer_of(program):
    if isinstance(program, torch.export.ExportedProgram):
        return program.state_dict["acc"]
    return program.acc


@dataclasses.dataclass(frozen=True, repr=False)
class ResetAndRewrite(Pass):
    """Zeroes the accumulator, rewrites relu to abs, then optionally fails."""

    fail: bool = False
    swap: bool = False  # ``acc.data = zeros``: no version bump
    through_data: bool = False  # ``acc.data.zero_()``: bumps a version counter of its own

    def call(self, program):
        buffer = buffer_of(program)
        with torch.no_grad():
            if self.swap:
                buffer.data = torch.zeros_like(buffer)
            elif self.through_data:
                buffer.data.zero_()
            else:
                buffer.zero_()
        for node in targets(program, "relu"):
            node.target = torch.ops.aten.abs.default if "aten" in str(node.target) else torch.abs
        if self.fail:
            raise RuntimeError("fails after writing the buffer")
        return PassResult(program, True)


class DeclaredReset(ResetAndRewrite):
    effects = Effects(writes_state=True)


@pytest.mark.parametrize("swap", [False, True], ids=["zero_", "data ="])
@pytest.mark.parametrize("form", ["exported", "traced"])
def test_undeclared_state_write_is_a_typed_error_naming_the_tensor(form, swap, request):
    """``acc.data = zeros`` swaps the data under the same tensor with no version bump: the
    run succeeded, the pass measured as unmodified, the buffer zeroed."""
    program = request.getfixturevalue(form)
    with torch.no_grad():
        buffer_of(program).fill_(3.0)
    code = graph_of(program).python_code("self").src
    with pytest.raises(EffectsError) as info:
        PassManager([ResetAndRewrite(swap=swap)]).run(program)
    error = info.value
    assert isinstance(error, PassFailedError) and error.pass_name == "ResetAndRewrite"
    assert error.kind == "writes_state" and error.edits == ["acc"] and error.unrestored == ["acc"]
    assert "writes_state" in str(error) and "Not restored" in str(error)
    # The graph is rolled back; the write it could not undo is named, not hidden.
    assert graph_of(program).python_code("self").src == code
    assert error.rolled_back and "abs" in error.diff


WRITES = {"zero_": {}, "data =": {"swap": True}, "data.zero_": {"through_data": True}}


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("form", ["exported", "traced"])
def test_failing_pass_that_declares_state_writes_is_restored_exactly(form, write, request):
    """After ``acc.data = zeros``, the rollback put back neither the data nor its storage;
    after ``acc.data.zero_()`` (no mark on ``acc`` itself), not the data."""
    program = request.getfixturevalue(form)
    with torch.no_grad():
        buffer_of(program).copy_(torch.arange(4.0))
    before, storage = buffer_of(program).clone(), buffer_of(program).data_ptr()
    with pytest.raises(PassFailedError) as info:
        PassManager([DeclaredReset(fail=True, **WRITES[write])]).run(program)
    assert not isinstance(info.value, EffectsError) and info.value.unrestored == []
    torch.testing.assert_close(buffer_of(program), before, rtol=0, atol=0)
    assert buffer_of(program).data_ptr() == storage  # the very tensor data, still shared
    assert not targets(program, "abs")


@pytest.mark.parametrize("write", ["zero_", "data.zero_"])
def test_declared_state_write_that_succeeds_is_measured_as_a_change(traced, write):
    with torch.no_grad():
        traced.acc.fill_(2.0)
    result = PassManager([DeclaredReset(**WRITES[write])]).run(traced)
    assert result.modified and result.report.records[0].modified
    assert torch.count_nonzero(traced.acc) == 0


def test_strict_run_names_an_undeclared_write_through_data_and_restores_it(exported):
    """Under ``strict=True`` the data is copied whatever the declaration: a write through
    ``acc.data``, which leaves ``acc``'s version counter alone, is seen and undone (before,
    the run succeeded, measured unmodified, the buffer zeroed)."""
    with torch.no_grad():
        buffer_of(exported).fill_(3.0)
    with pytest.raises(EffectsError) as info:
        PassManager([ResetAndRewrite(through_data=True)], strict=True).run(exported)
    assert info.value.kind == "writes_state" and info.value.edits == ["acc"]
    assert info.value.unrestored == [] and torch.all(buffer_of(exported) == 3.0)


def test_a_pass_that_only_reads_state_needs_no_declaration(traced):
    @dataclasses.dataclass(frozen=True, repr=False)
    class ReadsState(Pass):
        def call(self, program):
            total = float(program.acc.sum()) + float(program.linear.weight.detach().sum())
            return PassResult(program, False, [f"sum {total:.1f}"])

    result = PassManager([ReadsState()]).run(traced)
    assert not result.modified and result.report.records[0].notes


@pytest.mark.parametrize("write", ["data.mul_", "data ="])
@pytest.mark.parametrize("form", ["exported", "traced"])
def test_strict_run_restores_a_parameter_written_through_data(form, write, request):
    """Under ``strict=True`` a parameter's data is copied too: ``w.data.mul_(2)`` (no mark on
    ``w``) and ``w.data = other`` (no copy to put back) are named and undone. Before, the
    first left the weight doubled and the run measured unmodified; the second was named but
    not restored."""
    program = request.getfixturevalue(form)
    state = program.state_dict if form == "exported" else dict(program.named_parameters())
    weight = state["linear.weight"]
    before, storage = weight.detach().clone(), weight.data_ptr()

    class ScaleWeight(Pass):  # declares no state writes
        def call(self, program):
            if write == "data =":
                weight.data = weight.detach() * 2
            else:
                weight.data.mul_(2)

    with pytest.raises(EffectsError) as info:
        PassManager([ScaleWeight()], strict=True).run(program)
    assert info.value.kind == "writes_state" and info.value.edits == ["linear.weight"]
    assert info.value.unrestored == []
    assert torch.equal(weight, before) and weight.data_ptr() == storage
