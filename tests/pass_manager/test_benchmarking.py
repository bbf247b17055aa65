"""benchmark_passes: each pass timed under a PassManager on fresh copies of the program (or
of the methods of one model), the program given left as it was."""

from __future__ import annotations

import pytest
import torch

from pass_manager.benchmarking import benchmark_passes
from pass_manager.program import node_count, program_text
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.examples import decoder_job
from tests.models.accumulators import Accumulate
from tests.models.methods import decoder_methods

PASSES = [MarkMutableBuffers(), InplaceToFunctional()]


def test_each_pass_is_timed_on_a_fresh_copy_and_the_program_is_left_as_given():
    model, example, _ = decoder_job(n_layers=1)
    program = torch.export.export(model, example)
    before = program_text(program)
    result = benchmark_passes(PASSES, program, repeat=3)
    assert [t.name for t in result.passes] == ["#0 MarkMutableBuffers", "#1 InplaceToFunctional"]
    assert all(len(t.samples) == 3 and t.min > 0 for t in (result.total, *result.passes))
    assert result.nodes == node_count(program)
    assert program_text(program) == before  # every run had a copy of its own
    lines = result.table().splitlines()
    assert lines[0] == f"program: {node_count(program)} nodes"
    assert [line.split()[0] for line in lines[2:]] == ["pipeline", "condition", "#0", "#1"]


def test_the_methods_of_one_model_are_timed_per_method():
    """Given ``{name: program}`` as PassManager.run takes it; it raised AttributeError."""
    _, programs, _ = decoder_methods(n_layers=1)
    before = {name: program_text(program) for name, program in programs.items()}
    result = benchmark_passes(PASSES, programs, repeat=2)
    assert [t.name for t in result.passes] == [
        f"{method}: #{index} {name}" for method in programs
        for index, name in enumerate(["MarkMutableBuffers", "InplaceToFunctional"])]
    assert result.nodes == sum(node_count(program) for program in programs.values())
    assert {name: program_text(p) for name, p in programs.items()} == before


@pytest.mark.parametrize("repeat", [0, -1, 1.5, True])
def test_a_repeat_that_is_no_positive_count_is_refused(repeat):
    """repeat=0 timed nothing, then .table() failed on min() of no samples."""
    program = torch.export.export(Accumulate(), (torch.ones(4),))
    with pytest.raises(ValueError, match=f"repeat={repeat!r}: the runs to time, at least 1"):
        benchmark_passes([], program, repeat=repeat)
