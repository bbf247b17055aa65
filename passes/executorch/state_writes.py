"""State written with a value of another dtype or shape: refused before the runtime runs it.

A buffer written whole by ``copy_`` from a value of another dtype or a broadcast shape
(``state.copy_(x * 1.5)`` into int32 state, ``state.copy_(row)`` into a matrix) converts the
value as it writes. torch's functionalization drops that conversion: after
``ep.run_decompositions()`` (a user's own, or the one inside ``to_edge``) the program's
``BUFFER_MUTATION`` output is the unconverted source itself. The runtime helpers convert a
``copy_``'s source before lowering (:func:`passes.executorch.buffer_layout.convert_copy_sources`),
but a program already decomposed has no ``copy_`` left to convert, and ExecuTorch 1.5.1's
runtime then computes silently wrong: a float32 new value of int32 state comes back as the
program's float32 outputs (``2.5`` where eager returns ``2``), a broadcast row is returned
where eager returns the whole matrix, with only ``Tensors do not match`` in the log.

:func:`refuse_mismatched_state_writes` finds every state write (a buffer's, or an input's
written in place) whose new value's dtype or shape is not its state's, and refuses the
program with :class:`~passes.executorch.ExecuTorchInputError` naming the state, the node
and what to do.

State written inside a higher-order op's subgraph (a ``torch.cond`` branch calling
``self.acc.add_(x)``) is exported with no ``BUFFER_MUTATION`` for it, and ExecuTorch 1.5.1's
``to_edge`` fails on it with an untyped ``SpecViolationError: operator 'aten.copy_.default'
is not functional``: :func:`refuse_state_written_in_subgraphs` refuses it before lowering,
naming the node and the fix.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._analysis.buffers import hop_writes
from . import ExecuTorchInputError

__all__ = ["refuse_mismatched_state_writes", "refuse_state_written_in_subgraphs"]

_WRITES = {OutputKind.BUFFER_MUTATION: InputKind.BUFFER,
           OutputKind.USER_INPUT_MUTATION: InputKind.USER_INPUT}


def _same_shape(state: torch.Tensor, value: torch.Tensor) -> bool:
    # A dynamic size counts as equal only where the program proves it is.
    return state.dim() == value.dim() and all(
        statically_known_true(a == b) for a, b in zip(state.shape, value.shape, strict=True))


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def refuse_mismatched_state_writes(ep: ExportedProgram, helper: str,
                                   method: str = "forward") -> None:
    """Refuse ``ep`` if a state's new value differs from the state in dtype or shape.

    Raises:
        ExecuTorchInputError: naming ``helper``, the state (a buffer, or an input written
            in place), the node computing its new value, both dtypes and shapes, and the
            fix: pass the program as exported (the helpers convert a ``copy_`` source), or
            convert in the model (``value.to(state.dtype).expand_as(state)``).
    """
    sig = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    state_inputs = {(spec.kind, spec.target if spec.kind == InputKind.BUFFER else spec.arg.name):
                    spec.arg.name for spec in sig.input_specs if spec.kind in _WRITES.values()}
    returned = ep.graph.output_node().args[0]
    if len(returned) != len(sig.output_specs):  # a serialized program's out-variant graph
        return
    for spec, value in zip(sig.output_specs, returned, strict=True):
        kind = _WRITES.get(spec.kind)
        if kind is None or not isinstance(value, torch.fx.Node):
            continue
        name = state_inputs.get((kind, spec.target))
        state = placeholders[name].meta.get("val") if name in placeholders else None
        new = value.meta.get("val")
        if not isinstance(state, torch.Tensor) or not isinstance(new, torch.Tensor):
            continue
        if state.dtype == new.dtype and _same_shape(state, new):
            continue
        what = f"buffer {spec.target!r}" if kind == InputKind.BUFFER else f"input {spec.target!r}"
        where = "" if method == "forward" else f" of method {method!r}"
        raise ExecuTorchInputError(
            helper, "program", f"{what}{where} ({_describe(state)}) gets the value of node "
            f"{value.name!r} ({_describe(new)}) as its new value: a copy_ whose conversion "
            "torch's decomposition dropped (ep.run_decompositions(), or the one in to_edge); "
            "ExecuTorch's runtime would return silently wrong outputs and state. Pass the "
            "program as torch.export.export returned it (the runtime helpers and "
            "BufferOwningPartitioner convert a copy_'s source themselves), or write "
            "state.copy_(value.to(state.dtype).expand_as(state)) in the model")


# The control-flow ops whose branches or bodies torch's functionalization (in to_edge) does
# not rewrite; a grad-mode region (wrap_with_set_grad_enabled) it inlines.
_CONTROL_FLOW = {"cond", "while_loop", "scan", "map_impl", "associative_scan"}


def refuse_state_written_in_subgraphs(ep: ExportedProgram, helper: str,
                                      method: str = "forward") -> None:
    """Refuse ``ep`` if a control-flow op's subgraph (a ``torch.cond`` branch) writes.

    Raises:
        ExecuTorchInputError: naming ``helper``, the node, what it writes and the fix.
    """
    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(
                node.target, torch._ops.HigherOrderOperator) or \
                node.target.name() not in _CONTROL_FLOW:
            continue
        opaque = hop_writes(node, ep.graph_module)
        if opaque is None:
            continue
        where = "" if method == "forward" else f" of method {method!r}"
        raise ExecuTorchInputError(
            helper, "program", f"node {node.name!r}{where}: {opaque.reason}. torch.export "
            "lists no state write for it, and ExecuTorch's to_edge fails on it "
            "(SpecViolationError: operator 'aten.copy_.default' is not functional)",
            node=node.name)
