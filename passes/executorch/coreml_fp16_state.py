"""fp16 state written by index or scatter ops, in a form coremltools 9.0 converts.

coremltools' torch frontend reads each Core ML state (always fp16) and casts it to fp32 at
once ("we convert everything under fp32"), while a value the program casts to fp16 itself
(``x.half()``) stays fp16. Ops that need their destination and their source in one dtype
then fail inside ExecuTorch's ``preprocess`` with a bare ``ValueError`` (``In op, of type
scatter_nd ... updates has dtype fp16 whereas data has dtype fp32``): ``index_copy_``,
``index_put_`` and ``cache[pos] = v`` (scatter_nd), ``scatter_`` (scatter_along_axis),
``cache[3] = v`` (slice_update). Elementwise ops, ``where``, ``cat`` and slice assignment
promote, and convert.

:func:`coreml_fp16_writes` computes each such write of a float16 destination through
float32, ``op(dest.float(), ..., src.float(), ...).half()``: a write that only moves
values (no arithmetic) gives the same fp16 bits, and coremltools sees fp32 on both
sides. Writes that add or reduce (``index_add_``, ``index_put_(accumulate=True)``,
``scatter_add_``, ``scatter_reduce_``) would round once in fp32 instead of once per
addend in fp16; :func:`accumulating_fp16_state_write` names such a write of a state a
Core ML delegate owns, which ``BufferOwningPartitioner`` refuses.

Before (``k`` a float16 buffer)::

    _to_copy = aten._to_copy(x, dtype=torch.float16)
    index_copy = aten.index_copy(b_k, 0, pos, _to_copy)

After::

    dest = aten._to_copy(b_k, dtype=torch.float32)
    source = aten._to_copy(_to_copy, dtype=torch.float32)
    index_copy = aten.index_copy(dest, 0, pos, source)
    index_copy_fp16 = aten._to_copy(index_copy, dtype=torch.float16)
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, OutputSpec, TensorArgument
from torch.fx import Node

from pass_manager.program import graph_module_copy

__all__ = ["accumulating_fp16_state_write", "coreml_fp16_writes"]

# Writes that only move values, by op name: the position of the tensor written.
_MOVING = {
    "index_put": 2, "index_copy": 3, "scatter": 3, "select_scatter": 1, "slice_scatter": 1,
    "diagonal_scatter": 1, "masked_scatter": 2, "as_strided_scatter": 1,
}
# Writes that add or reduce into the destination, by op name: the position of the source.
_ACCUMULATING = {"index_add": 3, "scatter_add": 3, "scatter_reduce": 3}


def _op_name(node: Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if node.op == "call_function" and schema else ""


def _argument(node: Node, name: str, position: int, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


def _accumulates(node: Node) -> bool:
    name = _op_name(node)
    if name == "index_put":
        return bool(_argument(node, "accumulate", 3, False))
    if name == "scatter":  # scatter.reduce (add / multiply); scatter.src and .value move
        return "reduce" in node.kwargs or len(node.args) > 4
    return name in _ACCUMULATING


def _source(node: Node) -> Node | None:
    """The tensor ``node`` writes into its destination (None: a scalar, ``scatter.value``)."""
    name = _op_name(node)
    position = _MOVING.get(name, _ACCUMULATING.get(name))
    if position is None or len(node.args) <= position:
        return None
    value = node.args[position]
    return value if isinstance(value, Node) else None


def _dtype(node: object) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _fp16_write(node: Node) -> bool:
    """A write of a float16 destination from a float16 tensor."""
    return (bool(node.args) and _dtype(node.args[0]) == torch.float16
            and _dtype(_source(node)) == torch.float16)


def _cast(graph: torch.fx.Graph, value: Node, dtype: torch.dtype) -> Node:
    cast = graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": dtype})
    val = value.meta.get("val")
    if isinstance(val, torch.Tensor):
        cast.meta["val"] = val.to(dtype)
    for key in ("stack_trace", "nn_module_stack"):
        if key in value.meta:
            cast.meta[key] = value.meta[key]
    return cast


def coreml_fp16_writes(ep: ExportedProgram) -> ExportedProgram:
    """A copy of ``ep`` writing each float16 destination of a value-moving index or scatter
    op through float32 (same bits; see the module docstring); ``ep`` itself when it has
    none. State tensors are shared with ``ep``, which is not modified."""
    if not any(_fp16_write(n) and not _accumulates(n) and _op_name(n) in _MOVING
               for n in ep.graph.nodes):
        return ep
    gm = graph_module_copy(ep.graph_module)
    graph = gm.graph
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if not (_op_name(node) in _MOVING and _fp16_write(node) and not _accumulates(node)):
            continue
        source = _source(node)
        position = node.args.index(source, 1)
        with graph.inserting_before(node):
            dest = _cast(graph, node.args[0], torch.float32)
            wide = _cast(graph, source, torch.float32)
        node.args = (dest, *node.args[1:position], wide, *node.args[position + 1:])
        node.meta["val"] = node.meta["val"].to(torch.float32)
        with graph.inserting_after(node):
            narrow = _cast(graph, node, torch.float16)
        node.replace_all_uses_with(narrow, delete_user_cb=lambda user: user is not narrow)
        renamed[node.name] = narrow.name
    graph.lint()
    gm.recompile()
    signature = copy.deepcopy(ep.graph_signature)
    outputs = [OutputSpec(spec.kind, TensorArgument(renamed[spec.arg.name]), spec.target)
               if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed else spec
               for spec in signature.output_specs]
    return ep._update(gm, ExportGraphSignature(signature.input_specs, outputs))


def accumulating_fp16_state_write(nodes: list[Node], state: Node) -> Node | None:
    """The first of ``nodes`` (a partition's) adding or reducing a float16 tensor into a
    value read from ``state`` (the placeholder of a float16 buffer the partition owns),
    which coremltools reads as fp32 (see the module docstring)."""
    from_state: set[Node] = {state}
    for node in nodes:
        if node.op != "call_function" or _op_name(node) in ("_to_copy", "_to_dim_order_copy"):
            continue  # an explicit cast gives coremltools the dtype torch has
        if any(value in from_state for value in node.all_input_nodes):
            if _accumulates(node) and _fp16_write(node) and node.args[0] in from_state \
                    and _source(node) not in from_state:
                return node
            from_state.add(node)
    return None
