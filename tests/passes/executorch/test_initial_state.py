"""Each mutable buffer of a ``.pte`` starts from its own initial value.

ExecuTorch 1.5.1's emitter, emitting mutable buffers with names and initial values, gives an
initialized buffer whose bytes equal an earlier constant's that constant's buffer index,
which the runtime reads in the mutable data segment: the buffer starts from another
buffer's bytes (the Hugging Face prefill's int64 counters started from an int8 key cache,
and ``index_put`` failed out of bounds). :func:`repair_initial_state` (called by both
lowerings) points each at its own value.

The smallest case: a step counter (``int64`` 0) registered after a read-only ``int64`` zero
(a constant, emitted first, same bytes) and a running total that starts at 7. On today's
main the counter starts at 7 on the runtime.
"""

from __future__ import annotations

import copy

import torch

from passes.executorch import decode_on_runtime, run_methods_on_runtime


class CounterAfterZeroConstant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("zero", torch.zeros((), dtype=torch.int64))  # read only
        self.register_buffer("total", torch.full((), 7, dtype=torch.int64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum().to(torch.int64))
        self.steps.add_(1)
        return torch.stack([self.steps + self.zero, self.total.clone()])


STEPS = [(torch.tensor([2.0]),), (torch.tensor([3.0]),), (torch.tensor([4.0]),)]


def _eager() -> list[torch.Tensor]:
    model = CounterAfterZeroConstant()
    return [model(*step) for step in STEPS]


def _exported() -> torch.export.ExportedProgram:
    return torch.export.export(CounterAfterZeroConstant(), STEPS[0])


def test_the_counter_starts_from_its_own_zero_on_the_runtime():
    run = decode_on_runtime(_exported(), None, STEPS)
    got = [output[0] for output in run.outputs]
    assert [t.tolist() for t in got] == [t.tolist() for t in _eager()]  # steps 1, 2, 3


def test_the_counter_starts_from_its_own_zero_in_a_methods_pte():
    ep = _exported()
    run = run_methods_on_runtime({"step": ep, "again": copy.deepcopy(ep)},
                                 [("step", STEPS[0], {}), ("again", STEPS[1], {}),
                                  ("step", STEPS[2], {})])
    assert [out[0].tolist() for out in run.outputs] == [t.tolist() for t in _eager()]


def test_the_emitter_points_the_counter_at_the_totals_bytes_and_the_repair_once_fixes_it():
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from executorch.runtime import Runtime

    from passes.executorch.initial_state import repair_initial_state

    config = ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(["total", "steps"])],
                                     emit_mutable_buffer_names=True)
    with torch.no_grad():
        et = to_edge(_exported()).to_executorch(config)
    emitted = Runtime.get().load_program(et.buffer).load_method("forward")
    assert emitted.execute(list(STEPS[0]))[0].tolist() == [8, 9]  # steps began at 7
    notes = repair_initial_state(et, config)
    assert len(notes) == 1 and "'steps'" in notes[0], notes
    assert repair_initial_state(et, config) == []  # consistent now: nothing more to do
    repaired = Runtime.get().load_program(et.buffer).load_method("forward")
    assert repaired.execute(list(STEPS[0]))[0].tolist() == [1, 9]


class TotalAfterZeroConstant(torch.nn.Module):
    """The program's only mutable buffer (float zeros) has the bytes of a constant emitted
    before it (an int32 zero vector, as QnnQuantizer's per-channel zero points are)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("zero_points", torch.zeros(4, dtype=torch.int32))  # read only
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x + self.zero_points)
        return self.total * 2


def test_the_only_buffer_matched_to_a_constant_gets_a_segment_of_its_own():
    """The emitter matched the total to the constant, so it wrote no mutable data segment:
    the runtime refused to load the method (``getTensorDataPtr() failed: 0x20``, a
    QnnQuantizer per-channel linear's running total on main). It now starts from its zeros."""
    steps = [(torch.full((4,), float(i)),) for i in (1, 2, 3)]
    eager = TotalAfterZeroConstant()
    expected = [eager(*step) for step in steps]
    run = decode_on_runtime(torch.export.export(TotalAfterZeroConstant(), steps[0]), None, steps)
    assert [out[0].tolist() for out in run.outputs] == [t.tolist() for t in expected]
    assert any("'total' was emitted reading entry" in note for note in run.notes), run.notes
