"""Build and rebuild the ExportedProgram a delegate holds.

A sub-program's signature must agree with its graph: one input spec per placeholder
(in order), one output spec per output. These helpers keep them in step when
``to_delegate`` creates a sub-program and when buffer consumption turns one of its
user inputs into a ``BUFFER`` and one of its outputs into a ``BUFFER_MUTATION``.
Lifted state is placed before user inputs and mutations before user outputs, the
order ``torch.export`` itself produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

__all__ = ["Output", "input_spec", "make_program", "output_spec", "user_input_nodes"]

# An output of a sub-program: the node it returns and the spec describing it.
Output = tuple[torch.fx.Node, OutputSpec]

_LIFTED_ORDER = {
    InputKind.PARAMETER: 0,
    InputKind.BUFFER: 1,
    InputKind.CONSTANT_TENSOR: 2,
    InputKind.USER_INPUT: 3,
}


def input_spec(node: torch.fx.Node, kind: InputKind, target: str | None = None,
               persistent: bool | None = None) -> InputSpec:
    return InputSpec(kind=kind, arg=TensorArgument(name=node.name), target=target,
                     persistent=persistent)


def output_spec(node: torch.fx.Node, kind: OutputKind, target: str | None = None) -> OutputSpec:
    return OutputSpec(kind=kind, arg=TensorArgument(name=node.name), target=target)


def user_input_nodes(program: ExportedProgram) -> list[torch.fx.Node]:
    """The user-input placeholders of ``program``, in order: a delegate call's arguments."""
    kinds = {s.arg.name: s.kind for s in program.graph_signature.input_specs}
    return [n for n in program.graph.nodes
            if n.op == "placeholder" and kinds[n.name] == InputKind.USER_INPUT]


def make_program(
    gm: torch.fx.GraphModule,
    inputs: dict[torch.fx.Node, InputSpec],
    outputs: Sequence[Output],
    state_dict: dict[str, Any],
    constants: dict[str, Any],
    verifiers: Sequence[Any],
    range_constraints: dict[Any, Any] | None = None,
) -> ExportedProgram:
    """Reorder ``gm``'s placeholders and output to match the specs; return the program.

    ``inputs`` maps every placeholder of ``gm`` to its spec; ``outputs`` lists what the
    program returns; ``range_constraints``: those of the program ``gm``'s symbolic shapes
    come from (none by default). The graph is edited in place.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    ordered = sorted(placeholders, key=lambda n: _LIFTED_ORDER[inputs[n].kind])
    # Successive prepends before the first non-placeholder keep `ordered` in order.
    first_other = next(n for n in graph.nodes if n.op != "placeholder")
    for node in ordered:
        first_other.prepend(node)
    mutations = [o for o in outputs if o[1].kind == OutputKind.BUFFER_MUTATION]
    users = [o for o in outputs if o[1].kind != OutputKind.BUFFER_MUTATION]
    outputs = mutations + users
    output_node = graph.output_node()
    output_node.args = (tuple(node for node, _ in outputs),)
    graph.lint()

    user_inputs = [n for n in ordered if inputs[n].kind == InputKind.USER_INPUT]
    signature = ExportGraphSignature(
        input_specs=[inputs[n] for n in ordered],
        output_specs=[spec for _, spec in outputs],
    )
    in_spec = pytree.tree_flatten((tuple(user_inputs), {}))[1]
    out_spec = pytree.tree_flatten(tuple(node for node, _ in users))[1]
    call_graph = [
        ModuleCallEntry(
            "",
            ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec,
                                forward_arg_names=[n.name for n in user_inputs]),
        )
    ]
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=state_dict,
        range_constraints=dict(range_constraints or {}),
        module_call_graph=call_graph,
        constants=constants,
        verifiers=list(verifiers),
    )
