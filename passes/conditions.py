"""The built-in conditions of the mutable-buffer passes.

Each is a :class:`pass_manager.Condition`; passes list them in ``requires`` / ``provides``
/ ``preserves`` and the pass manager checks them. Other modules append their own.
"""

from __future__ import annotations

from typing import Any

from torch.export import ExportedProgram

from pass_manager import Condition, graph_module_of, graph_of

from ._aliasing import written_nodes
from ._buffers import (
    BUFFER,
    INITIAL_META,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    USER_INPUT,
    find_mutations,
    hop_writes,
    trailing_write_backs,
)

__all__ = [
    "BufferMutationsInDelegates",
    "DataMovementNotAnnotated",
    "Functional",
    "MutableBuffersMarked",
    "NoFrozenMutableBuffers",
]


def _unmarked_mutable_buffers(program: Any) -> list[str]:
    scan = find_mutations(program)
    violations = []
    for state, writers in scan.writers.items():
        key = {BUFFER: MUTABLE_BUFFER_META, USER_INPUT: MUTABLE_INPUT_META}.get(state.kind)
        if key is None:
            continue
        written_by = ", ".join(n.name for n in writers if n is not None)
        for node in scan.nodes_of(state):
            if node.meta.get(key) != state.name:
                violations.append(
                    f"{node.name}: {state.kind} {state.name!r} is written by {written_by} "
                    f"but not marked (meta[{key!r}])"
                )
            elif state.kind == BUFFER and node.meta.get(INITIAL_META) is None:
                violations.append(f"{node.name}: buffer {state.name!r} has no initial value kept")
    return violations


MutableBuffersMarked = Condition(
    "MutableBuffersMarked",
    _unmarked_mutable_buffers,
    doc="Every buffer the program writes (in place, through views, by a trailing copy_ or a "
    "BUFFER_MUTATION output) has meta['mutable_buffer'] = its FQN and a kept initial value "
    "on each of its nodes; every mutated user input has meta['mutable_user_input'].",
)


def _in_place_writes(program: Any) -> list[str]:
    is_ep = isinstance(program, ExportedProgram)
    allowed = set() if is_ep else set(trailing_write_backs(program))
    violations = []
    for node in graph_of(program).nodes:
        if node in allowed:
            continue
        written = written_nodes(node)
        if written:
            names = ", ".join(n.name for n in written)
            violations.append(f"{node.name}: {node.target} writes its argument(s) {names}")
        elif node.op == "call_method" and str(node.target).endswith("_"):
            violations.append(f"{node.name}: in-place method {node.target!r}")
        elif (hop := hop_writes(node, graph_module_of(program))) is not None:
            violations.append(f"{node.name}: {hop.reason}")
    return violations


Functional = Condition(
    "Functional",
    _in_place_writes,
    doc="No node writes to any of its arguments, except the trailing aten.copy_(state, value) "
    "write-backs of the GraphModule form; state updates of an ExportedProgram are "
    "BUFFER_MUTATION / USER_INPUT_MUTATION outputs.",
)


def _unconsumed_buffer_mutations(program: Any) -> list[str]:
    # Imported here: passes.delegation imports this module for its own conditions.
    from .delegation.ownership import unconsumed_buffer_mutations

    return unconsumed_buffer_mutations(program)


BufferMutationsInDelegates = Condition(
    "BufferMutationsInDelegates",
    _unconsumed_buffer_mutations,
    doc="Every buffer that exactly one delegate mutates, and nothing else reads, is owned by "
    "that delegate: a BUFFER input and BUFFER_MUTATION output of its sub-program, absent "
    "from the top-level signature.",
)


def _annotated_buffer_reads(program: Any) -> list[str]:
    # Imported here: the quantization glue imports torchao, which plain passes do not need.
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    from ._quantization_utils import ANNOTATION_META, DATA_MOVEMENT_OPS, buffer_of

    violations = []
    for node in graph_of(program).nodes:
        annotation = node.meta.get(ANNOTATION_META)
        packet = getattr(node.target, "overloadpacket", None)
        if annotation is None or packet not in DATA_MOVEMENT_OPS:
            continue
        for arg, qspec in annotation.input_qspec_map.items():
            fqn = buffer_of(arg)
            if fqn is not None and qspec is not None and not isinstance(
                qspec, SharedQuantizationSpec
            ):
                violations.append(f"{node.name}: its input {arg.name} (buffer {fqn!r}) has its "
                                  f"own {type(qspec).__name__}")
    return violations


DataMovementNotAnnotated = Condition(
    "DataMovementNotAnnotated",
    _annotated_buffer_reads,
    doc="No data-movement op (index_copy, index_put, copy_, *_scatter, views) reading a marked "
    "mutable buffer carries its own input annotation for it: the buffer is either not "
    "observed or shares the qparams of the value written into it.",
)


def _frozen_buffer_reads(program: Any) -> list[str]:
    from ._quantization_utils import frozen_buffer_reads

    ambiguous: list[str] = []
    found = frozen_buffer_reads(
        graph_module_of(program),
        "NoFrozenMutableBuffers",
        on_ambiguous=lambda node, names: ambiguous.append(
            f"{node.name}: frozen constant {node.target!r} may stand for {', '.join(names)}"
        ),
    )
    return [f"{f.node.name}: frozen constant {f.node.target!r} is a quantized read of "
            f"{f.read.describe()}" for f in found] + ambiguous


NoFrozenMutableBuffers = Condition(
    "NoFrozenMutableBuffers",
    _frozen_buffer_reads,
    doc="No constant that torchao's folding made (_frozen_param*) stands for a read of a "
    "mutable buffer: every read of a buffer reads its current value.",
)
