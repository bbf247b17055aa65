"""The main job's integer-state stage (``--quantize-state``): QuantizeMutableBuffers on the
quantized program, each buffer's dtype and bytes before and after, and the exact check.

The pass runs on the program ``quantize_program`` returned (after UnfreezeMutableBuffer and
the lift). The integer-stored program must compute exactly what the fp32-stored one does:
its outputs bit for bit and its state, dequantized on each buffer's grid, equal (atol 0) at
every decode step. The flow then delegates and lowers the integer-stored program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.export import ExportedProgram

from pass_manager import PassManager
from pass_manager.validation import Trace, copy_program, first_difference

from .._analysis.marked_state import mutable_buffers
from .._analysis.quantized_state import state_storage
from ..delegation.ownership import program_state
from ..quantize_mutable_buffers import QuantizeMutableBuffers
from .result import Check, FlowResult

__all__ = ["INTEGER_STATE", "StateReader", "dequantized_state", "integer_state_stage",
           "state_lines", "storage_of"]

INTEGER_STATE = "quantized, integer state"
StateReader = Callable[[torch.nn.Module], dict[str, torch.Tensor]]


def dequantized_state(grids: dict[str, Any]) -> StateReader:
    """A state reader (``run_program(state=...)``): every buffer of a runnable program, its
    delegates' included, with each integer buffer dequantized on its grid (by FQN)."""
    def read(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        state = program_state(module)
        return {fqn: grids[fqn].dequantize(value)
                if fqn in grids and not value.is_floating_point() else value
                for fqn, value in state.items()}
    return read


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_of(program: ExportedProgram, after: ExportedProgram, notes: list[str]) -> dict:
    """Per mutable buffer: dtype and bytes before and after, the grid or why it kept its dtype."""
    before, stored = state_storage(program), state_storage(after)
    buffers = {}
    for fqn, was in before.items():
        now = stored.get(fqn, was)
        said = next((n[len(fqn) + 2:] for n in notes if n.startswith(f"{fqn}: ")), "")
        if said.startswith("stays "):  # "stays float32: <why>": the dtype is in the table
            said = said.partition(": ")[2]
        buffers[fqn] = {
            "dtype_before": _dtype(was.dtype), "bytes_before": was.nbytes,
            "dtype_after": _dtype(now.dtype), "bytes_after": now.nbytes,
            "grid": now.grid.describe() if now.grid is not None else None,
            "kept": None if now.grid is not None else said,
        }
    return {
        "buffers": buffers,
        "bytes_before": sum(b["bytes_before"] for b in buffers.values()),
        "bytes_after": sum(b["bytes_after"] for b in buffers.values()),
        "planned_mutable_buffer_bytes": {},  # filled by the ExecuTorch stage, per .pte
    }


def _ratio(before: int, after: int) -> str:
    return f"÷{before / after:.2f}" if after else "-"


def state_lines(storage: dict) -> list[str]:
    """The report's lines: one per buffer, the total, and the planned bytes per .pte."""
    width = max((len(fqn) for fqn in storage["buffers"]), default=0)
    lines = []
    for fqn, b in storage["buffers"].items():
        line = (f"{fqn:<{width}}  {b['dtype_before']:>7} {b['bytes_before']:>10,} B -> "
                f"{b['dtype_after']:>7} {b['bytes_after']:>10,} B")
        if b["grid"] is not None:
            line += f"  {_ratio(b['bytes_before'], b['bytes_after'])}  on {b['grid']}"
        else:
            line += f"  kept: {b['kept']}"
        lines.append(line)
    total, after = storage["bytes_before"], storage["bytes_after"]
    lines.append(f"total: {total:,} B -> {after:,} B ({_ratio(total, after)})")
    for name, planned in storage["planned_mutable_buffer_bytes"].items():
        lines.append(f"planned mutable-buffer bytes of the {name} .pte: {planned:,} B")
    return lines


def integer_state_stage(
    stage: Any,
    result: FlowResult,
    quantized: ExportedProgram,
    reference: Trace,
    steps: list,
    options: dict[str, Any],
) -> tuple[ExportedProgram, Trace, StateReader]:
    """Store ``quantized``'s quantized state as integers and check it against ``reference``
    (``quantized``'s decode); returns the integer-stored program, its decode (state
    dequantized) and the state reader that dequantizes it."""
    manager = PassManager([QuantizeMutableBuffers()], **options)
    stored = stage("store quantized state as integers (QuantizeMutableBuffers)",
                   lambda: manager.run(copy_program(quantized)))
    result.reports.append(("quantize state", stored.report))
    notes = [note for record in stored.report.records for note in record.notes]
    result.state_storage = storage_of(quantized, stored.program, notes)
    grids = {fqn: info.grid for fqn, info in mutable_buffers(stored.program).items()
             if info.grid is not None}
    read = dequantized_state(grids)
    trace = stage("decode the integer-state program",
                  lambda: stage.run(stored.program, steps, state=read))
    difference = first_difference(reference, trace)  # atol 0, rtol 0
    result.checks.append(Check(
        "integer-stored state computes exactly what the fp32-stored quantized program does",
        difference is None,
        difference or f"outputs and dequantized state equal (atol 0) over {len(steps)} steps; "
        f"{len(grids)} of {len(result.state_storage['buffers'])} mutable buffers stored as "
        "integers",
    ))
    return stored.program, trace, read
