"""Lifted constants that are a registered buffer's very tensor, read as that buffer.

Non-strict ``torch.export`` lifts a tensor reached through a plain Python object as a
constant even when the module registers the very same tensor as a buffer: transformers'
old ExecuTorch recipe (``TorchExportableModuleForDecoderOnlyLM(...).export(strict=False)``)
registers each ``StaticCache`` layer's keys, values and counter as buffers and writes them
through the cache object, so the program takes each twice, as a buffer nobody reads and as
a constant it writes. A write to a constant cannot be an output of the program; but this
constant *is* the buffer (one storage, one offset, one shape, one layout): every use of it
is a use of the buffer, so it is rewritten as one, and the buffer is state like any other.

Only an exact alias is merged, and only when the program writes it (through either name):
a constant that is a view of part of a buffer, or shares its storage otherwise, stays and
is refused where it is written (``mutation_checks``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature
from torch.fx import Node

from .._analysis.buffers import (
    BUFFER,
    CONSTANT,
    INITIAL_META,
    MUTABLE_BUFFER_META,
    Mutations,
    State,
    buffer_tensor,
)
from .._analysis.fake_values import FakeValues
from .._analysis.marked_state import initial_copy

__all__ = ["merge_buffer_constants"]


def _same_tensor(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` are one tensor seen twice: one storage, offset, shape,
    layout and dtype (so every element of one is the same element of the other)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.layout != torch.strided or b.layout != torch.strided or a.is_quantized:
        return False
    try:
        same_storage = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without one storage
        return False
    return (same_storage and a.device == b.device and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


def _buffers_by_storage(program: Any, states: dict[Node, State]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for state in dict.fromkeys(states.values()):
        tensor = buffer_tensor(program, state.name) if state.kind == BUFFER else None
        pointer = _storage_pointer(tensor)
        if pointer:  # 0: an empty storage, which every empty tensor would match
            found.setdefault(pointer, []).append(state.name)
    return found


def _storage_pointer(tensor: object) -> int | None:
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without one storage
        return None


def merge_buffer_constants(program: Any, gm: torch.fx.GraphModule, scan: Mutations) -> list[str]:
    """Rewrite each use of a lifted constant that is a written buffer's very tensor, or a
    written constant that is a buffer's, as a use of that buffer; the buffer is marked as
    ``MarkMutableBuffers`` marks one (it did not see it written). Returns a note per merge."""
    written = set(scan.writers)
    buffers = {s: n for n, s in scan.states.items() if s.kind == BUFFER}
    constants = [(n, s) for n, s in scan.states.items() if s.kind == CONSTANT]
    by_storage = _buffers_by_storage(program, scan.states) if constants else {}
    merges: list[tuple[Node, State]] = []
    for node, state in constants:
        tensor = buffer_tensor(program, state.name)
        fqn = next((b for b in by_storage.get(_storage_pointer(tensor), ())
                    if _same_tensor(buffer_tensor(program, b), tensor)), None)
        if fqn is not None and (state in written or State(BUFFER, fqn) in written):
            merges.append((node, State(BUFFER, fqn)))
    notes = []
    merged: list[Node] = []
    for node, buffer in merges:
        target = buffers.get(buffer)
        if target is None:  # a GraphModule reading the buffer only through the constant
            with gm.graph.inserting_before(node):
                target = gm.graph.get_attr(buffer.name)
            target.meta.update(node.meta)
            buffers[buffer] = target
        if target.meta.get(MUTABLE_BUFFER_META) != buffer.name:
            target.meta[MUTABLE_BUFFER_META] = buffer.name
            target.meta[INITIAL_META] = initial_copy(buffer_tensor(program, buffer.name))
        constant = scan.states[node].name
        merged.append(target)
        node.replace_all_uses_with(target)
        gm.graph.erase_node(node)
        _forget_constant(program, gm, node, constant)
        notes.append(f"constant {constant!r} is the tensor of buffer {buffer.name!r} (non-strict "
                     f"export lifts it beside the buffer): read and written as that buffer")
    _refresh_values(gm.graph, merged)
    return notes


def _refresh_values(graph: torch.fx.Graph, merged: list[Node]) -> None:
    """Recompute the fake values of every node computed from a merged buffer. Non-strict
    export records them from the constant's own fake value, which shares no storage with
    what eager aliases (``copy_``'s result, ``to`` of the same dtype): the alias analysis
    reads a maybe-view from storage sharing, and would take ``counter.copy_(p).to(...)
    .add_(1)`` (transformers' ``StaticCache`` counter update) for a write to a copy."""
    if not merged:
        return
    fake = FakeValues(graph)
    reached = set(merged)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method") and reached.intersection(
                node.all_input_nodes):
            reached.add(node)
            fake.infer(node)


def _forget_constant(program: Any, gm: torch.fx.GraphModule, node: Node, constant: str) -> None:
    if isinstance(program, ExportedProgram):
        signature = program.graph_signature
        inputs = [s for s in signature.input_specs if s.arg.name != node.name]
        # A new signature (not the old one edited): the rollback record keeps the old one.
        program._graph_signature = ExportGraphSignature(inputs, list(signature.output_specs))
        if all(s.target != constant for s in inputs):
            program.constants.pop(constant, None)
        return
    if all(n.target != constant for n in gm.graph.nodes if n.op == "get_attr"):
        *path, leaf = constant.split(".")
        owner = gm.get_submodule(".".join(path)) if path else gm
        delattr(owner, leaf)
