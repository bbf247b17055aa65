"""``to_delegate``: lower each tagged partition of an ExportedProgram into one delegate call.

Before::

    b_cache = placeholder  (BUFFER 'cache')
    x = placeholder        (USER_INPUT)
    index_copy = aten.index_copy(b_cache, 0, pos, x)      # delegation_tag = "delegate_0"
    mul = aten.mul(index_copy, 2)                          # delegation_tag = "delegate_0"
    return (index_copy, mul)                               # BUFFER_MUTATION 'cache', USER_OUTPUT

After::

    lowered_module_0 = get_attr[lowered_module_0]
    call_delegate = higher_order.call_delegate(lowered_module_0, b_cache, x, pos)
    getitem = call_delegate[0]
    getitem_1 = call_delegate[1]
    return (getitem, getitem_1)                            # BUFFER_MUTATION 'cache', USER_OUTPUT

The delegate's sub-program takes every buffer it reads as a user input and returns
every value the rest of the program uses, buffer updates included; the top level keeps
its ``BUFFER_MUTATION`` outputs (ExecuTorch's behaviour before buffer consumption, see
:class:`passes.ConsumeBufferMutationsInDelegate`). Parameters and constant tensors used
only inside one partition move into that delegate's state.

A higher-order op (``map``, ``cond``, ``while_loop``, a grad-mode or autocast region) reads
its bodies through ``get_attr`` nodes naming submodules of the graph module. Lowered, the
op takes those nodes and submodules with it into the sub-program: a body is code, not a
value, so it cannot cross the delegate boundary as an input (torch's verifier would reject
the placeholder, which has no ``val``). A body that nodes outside the partition also call
is read through a second ``get_attr`` of the same submodule. Any other attribute a
partition reads, or a sub-program the verifier still rejects, is a ``PartitionError``
naming the nodes.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch._export.verifier import SpecViolationError
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    TensorArgument,
)
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_as_graphmodule, validate_partition

from pass_manager import graph_module_of

from .._analysis.buffer_conditions import Functional
from .._analysis.buffers import call_graph_names, placeholder_specs, rename_call_graph
from .delegate_runtime import (
    REFERENCE_BACKEND,
    LoweredBackendModule,
    call_delegate,
    is_delegate_call,
    is_delegate_output,
    lowered_module_name,
)
from .errors import DelegationError, PartitionError
from .partitioners import (
    DELEGATION_TAG,
    Partitioner,
    getitems_follow_their_source,
    tagged_partitions,
)
from .subprogram import input_spec, make_program, output_spec

__all__ = ["Delegate", "delegates", "to_delegate"]

_OWNABLE = (InputKind.PARAMETER, InputKind.CONSTANT_TENSOR)


def _with_subgraphs(
    gm: torch.fx.GraphModule, tag: str, nodes: list[torch.fx.Node]
) -> list[torch.fx.Node]:
    """Add the ``get_attr`` nodes of the submodules (higher-order op bodies) the partition
    calls; a body also called from outside the partition gets a ``get_attr`` of its own."""
    members = dict.fromkeys(nodes)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        for attr in [a for a in node.all_input_nodes if a.op == "get_attr" and a not in members]:
            value = _attribute(gm, attr.target)
            if isinstance(value, LoweredBackendModule):
                continue  # _lower_partition refuses it: an earlier lowering's delegate
            if not isinstance(value, torch.nn.Module):
                raise PartitionError(
                    tag,
                    f"node {node.name} reads attribute {attr.target!r} (a "
                    f"{type(value).__name__}, not a submodule), which a delegate's "
                    "sub-program cannot take",
                    [node.name],
                )
            if any(user not in members for user in attr.users):
                if attr not in copies:
                    with gm.graph.inserting_before(node):
                        copies[attr] = gm.graph.get_attr(attr.target)
                    copies[attr].meta = dict(attr.meta)
                node.replace_input_with(attr, copies[attr])
                attr = copies[attr]
            members[attr] = None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(members, key=order.__getitem__)


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _lower_partition(
    ep: ExportedProgram,
    gm: torch.fx.GraphModule,
    tag: str,
    nodes: list[torch.fx.Node],
    index: int,
    backend_id: str,
) -> list[torch.fx.Node]:
    """Replace ``nodes`` by a delegate call; return the top-level placeholders it absorbed."""
    lowered = [n.name for n in nodes if is_delegate_call(n) or is_delegate_output(n)]
    if lowered:
        raise PartitionError(tag, "it contains the results of an earlier lowering", lowered)
    if not validate_partition(nodes):
        raise PartitionError(
            tag,
            "lowering it as one call would create a dependency cycle; a node outside the "
            "partition both uses and feeds it",
            [n.name for n in nodes],
        )
    members = dict.fromkeys(nodes)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    # A parameter the program writes stays top-level state: its PARAMETER_MUTATION output
    # must name a parameter input of the top-level program.
    written = {s.target for s in ep.graph_signature.output_specs
               if s.kind == OutputKind.PARAMETER_MUTATION}
    sub_gm, orig_inputs, orig_outputs = fuse_as_graphmodule(
        gm, nodes, f"delegate_{index}", members, always_return_tuple=True
    )
    sub_placeholders = [n for n in sub_gm.graph.nodes if n.op == "placeholder"]
    inputs, state, constants, call_args, absorbed = {}, {}, {}, [], []
    for ph, orig in zip(sub_placeholders, orig_inputs, strict=True):
        spec = specs.get(orig.name) if orig.op == "placeholder" else None
        if (spec is not None and spec.kind in _OWNABLE and spec.target not in written
                and all(u in members for u in orig.users)):
            inputs[ph] = input_spec(ph, spec.kind, spec.target)
            store = state if spec.kind == InputKind.PARAMETER else constants
            store[spec.target] = (ep.state_dict if spec.kind == InputKind.PARAMETER
                                  else ep.constants)[spec.target]
            absorbed.append(orig)
        else:
            inputs[ph] = input_spec(ph, InputKind.USER_INPUT)
            call_args.append(orig)
    for node in sub_gm.graph.nodes:
        node.meta.pop(DELEGATION_TAG, None)
    returned = sub_gm.graph.output_node().args[0]
    outputs = [(n, output_spec(n, OutputKind.USER_OUTPUT)) for n in returned]
    try:
        program = make_program(sub_gm, inputs, outputs, state, constants, ep.verifiers)
    except SpecViolationError as e:
        raise PartitionError(
            tag, f"its sub-program fails torch's export verifier: {e}", [n.name for n in nodes]
        ) from e

    name = lowered_module_name(gm, index)
    gm.add_submodule(name, LoweredBackendModule(program, tag, backend_id))
    with gm.graph.inserting_after(nodes[-1]):
        attr = gm.graph.get_attr(name)
    with gm.graph.inserting_after(attr):
        call = gm.graph.call_function(call_delegate, (attr, *call_args))
    call.meta["val"] = tuple(o.meta.get("val") for o in orig_outputs)
    anchor = call
    for i, orig in enumerate(orig_outputs):
        with gm.graph.inserting_after(anchor):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta = {k: v for k, v in orig.meta.items() if k != DELEGATION_TAG}
        orig.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        anchor = item
    erase_nodes(gm, nodes)
    for placeholder in absorbed:
        gm.graph.erase_node(placeholder)
    return absorbed


def to_delegate(
    ep: ExportedProgram, partitioner: Partitioner, *, backend_id: str = REFERENCE_BACKEND
) -> ExportedProgram:
    """Lower every partition ``partitioner`` tags into a delegate call; return a new program.

    Args:
        ep: a functional ExportedProgram (buffer updates are ``BUFFER_MUTATION`` outputs,
            as after ``run_decompositions`` or ``InplaceToFunctional``).
        partitioner: a callable that sets ``node.meta["delegation_tag"]`` on the nodes of the
            ExportedProgram it is given (a working copy; ``ep`` itself is not modified).
        backend_id: recorded on each delegate; ``"reference_cpu"`` runs the sub-programs.

    Raises:
        DelegationError: ``ep`` writes state in place (not functional).
        PartitionError: a tagged group cannot be one call (it would create a cycle).
    """
    in_place = Functional.check(ep)
    if in_place:
        raise DelegationError(
            "to_delegate needs a functional program (run MarkMutableBuffers + "
            "InplaceToFunctional, or ep.run_decompositions({}), first); in-place writes:\n  "
            + "\n  ".join(in_place),
            pass_name="to_delegate",
        )
    graph = torch.fx.Graph()
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(ep.graph, copied))
    gm = torch.fx.GraphModule(ep.graph_module, graph)
    gm.meta.update(ep.graph_module.meta)
    # The copy may rename nodes (a user input called ``input`` becomes ``input_1``, as
    # FX keeps builtins' names free), and a deep-copied program may be renamed already:
    # every name of the signatures follows the copy.
    renames = {old.name: new.name for old, new in copied.items() if old.name != new.name}
    for node, spec in placeholder_specs(ep):
        if isinstance(spec.arg, TensorArgument) and spec.arg.name != copied[node].name:
            renames[spec.arg.name] = copied[node].name
    # The partitioner tags a shallow copy sharing everything but the graph module, so
    # ``ep`` keeps its nodes untagged; building a full ExportedProgram here would
    # re-verify and recompile the whole graph for nothing.
    work = copy.copy(ep)
    work._graph_module = gm
    work._graph_signature = _renamed_signature(ep.graph_signature, renames)
    partitioner(work)
    getitems_follow_their_source(gm.graph)
    partitions = tagged_partitions(work)
    kept = _keep_call_graph_values(work, gm, renames)
    absorbed_targets = set()
    specs = {s.arg.name: s for s in work.graph_signature.input_specs if hasattr(s.arg, "name")}
    for index, (tag, nodes) in enumerate(partitions.items()):
        members = _with_subgraphs(gm, tag, nodes)
        for placeholder in _lower_partition(work, gm, tag, members, index, backend_id):
            absorbed_targets.add(specs[placeholder.name].target)
    for old, keeper in kept.items():
        renames[old] = keeper.args[0].name
        gm.graph.erase_node(keeper)
    stable_topological_sort(gm)
    gm.graph.lint()

    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    returned = gm.graph.output_node().args[0]
    output_specs = [
        dataclasses.replace(spec, arg=TensorArgument(name=node.name))
        if isinstance(spec.arg, TensorArgument) else spec
        for spec, node in zip(work.graph_signature.output_specs, returned, strict=True)
    ]
    signature = ExportGraphSignature([specs[name] for name in placeholders], output_specs)
    work._module_call_graph = rename_call_graph(ep.module_call_graph, renames)
    return work._update(
        gm,
        signature,
        state_dict={k: v for k, v in ep.state_dict.items() if k not in absorbed_targets},
        constants={k: v for k, v in ep.constants.items() if k not in absorbed_targets},
    )


def _renamed_signature(
    signature: ExportGraphSignature, renames: dict[str, str]
) -> ExportGraphSignature:
    def rename(spec):
        name = getattr(spec.arg, "name", None)
        if name in renames and isinstance(spec.arg, TensorArgument):
            return dataclasses.replace(spec, arg=TensorArgument(name=renames[name]))
        return spec

    return ExportGraphSignature([rename(s) for s in signature.input_specs],
                                [rename(s) for s in signature.output_specs])


def _keep_call_graph_values(
    ep: ExportedProgram, gm: torch.fx.GraphModule, renames: dict[str, str]
) -> dict[str, torch.fx.Node]:
    """A temporary user outside every partition for each tagged value a preserved module
    call signature names, so lowering returns it from its delegate and the signature can
    name the delegate's output. Keyed by the name the signature uses."""
    by_name = {n.name: n for n in gm.graph.nodes}
    kept = {}
    for name in call_graph_names(ep):
        node = by_name.get(renames.get(name, name))
        if node is not None and DELEGATION_TAG in node.meta and node.op == "call_function":
            with gm.graph.inserting_before(gm.graph.output_node()):
                kept[name] = gm.graph.call_function(_keep, (node,))
    return kept


def _keep(value: Any) -> Any:
    """The target of the temporary nodes of _keep_call_graph_values (never run)."""
    return value


@dataclass
class Delegate:
    """One delegate call of a lowered program."""

    tag: str
    name: str
    module: LoweredBackendModule
    node: torch.fx.Node

    @property
    def program(self) -> ExportedProgram:
        return self.module.program

    @property
    def owned_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers this delegate owns, by fully-qualified name (live tensors)."""
        return self.module.owned_buffers()


def delegates(program: Any) -> list[Delegate]:
    """The delegate calls of an ExportedProgram or GraphModule, in graph order."""
    gm = graph_module_of(program)
    found = []
    for node in gm.graph.nodes:
        if is_delegate_call(node):
            module = gm.get_submodule(node.args[0].target)
            found.append(Delegate(module.tag, node.args[0].target, module, node))
    return found
