"""Integer state a method only reads: the integers another method stores, dequantized
where the method read the float buffer.

``QuantizeMutableBuffers`` decides each method on its own, and a method that only reads a
buffer (a decode reading what a prefill counted, a narrow call reading the total a wide
call keeps) has no write to take a grid from: it would keep a float buffer beside the
writer's integers, which one ``.pte`` cannot share. Once the writers have stored the buffer
on a grid, :func:`read_integer_state` makes each such reader hold the writers' integer
tensor and dequantize it at the top of its graph. The values it computes with are the ones
the float buffer held (the writers store values of the grid, and the initial value lies on
it), so the method computes exactly what it did. A method that writes the buffer itself
and kept it float (its writes are off the grid) cannot: it is returned as a
:class:`FloatWriter` for the caller to refuse. A method whose every write of it is the
constant zero (a reset ``zero_()`` or ``fill_(0)``, which alone takes no grid) stores the
writers' integers too: each write stores the grid's zero point, which dequantizes to the
``0.0`` it wrote. On a per-channel grid, whose scales and zero points only the writers'
graphs hold, a method that reads the buffer without writing it, or writes it only as zeros
(no one constant per channel), cannot: it is returned as a :class:`FloatHolder` saying so;
a method that holds the buffer and never reads it just holds the integers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from .._analysis.buffers import GRID_META, INITIAL_META, buffer_tensor, replace_buffer_tensor
from .._analysis.grid_flow import is_zero_fill
from .._analysis.grids import Grid
from .._analysis.marked_state import initial_copy
from .._analysis.quantized_state import NO_GRID, BufferPlan, plan_quantized_state

__all__ = ["PER_CHANNEL_READ", "PER_CHANNEL_ZEROS", "FloatHolder", "read_integer_state",
           "restate_integer_reads", "writes_only_zeros"]


def writes_only_zeros(plan: BufferPlan) -> bool:
    """The method stays float only for want of a grid, and every write of ``plan``'s buffer
    stores a tensor of (positive) zeros: it can store any per-tensor grid's zero point."""
    return plan.reason == NO_GRID and bool(plan.writes) and all(
        isinstance(write.value, torch.fx.Node) and is_zero_fill(write.value)
        for write in plan.writes)


def _stored_grids(programs: Mapping[str, ExportedProgram]) -> dict[str, tuple[Grid, str]]:
    """Per buffer some method stores as integers: its grid and that method."""
    found: dict[str, tuple[Grid, str]] = {}
    for name, program in programs.items():
        names = program.graph_signature.inputs_to_buffers
        for node in program.graph.find_nodes(op="placeholder"):
            grid = node.meta.get(GRID_META)
            if grid is not None and node.name in names:
                found.setdefault(names[node.name], (grid, name))
    return found


PER_CHANNEL_READ = ("reads it without writing it, and only the methods writing it hold the "
                    "per-channel grid's scales and zero points to read integers with")
PER_CHANNEL_ZEROS = "writes it as zeros, which a per-channel grid does not store as one constant"


@dataclass(frozen=True)
class FloatHolder:
    """A method holding, as float, a buffer another method stores as integers, which it
    cannot take: its own ``QuantizeMutableBuffers`` kept the buffer float (a write off the
    grid, e.g. a reset ``fill_``; ``why`` None), or the grid is per channel and the method
    only reads the buffer or writes it only as zeros (``why`` says which)."""

    buffer: str
    method: str
    storing: str
    grid: Grid
    why: str | None = None


def read_integer_state(programs: Mapping[str, ExportedProgram],
                       written: Mapping[str, set[str]],
                       ) -> tuple[dict[str, list[str]], list[FloatHolder]]:
    """Make every method that holds, float and unwritten by itself, a buffer other methods
    store as integers read those integers (the same tensor); returns, per method, the
    buffers it now reads so (``written``: per method, the buffers it writes; a method
    writing it only as zeros stores the grid's zero point and reads the integers too), and
    each method that cannot (left as it is: the caller refuses it): one writing such a
    buffer otherwise as float, or, on a per-channel grid, one reading it or writing it
    only as zeros."""
    stored = _stored_grids(programs)
    writes_by_any = set().union(*written.values())
    changed: dict[str, list[str]] = {}
    holders: list[FloatHolder] = []
    for name, program in programs.items():
        names = program.graph_signature.inputs_to_buffers
        for node in list(program.graph.find_nodes(op="placeholder")):
            fqn = names.get(node.name)
            if fqn not in stored or fqn not in writes_by_any or GRID_META in node.meta:
                continue
            grid, writer = stored[fqn]
            if not buffer_tensor(program, fqn).is_floating_point():
                continue
            writes = fqn in written.get(name, ())
            if grid.per_channel and (writes or node.users):
                holders.append(FloatHolder(fqn, name, writer, grid, _per_channel_why(
                    program, fqn) if writes else PER_CHANNEL_READ))
                continue
            if writes:
                if not _zeros_stored_as_integers(program, node, fqn, grid):
                    holders.append(FloatHolder(fqn, name, writer, grid))
                    continue
            else:
                _dequantized_at_the_top(program, node, grid)
            replace_buffer_tensor(program, fqn, buffer_tensor(programs[writer], fqn))
            changed.setdefault(name, []).append(fqn)
    return changed, holders


def _per_channel_why(program: ExportedProgram, fqn: str) -> str | None:
    """Why a method writing ``fqn`` cannot store it on a per-channel grid another method
    stores it on: it writes it only as zeros (else None: its own reason says why)."""
    plan = next((p for p in plan_quantized_state(program)[0] if p.fqn == fqn), None)
    return PER_CHANNEL_ZEROS if plan is not None and writes_only_zeros(plan) else None


def _zeros_stored_as_integers(program: ExportedProgram, node: torch.fx.Node, fqn: str,
                              grid: Grid) -> bool:
    """If ``program`` writes buffer ``fqn`` (its placeholder ``node``) only as zeros, all
    of them ``BUFFER_MUTATION`` outputs: make each write store ``grid``'s zero point and
    each read dequantize the integers; returns whether it did."""
    plan = next((p for p in plan_quantized_state(program)[0] if p.fqn == fqn), None)
    if plan is None or not writes_only_zeros(plan) or any(
            write.output is None for write in plan.writes):
        return False
    graph = program.graph
    output = graph.output_node()
    values = list(output.args[0])
    for write in plan.writes:
        zeros = write.value.meta["val"]
        with graph.inserting_before(output):
            fill = graph.call_function(torch.ops.aten.full.default,
                                       (list(zeros.shape), int(grid.zero_point)),
                                       {"dtype": grid.dtype, "device": zeros.device})
        with zeros.fake_mode:
            fill.meta["val"] = torch.full(zeros.shape, int(grid.zero_point), dtype=grid.dtype,
                                          device=zeros.device)
        values[write.output] = fill
    output.args = (tuple(values), *output.args[1:])
    _dequantized_at_the_top(program, node, grid)
    return True


def _dequantized_at_the_top(program: ExportedProgram, node: torch.fx.Node, grid: Grid) -> None:
    """``node`` (a buffer's placeholder) holds ``grid``'s integers; its readers, if any,
    read them dequantized, right after the last placeholder."""
    graph = program.graph
    old = node.meta["val"]
    if node.users:
        last = graph.find_nodes(op="placeholder")[-1]
        with graph.inserting_after(last):
            target, args, kwargs = grid.dequantize_args(node)
            dequantized = graph.call_function(target, args, kwargs)
        node.replace_all_uses_with(dequantized,
                                   delete_user_cb=lambda user: user is not dequantized)
        dequantized.meta["val"] = old
    with old.fake_mode:
        node.meta["val"] = torch.empty_strided(old.shape, old.stride(), dtype=grid.dtype)
    node.meta.pop("tensor_meta", None)
    node.meta[GRID_META] = grid
    initial = node.meta.get(INITIAL_META)
    if initial is not None:
        node.meta[INITIAL_META] = initial_copy(grid.integers_of(initial))
    graph.lint()
    program.graph_module.recompile()


def restate_integer_reads(results: Mapping[str, Any], reads: Mapping[str, list[str]]) -> None:
    """Make each method's ``QuantizeMutableBuffers`` record say what the join stored:
    ``reads`` (the run's ``notes["integer reads"]``), per method, the buffers it now holds
    as the writers' integers. The pass decided the method alone and noted such a buffer as
    staying float (a reset writing zeros) or not at all (a method only reading it); its
    note, statistics, node count and ``modified`` are rewritten from the stored program.
    ``results``: per method, the pass manager's run result (``.program``, ``.report``,
    ``.modified``); the joint condition calls it on every run of the mapping."""
    programs = {name: result.program for name, result in results.items()}
    for method, fqns in reads.items():
        program = programs[method]
        record = _stored_record(results[method].report)
        if record is None:
            continue
        statistics = Counter(record.statistics)
        for fqn in fqns:
            grid, writer = _stored_grids({name: p for name, p in programs.items()
                                          if fqn not in reads.get(name, ())})[fqn]
            held = buffer_tensor(program, fqn)
            before = held.numel() * grid.out_dtype.itemsize
            after = held.numel() * held.element_size()
            writes = fqn in program.graph_signature.buffers_to_mutate.values()
            how = ("writes only zeros, stored as the grid's zero point" if writes
                   else "reads them dequantized")
            note = (f"{fqn}: {_dtype(grid.out_dtype)} -> {_dtype(grid.dtype)} ({before} -> "
                    f"{after} bytes) on {grid.describe()}: holds the integers {writer!r} "
                    f"stores and {how}")
            kept = [i for i, said in enumerate(record.notes) if said.startswith(f"{fqn}: ")]
            if kept:
                record.notes[kept[0]] = note
            else:
                record.notes.append(note)
            if statistics.pop(f"{fqn}: left float", None) is not None:
                statistics["buffers left float"] -= 1
                statistics["state bytes after"] -= before
            else:
                statistics["state bytes before"] += before
            statistics["buffers stored as integers"] += 1
            statistics["state bytes after"] += after
            statistics[f"{fqn}: bytes {_dtype(grid.out_dtype)}"] = before
            statistics[f"{fqn}: bytes {_dtype(grid.dtype)}"] = after
        record.statistics = {key: count for key, count in statistics.items()
                             if count or key.startswith("state bytes")}
        record.nodes_after = len(program.graph.nodes)
        record.modified = True
        results[method].modified = True  # the run changed the method, if the pass did not


def _stored_record(report: Any) -> Any:
    """The last ``QuantizeMutableBuffers`` record of ``report`` (None: the pass did not run)."""
    return next((record for record in reversed(report.records)
                 if record.name == "QuantizeMutableBuffers"), None)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
