"""Buffers lowered contiguous: the layout ExecuTorch's runtime runs state in.

A buffer whose tensor is not contiguous (a transposed or permuted registered buffer; state
:class:`passes.InputsToBuffers` made resident from a non-contiguous example input, whose
strides it keeps) fails ExecuTorch 1.5.1's lowering or its runtime:

* not persistent (every buffer InputsToBuffers makes): ``to_edge`` makes the constants it
  finds contiguous, takes the buffer for one, and fails looking for its constant's input
  spec (``RuntimeError: Missing input spec for lifted tensor cache.``);
* channels_last (4-d): kept in that dim order, and the portable kernels that write state
  (``index_put``) take the default order only: the call fails (error ``0x12``).

A persistent buffer of another layout ExecuTorch makes contiguous itself. The values a
program computes do not depend on its buffers' layout, except through an op reading memory
by strides (``as_strided``): so :func:`contiguous_buffers` gives each non-contiguous buffer
of the lowering's private copy contiguous memory (its placeholder's fake value too, from
which ``to_edge`` traces the rest again), and refuses, typed, a buffer such an op reads,
whose layout the device would change (ExecuTorch alone computes it wrong when persistent).

A buffer written whole by ``copy_`` from a value of another dtype or a broadcast shape
(``cache.copy_(x * 1.5)`` into int32 state, ``cache.copy_(row)``) loses the conversion in
torch's functionalization, which makes the source itself the buffer's new value: ExecuTorch
1.5.1's runtime then fails to write it back (``Tensors do not match: dtype={Float, Int}``,
in the log only), the state never changes and the program's outputs come back in the
source's dtype (float32 values ``4.5`` where eager returns int32 ``4``), call after call.
:func:`contiguous_buffers` first converts each such source explicitly
(:func:`convert_copy_sources`): ``copy_`` converts and broadcasts as ``to`` and ``expand``
do, so the runtime then computes what eager does.
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from pass_manager.program import graph_module_copy

from . import NonContiguousStateError

__all__ = ["contiguous_buffers", "convert_copy_sources", "with_converted_copy_sources"]

_aten = torch.ops.aten
# Ops whose result depends on the strides of their input, not on its values alone.
_BY_STRIDES = {_aten.as_strided.default, _aten.as_strided_.default,
               _aten.as_strided_copy.default, _aten.as_strided_scatter.default}


def contiguous_buffers(ep: ExportedProgram, helper: str, method: str = "forward") -> list[str]:
    """Give each non-contiguous buffer of ``ep`` (in place: a private copy) contiguous
    memory; returns a note for each.

    Raises:
        NonContiguousStateError: an op reading memory by strides (``as_strided``) reads
            the buffer, directly or through values computed from it.
    """
    convert_copy_sources(ep)
    sig = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    notes = []
    for name, fqn in sig.inputs_to_buffers.items():
        held = ep.state_dict if fqn in ep.state_dict else ep.constants
        tensor = held.get(fqn)
        node = placeholders[name]
        value = node.meta.get("val")
        if not isinstance(tensor, torch.Tensor) or (tensor.is_contiguous() and (
                not isinstance(value, torch.Tensor) or value.is_contiguous())):
            continue
        # The tensor's strides, or those the program was traced with (InputsToBuffers'
        # initial_values may hold another layout than the example the program saw).
        stride = tuple(tensor.stride() if not tensor.is_contiguous() else value.stride())
        reader = _reader_by_strides(node)
        if reader is not None:
            raise NonContiguousStateError(helper, method, fqn, tuple(tensor.shape), stride,
                                          reader.name, str(reader.target))
        held[fqn] = tensor.contiguous()
        if isinstance(value, torch.Tensor):
            node.meta["val"] = value.contiguous()
        notes.append(f"buffer {fqn!r} (size {tuple(tensor.shape)}, stride {stride}) "
                     "lowered contiguous, as ExecuTorch's runtime "
                     "keeps state; the program computes the same values")
    return notes


def _reader_by_strides(buffer: Node) -> Node | None:
    """A node computing by strides from ``buffer`` or any value computed from it."""
    seen, todo = {buffer}, [buffer]
    while todo:
        for user in todo.pop().users:
            if user.target in _BY_STRIDES:
                return user
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return None


_COPIES = (_aten.copy_.default, _aten.copy.default)


def _converted_source(node: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(dst, src)`` fake values of a ``copy_`` whose source has another dtype or static
    shape than its destination (a conversion functionalization would drop), else None."""
    if node.target not in _COPIES or len(node.args) < 2:
        return None
    dst, src = node.args[0], node.args[1]
    want = dst.meta.get("val") if isinstance(dst, Node) else None
    have = src.meta.get("val") if isinstance(src, Node) else None
    if not isinstance(want, torch.Tensor) or not isinstance(have, torch.Tensor):
        return None
    static = all(isinstance(d, int) for d in (*have.shape, *want.shape))
    if have.dtype == want.dtype and not (static and tuple(have.shape) != tuple(want.shape)):
        return None
    return want, have


def convert_copy_sources(ep: ExportedProgram) -> None:
    """Give each ``copy_(dst, src)`` of ``ep`` (in place: a private copy) whose ``src``
    has another dtype or shape than ``dst`` the source converted and broadcast as
    ``copy_`` does (``_to_copy``, ``expand``), so that no functionalization drops the
    conversion from a buffer's new value."""
    graph = ep.graph
    changed = False
    for node in list(graph.nodes):
        values = _converted_source(node)
        if values is None:
            continue
        want, have = values
        src = node.args[1]
        with graph.inserting_before(node):
            if have.dtype != want.dtype:
                src = graph.call_function(_aten._to_copy.default, (src,),
                                          {"dtype": want.dtype})
                have = have.to(want.dtype)
                src.meta["val"] = have
            static = all(isinstance(d, int) for d in (*have.shape, *want.shape))
            if static and tuple(have.shape) != tuple(want.shape):  # no guard on a symbol
                shape = list(want.shape)
                src = graph.call_function(_aten.expand.default, (src, shape))
                src.meta["val"] = have.expand(shape)
        node.args = (node.args[0], src, *node.args[2:])
        changed = True
    if changed:
        ep.graph_module.recompile()


def with_converted_copy_sources(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` itself, or where a ``copy_`` source needs converting (see
    :func:`convert_copy_sources`) a copy of it converted: the caller's program (a user's,
    lowering by hand) is not edited; its state tensors are shared."""
    if not any(_converted_source(node) is not None for node in ep.graph.nodes):
        return ep
    work = ep._update(graph_module_copy(ep.graph_module), copy.deepcopy(ep.graph_signature))
    convert_copy_sources(work)
    return work
