"""float16 state in a form coremltools 9.0 converts: read it as float16 explicitly.

coremltools' torch frontend reads each Core ML state (always fp16) and casts it to fp32 at
once ("we convert everything under fp32"), while a value the program casts to fp16 itself
(``x.half()``) stays fp16. An fp16 buffer written from such a value by an op that needs its
destination and its source in one dtype then fails inside ExecuTorch's ``preprocess`` with
a bare ``ValueError`` (``In op, of type scatter_nd ... updates has dtype fp16 whereas data
has dtype fp32``): ``index_copy_``, ``index_put_``, ``index_add_`` and ``cache[pos] = v``
(scatter_nd), ``scatter_`` (scatter_along_axis), ``cache[3] = v`` (slice_update).
Elementwise ops, ``where``, ``cat`` and slice assignment promote, and convert.

:func:`coreml_fp16_state_reads` makes every read of a written float16 buffer go through
``buffer.float().half()``: the same bits in torch (fp16 -> fp32 -> fp16 is exact), and
in Core ML a cast to fp16 after the frontend's cast to fp32 (coremltools drops a cast to
the dtype torch already has, not this one), so the state is fp16 wherever it is used, as
in torch, and the ops compute in the program's dtype (an ``index_add_`` adds in fp16). On
the device Core ML merges the casts.

Before (``k`` a written float16 buffer)::

    index_copy = aten.index_copy(b_k, 0, pos, _to_copy)   # _to_copy: x.half()

After::

    b_k_wide = aten._to_copy(b_k, dtype=torch.float32)
    b_k_fp16 = aten._to_copy(b_k_wide, dtype=torch.float16)
    index_copy = aten.index_copy(b_k_fp16, 0, pos, _to_copy)
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from pass_manager.program import graph_module_copy

__all__ = ["coreml_fp16_state_reads"]


def _written_fp16_state(ep: ExportedProgram) -> list[str]:
    """The placeholders of written float16 buffers that something reads."""
    sig = ep.graph_signature
    written = set(sig.buffers_to_mutate.values())
    names = {name for name, fqn in sig.inputs_to_buffers.items() if fqn in written}
    found = []
    for node in ep.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if (node.name in names and node.users and isinstance(value, torch.Tensor)
                and value.dtype == torch.float16):
            found.append(node.name)
    return found


def _cast(graph: torch.fx.Graph, value: Node, dtype: torch.dtype) -> Node:
    cast = graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": dtype})
    cast.meta["val"] = value.meta["val"].to(dtype)
    return cast


def coreml_fp16_state_reads(ep: ExportedProgram) -> ExportedProgram:
    """A copy of ``ep`` reading each written float16 buffer through ``.float().half()``
    (same bits; see the module docstring); ``ep`` itself when it has none. State tensors
    are shared with ``ep``, which is not modified."""
    names = set(_written_fp16_state(ep))
    if not names:
        return ep
    gm = graph_module_copy(ep.graph_module)
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    last = placeholders[-1]  # the casts go after every placeholder, which come first
    for state in placeholders:
        if state.name not in names:
            continue
        with graph.inserting_after(last):
            wide = _cast(graph, state, torch.float32)
        with graph.inserting_after(wide):
            narrow = _cast(graph, wide, torch.float16)
        # A placeholder returned as it is stays so: the signature names it.
        for user in [u for u in state.users if u is not wide and u.op != "output"]:
            user.replace_input_with(state, narrow)
        last = narrow
    graph.lint()
    gm.recompile()
    return ep._update(gm, copy.deepcopy(ep.graph_signature))
