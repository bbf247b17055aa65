"""What a marked program says about its state, read back from node meta.

``MarkMutableBuffers`` records each mutable buffer's name and the value it started with in
node meta, which survives ``ep.module()``, deep copies and torchao's prepare/convert, so
:func:`mutable_buffers` and :func:`reset_mutable_buffers` work on whatever the program
became afterwards. :func:`initial_copy` is how the starting value is kept: one element
for a buffer filled with one value (the usual zeros of a KV cache), a copy otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pass_manager import graph_module_of

from ..errors import CarriedStateWarning, QuantizationInputError
from .buffers import (
    BUFFER,
    GRID_META,
    INITIAL_META,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    PARAMETER,
    USER_INPUT,
    buffer_tensor,
    find_mutations,
)

__all__ = [
    "MutableBuffer",
    "fill_value",
    "initial_copy",
    "initial_values",
    "mutable_buffers",
    "reset_mutable_buffers",
]


# Integer dtypes of each element size: a fill is detected on the bits, so -0.0 vs 0.0 and
# NaN payloads count as different values and a reset restores them bit for bit.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fill_value(tensor: torch.Tensor) -> torch.Tensor | None:
    """The one value every element of ``tensor`` holds (a 0-dim tensor), or None."""
    if tensor.numel() == 0 or tensor.is_complex() or tensor.is_quantized or (
        tensor.layout != torch.strided or tensor.device.type == "meta"
    ):
        return None
    if tensor.element_size() not in _BITS:
        return None
    if all(stride == 0 for stride in tensor.stride()):  # one element expanded: a kept fill
        return tensor[(0,) * tensor.dim()].clone()
    # Seen as signed integers of its size (a no-op for those): every dtype compares bit
    # for bit, and the unsigned ones without an ``aminmax`` kernel (uint16-64) are covered.
    bits = tensor.view(_BITS[tensor.element_size()])
    if tensor.numel() > _SMALL:  # the usual non-fill is seen without reading everything
        first, last = bits[(0,) * bits.dim()], bits[(-1,) * bits.dim()]
        if not torch.equal(first, last):
            return None
    # One read of the data and no temporary of its size; also how the usual all-zero KV
    # cache is recognised: ``any()`` costs 3.7x as much (52 vs 14 ms on 256 MiB).
    low, high = torch.aminmax(bits)
    return tensor[(0,) * tensor.dim()].clone() if torch.equal(low, high) else None


# Buffers up to this many elements are read whole at once: peeking at two elements first
# costs more than reading them (a model has a few such buffers per layer).
_SMALL = 1 << 16


def initial_copy(tensor: torch.Tensor) -> torch.Tensor:
    """What a reset needs to restore ``tensor``'s current value exactly, without a full copy
    where one value fills it (the usual zeros of a KV cache).

    A filled buffer is kept as its one value expanded to the buffer's shape (stride 0, one
    element of memory); any other buffer is cloned. Either compares, copies and deep-copies
    like the buffer's value.
    """
    if tensor.requires_grad:  # the copies below record no autograd history
        tensor = tensor.detach()
    fill = fill_value(tensor)
    return tensor.clone() if fill is None else fill.expand(tensor.shape)


@dataclass
class MutableBuffer:
    """A mutated buffer (or user input) of a marked program.

    Attributes:
        fqn: the buffer's fully-qualified name (for a user input, the input's name).
        kind: ``"buffer"``, ``"parameter"`` (a parameter the program writes) or
            ``"user_input"``.
        nodes: names of the nodes that denote it (placeholder or get_attr).
        writers: names of the nodes that write it, in graph order.
        initial: the value ``MarkMutableBuffers`` first saw (None for inputs): a copy, or
            for a buffer filled with one value that value expanded to the buffer's shape.
            For a buffer stored as integers, the integers of that value.
        grid: for a buffer ``QuantizeMutableBuffers`` stores as the integers of a
            quantization grid, that :class:`~passes._analysis.grids.Grid`
            (``grid.dequantize(tensor)`` is the value the program computes with); None for
            a float buffer. For a user input it stores so (``carried_state=True``), the grid
            of the integers the caller now passes (``grid.quantize(float_state)``).
    """

    fqn: str
    kind: str
    nodes: list[str] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    initial: torch.Tensor | None = None
    grid: Any = None


def mutable_buffers(program: Any) -> dict[str, MutableBuffer]:
    """The mutable buffers and mutated user inputs ``MarkMutableBuffers`` marked, by name.

    Reads the marks in node meta, so it works on what the program became after other
    transformations (``ep.module()``, torchao prepare/convert); ``writers`` reflects the
    current graph.

    Example:
        >>> ep = PassManager([MarkMutableBuffers()]).run(ep).program
        >>> sorted(mutable_buffers(ep))
        ['layers.0.attn.k_cache', 'layers.0.attn.v_cache']
    """
    found = _marked(program)
    if found:
        scan = find_mutations(program)
        for state, nodes in scan.writers.items():
            if state.name in found and found[state.name].kind == state.kind:
                found[state.name].writers = [n.name for n in nodes if n is not None]
    return found


def initial_values(program: Any) -> dict[str, torch.Tensor]:
    """The value each marked buffer (or written parameter) started with, by FQN: what
    :func:`reset_mutable_buffers` restores. Buffers marked without one are left out."""
    return {fqn: info.initial for fqn, info in _marked(program).items()
            if info.kind != USER_INPUT and info.initial is not None}


def _marked(program: Any) -> dict[str, MutableBuffer]:
    """The marks in node meta, without the writers (which need a scan of the graph)."""
    gm = graph_module_of(program)
    found: dict[str, MutableBuffer] = {}
    for node in gm.graph.nodes:
        for key, kind in ((MUTABLE_BUFFER_META, BUFFER), (MUTABLE_INPUT_META, USER_INPUT)):
            name = node.meta.get(key)
            if name is None:
                continue
            if name not in found and kind == BUFFER and _is_parameter(program, name):
                kind = PARAMETER
            entry = found.setdefault(name, MutableBuffer(name, kind))
            entry.nodes.append(node.name)
            if entry.initial is None and node.meta.get(INITIAL_META) is not None:
                entry.initial = node.meta[INITIAL_META]
            if entry.grid is None:
                entry.grid = node.meta.get(GRID_META)
    return found


def _is_parameter(program: Any, fqn: str) -> bool:
    try:
        return isinstance(buffer_tensor(program, fqn), torch.nn.Parameter)
    except (KeyError, AttributeError):  # no longer held (e.g. folded away by a conversion)
        return False


def reset_mutable_buffers(program: Any) -> list[str]:
    """Restore every marked buffer to the value it had when it was first marked.

    Returns the FQNs restored. Calibration and test runs otherwise leave their state
    (a filled KV cache, an advanced counter) in the program's buffers, and in the
    parameters it writes, which are restored too. A buffer that was filled with one value
    (zeros) is refilled from that value: its kept copy is one element.

    ``program`` may be the methods of one model, ``{name: program}``: a buffer the methods
    hold as one tensor (as ``quantize_methods`` returns them) is restored once, from the
    first method marking it; each FQN is listed once.

    Raises:
        QuantizationInputError: the program writes buffers MarkMutableBuffers never marked
            (torchao prepared ``torch.export.export(...).module()`` directly): the values
            they started with are not known; nothing is reset.

    State the program carries in user inputs it mutates in place lives in the caller's
    tensors: nothing here can reset it. When there is such state, a
    :class:`~passes.errors.CarriedStateWarning` naming the inputs says so (the program's
    own buffers are still reset).
    """
    programs = list(program.values()) if isinstance(program, Mapping) else [program]
    marks = [(method, _marked(method)) for method in programs]
    unmarked = sorted({state.name for method, marked in marks
                       for state in find_mutations(method).writers
                       if state.kind in (BUFFER, PARAMETER) and state.name not in marked})
    if unmarked:
        raise QuantizationInputError(
            "reset_mutable_buffers", "program",
            f"it writes {', '.join(map(repr, unmarked))} in place, but MarkMutableBuffers "
            "never marked them, so the values they started with are not known and nothing "
            "was reset; mark the exported program before preparing it "
            "(PassManager([MarkMutableBuffers()]).run(ep), then ep.module()), or quantize "
            "with passes.quantization.quantize_program, which marks it")
    restored: list[str] = []
    carried: list[str] = []
    done: set[int] = set()  # the tensors restored: methods may hold one tensor
    for method, marked in marks:
        for fqn, info in marked.items():
            if info.kind == USER_INPUT:
                carried.append(fqn)
                continue
            tensor = None if info.initial is None else buffer_tensor(method, fqn)
            if tensor is None or id(tensor) in done:
                continue
            done.add(id(tensor))
            with torch.no_grad():
                tensor.copy_(info.initial)
            if fqn not in restored:  # methods that do not share it: each reset, listed once
                restored.append(fqn)
    if carried:
        warnings.warn(CarriedStateWarning(list(dict.fromkeys(carried))), stacklevel=2)
    return restored
