"""A view of a program's state shared by every pass: which buffers exist, which are mutated.

Both program forms are covered: in an ExportedProgram buffers are placeholders named in
``graph_signature.inputs_to_buffers`` and a functional update is a ``BUFFER_MUTATION``
output; in a GraphModule buffers are ``get_attr`` nodes and an update is an in-place op on
them (a trailing ``aten.copy_`` write-back included).

``MarkMutableBuffers`` records its findings in node meta; :mod:`passes._analysis.marked_state` reads
them back.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Node

from pass_manager import graph_module_of
from pass_manager.analysis import cached

from .aliasing import Alias, OpaqueNode, alias_map
from .op_schema import written_nodes

__all__ = [
    "BUFFER",
    "CONSTANT",
    "GRID_META",
    "INITIAL_META",
    "LIFTED_GRAPH_HINT",
    "MUTABLE_BUFFER_META",
    "MUTABLE_INPUT_META",
    "MUTATION_OUTPUT_KINDS",
    "PARAMETER",
    "USER_INPUT",
    "Mutations",
    "State",
    "buffer_nodes",
    "buffer_tensor",
    "call_graph_names",
    "find_mutations",
    "hop_operands_written",
    "hop_writes",
    "lifted_state_kind",
    "named_input_specs",
    "named_output_specs",
    "placeholder_specs",
    "rename_call_graph",
    "replace_buffer_tensor",
    "state_nodes",
    "tied_names",
    "trailing_write_backs",
    "user_outputs",
]

MUTABLE_BUFFER_META = "mutable_buffer"
"""``node.meta`` key on a mutated buffer's node; the value is the buffer's FQN."""
MUTABLE_INPUT_META = "mutable_user_input"
"""``node.meta`` key on a mutated user input's placeholder; the value is the input's name."""
INITIAL_META = "mutable_buffer_initial"
"""``node.meta`` key holding the copy of a mutable buffer taken when it was first marked
(for a buffer filled with one value, that value expanded to the buffer's shape)."""

GRID_META = "mutable_buffer_grid"
"""``node.meta`` key on a mutable buffer's node once ``QuantizeMutableBuffers`` stores it as
the integers of a quantization grid; the value is that :class:`~passes._analysis.grids.Grid`."""

BUFFER, USER_INPUT, PARAMETER, CONSTANT = "buffer", "user_input", "parameter", "constant"
MUTATION_OUTPUT_KINDS = {
    OutputKind.PARAMETER_MUTATION: PARAMETER,
    OutputKind.BUFFER_MUTATION: BUFFER,
    OutputKind.USER_INPUT_MUTATION: USER_INPUT,
}
"""The kind of state each mutation output of an ExportedProgram's signature updates."""


@dataclass(frozen=True)
class State:
    """A piece of program state a node denotes: its kind and name (FQN or input name)."""

    kind: str
    name: str


def _resolve_attr(gm: torch.nn.Module, target: str) -> tuple[torch.nn.Module, str, Any]:
    *path, leaf = target.split(".")
    owner = gm
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf, getattr(owner, leaf, None)


def state_nodes(program: Any) -> dict[Node, State]:
    """Every node that denotes program state: buffers, parameters, constants, user inputs."""
    states: dict[Node, State] = {}
    if isinstance(program, ExportedProgram):
        kinds = {
            InputKind.BUFFER: BUFFER,
            InputKind.PARAMETER: PARAMETER,
            InputKind.CONSTANT_TENSOR: CONSTANT,
            InputKind.USER_INPUT: USER_INPUT,
        }
        for node, spec in placeholder_specs(program):
            if spec.kind in kinds:
                name = node.name if spec.kind == InputKind.USER_INPUT else spec.target
                states[node] = State(kinds[spec.kind], name)
        return states
    for node in program.graph.nodes:
        if node.op == "placeholder":
            states[node] = State(USER_INPUT, str(node.target))
        elif node.op == "get_attr":
            try:
                owner, leaf, value = _resolve_attr(program, node.target)
            except AttributeError:
                continue
            if not isinstance(value, torch.Tensor):
                continue
            if leaf in getattr(owner, "_buffers", {}):
                kind = BUFFER
            elif isinstance(value, torch.nn.Parameter):
                kind = PARAMETER
            else:
                kind = CONSTANT
            states[node] = State(kind, node.target)
    return states


# torch.export names each placeholder it lifts from module state by the state's kind.
_LIFTED_PREFIXES = (("b_", BUFFER), ("p_", PARAMETER), ("c_", CONSTANT))

LIFTED_GRAPH_HINT = (
    "the GraphModule of a lifted ExportedProgram (ep.graph_module) has no buffers, only "
    "inputs; pass the ExportedProgram, or ep.module(), for its buffers to be buffers"
)
"""What to do with ``ep.graph_module``: said wherever one of its inputs looks like state."""


def lifted_state_kind(program: Any, node: Node) -> str | None:
    """The kind of state (buffer, parameter, constant) ``node`` stands for when ``program``
    looks like the lifted graph of an ExportedProgram (``ep.graph_module``), else None.

    That graph holds no state of its own: torch.export turned each buffer, parameter and
    constant into a placeholder named ``b_<fqn>``, ``p_<fqn>``, ``c_<fqn>``. Neither the
    graph nor the placeholder keeps more, so the name is the evidence: a GraphModule
    holding no tensors and made by no ``ep.module()`` (whose inputs are the user's).
    """
    if isinstance(program, ExportedProgram) or node.op != "placeholder":
        return None
    if getattr(program, "_in_spec", None) is not None:
        return None
    if next(program.named_buffers(), None) is not None:
        return None
    if next(program.named_parameters(), None) is not None:
        return None
    return next((kind for prefix, kind in _LIFTED_PREFIXES if node.name.startswith(prefix)),
                None)


def placeholder_specs(program: ExportedProgram) -> list[tuple[Node, InputSpec]]:
    """Each placeholder with its input spec, paired by position (the signature's order).

    Not by name: ``copy.deepcopy(ep)`` renames a placeholder called like a Python builtin
    (``input`` -> ``input_1``) and leaves the signature naming the old one.
    """
    placeholders = program.graph.find_nodes(op="placeholder")  # graph order, no full walk
    return list(zip(placeholders, program.graph_signature.input_specs, strict=True))


def named_input_specs(program: ExportedProgram) -> list[InputSpec]:
    """The input specs, each naming its placeholder as the graph now calls it."""
    specs = []
    for node, spec in placeholder_specs(program):
        if isinstance(spec.arg, TensorArgument) and spec.arg.name != node.name:
            spec = dataclasses.replace(spec, arg=TensorArgument(name=node.name))
        specs.append(spec)
    return specs


def named_output_specs(program: ExportedProgram) -> list[OutputSpec]:
    """The output specs, each naming the node the output now returns in its place."""
    values = program.graph.output_node().args[0]
    specs = []
    for spec, value in zip(program.graph_signature.output_specs, values, strict=True):
        if isinstance(value, Node) and isinstance(spec.arg, TensorArgument) and (
                spec.arg.name != value.name):
            spec = dataclasses.replace(spec, arg=TensorArgument(name=value.name))
        specs.append(spec)
    return specs


def user_outputs(program: Any) -> list[Node]:
    """The nodes a program returns to its caller: an ExportedProgram's ``USER_OUTPUT``
    outputs (by its graph signature, not its mutation outputs, which carry state), a
    GraphModule's outputs (its state is written in place, not returned)."""
    returned = pytree.tree_leaves(program.graph.output_node().args[0])
    if isinstance(program, ExportedProgram):
        kinds = [spec.kind for spec in program.graph_signature.output_specs]
        returned = [value for value, kind in zip(returned, kinds, strict=True)
                    if kind == OutputKind.USER_OUTPUT]
    return [value for value in returned if isinstance(value, Node)]


def call_graph_names(program: ExportedProgram) -> set[str]:
    """The values preserved module call signatures name (``preserve_module_call_signature``)."""
    return {arg.name for entry in program.module_call_graph if entry.signature is not None
            for arg in (*entry.signature.inputs, *entry.signature.outputs)
            if hasattr(arg, "name")}


def rename_call_graph(call_graph: list, renames: dict[str, str]) -> list:
    """A copy of ``module_call_graph`` whose signatures name the renamed values' new nodes."""
    call_graph = copy.deepcopy(call_graph)
    for entry in call_graph:
        if entry.signature is not None:
            for arg in (*entry.signature.inputs, *entry.signature.outputs):
                if getattr(arg, "name", None) in renames:
                    arg.name = renames[arg.name]
    return call_graph


def buffer_nodes(program: Any) -> dict[Node, str]:
    """Every buffer node (placeholder in an ExportedProgram, get_attr in a GraphModule) -> FQN."""
    return {node: s.name for node, s in state_nodes(program).items() if s.kind == BUFFER}


def buffer_tensor(program: Any, fqn: str) -> torch.Tensor:
    """The tensor object holding buffer ``fqn`` (shared by the program and its runs)."""
    if isinstance(program, ExportedProgram):
        if fqn in program.state_dict:
            return program.state_dict[fqn]
        return program.constants[fqn]
    return _resolve_attr(program, fqn)[2]


def tied_names(program: Any, fqns: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For each of the buffers ``fqns`` registered as the very tensor of others of them
    (tied: one tensor, several names; ``torch.export`` reads and writes it through one),
    those other names, in the order given."""
    by_tensor: dict[int, list[str]] = {}
    for fqn in fqns:
        by_tensor.setdefault(id(buffer_tensor(program, fqn)), []).append(fqn)
    return {fqn: tuple(n for n in names if n != fqn)
            for names in by_tensor.values() if len(names) > 1 for fqn in names}


def replace_buffer_tensor(program: Any, fqn: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` the program's buffer ``fqn``: a new object in its place (the old one,
    which other programs may share, is left as it is)."""
    if isinstance(program, ExportedProgram):
        held = program.state_dict if fqn in program.state_dict else program.constants
        held[fqn] = tensor
        return
    owner, leaf, _ = _resolve_attr(program, fqn)
    if isinstance(tensor, torch.nn.Parameter) and leaf in owner._parameters:
        owner._parameters[leaf] = tensor  # a written parameter, put back (folding)
        return
    if leaf not in owner._buffers:
        raise KeyError(f"{fqn!r} is not a registered buffer of its module")
    owner._buffers[leaf] = tensor


@dataclass
class Mutations:
    """The result of scanning a program: state nodes, who writes what, what could not be read.

    Attributes:
        states: every node denoting program state.
        writers: per piece of state, the nodes writing it (through any view), in graph order.
        opaque: nodes whose writes cannot be read from a schema.
        aliases: every node's storage root and view chain; the nodes of one piece of state
            share one root (its first node).
        written_roots: every storage root some node writes, state or not.
        writing_nodes: every node that writes one of its arguments, in graph order.
        candidates: every node whose op may write (read from its schema) and every
            higher-order op call, in graph order: the only nodes that can write.
    """

    states: dict[Node, State]
    writers: dict[State, list[Node]]
    opaque: list[OpaqueNode]
    aliases: dict[Node, Alias] = field(default_factory=dict)
    written_roots: set[Node] = field(default_factory=set)
    writing_nodes: list[Node] = field(default_factory=list)
    candidates: list[Node] = field(default_factory=list)

    def nodes_of(self, state: State) -> list[Node]:
        return self._nodes_by_state.get(state, [])

    @functools.cached_property
    def _nodes_by_state(self) -> dict[State, list[Node]]:
        # Built once: asked per written state, a scan of all states each time is quadratic.
        grouped: dict[State, list[Node]] = {}
        for node, state in self.states.items():
            grouped.setdefault(state, []).append(node)
        return grouped


def _subgraph_written(sub: torch.fx.GraphModule) -> list[int] | None:
    """Positions of the subgraph's placeholders it writes (None: it writes something else
    that is not its own: an attribute)."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    aliases, _ = alias_map(sub.graph.nodes)
    roots = set()
    for node in sub.graph.nodes:
        roots.update(aliases[w].root for w in written_nodes(node) if w in aliases)
        nested = hop_operands_written(node, sub)
        roots.update(aliases[w].root for w in nested or () if w in aliases)
    # A tensor the subgraph allocates itself is local: writing it is no program mutation.
    roots = {r for r in roots if r.op != "call_function"}
    if not roots:
        return []
    if not roots <= set(placeholders):
        return None
    return [i for i, p in enumerate(placeholders) if p in roots]


def hop_operands_written(node: Node, gm: torch.nn.Module) -> list[Node] | None:
    """Operands a higher-order op's subgraph writes; the operands follow the subgraph
    argument (``wrap_with_set_grad_enabled(enabled, body, *operands)``)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    written: list[Node] = []
    for k, arg in enumerate(node.args):
        sub = getattr(gm, str(arg.target), None) if isinstance(arg, Node) and (
            arg.op == "get_attr") else None
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        positions = _subgraph_written(sub)
        operands = [a for a in pytree.tree_leaves(node.args[k + 1:]) if not (
            isinstance(a, Node) and a.op == "get_attr"
            and isinstance(getattr(gm, str(a.target), None), torch.fx.GraphModule))]
        if positions is None or any(
            i >= len(operands) or not isinstance(operands[i], Node) for i in positions
        ):
            return None
        written += [operands[i] for i in positions]
    return written


def hop_writes(node: Node, gm: torch.nn.Module) -> OpaqueNode | None:
    """A higher-order op whose subgraph writes: its writes are not rewritten from outside."""
    return _hop_opaque(node, hop_operands_written(node, gm))


def _hop_opaque(node: Node, written: list[Node] | None) -> OpaqueNode | None:
    if written == []:
        return None
    what = "something" if written is None else ", ".join(dict.fromkeys(n.name for n in written))
    hint = ("; write the state outside the branches instead: compute the new value with "
            "torch.where(condition, new, old) (or torch.cond returning it) and write it with "
            "one copy_" if node.target.name() == "cond" else "")
    return OpaqueNode(node, f"higher-order op {node.target.name()} writes {what} inside its "
                            f"subgraph{hint}")


def find_mutations(program: Any) -> Mutations:
    """Scan the graph: every state node, every node writing (through any view) to state.

    The scan is cached (``pass_manager.analysis``) while the graph's nodes and signature
    are unchanged, so MarkMutableBuffers, the MutableBuffersMarked check and
    InplaceToFunctional share one scan. It reads no node meta but ``val``. The result is
    shared: read it, do not change it.
    """
    return cached(program, "find_mutations", _scan_mutations)


def _scan_mutations(program: Any) -> Mutations:
    gm = graph_module_of(program)
    states = state_nodes(program)
    first: dict[State, Node] = {}
    canonical = {node: first.setdefault(state, node) for node, state in states.items()}
    candidates: list[Node] = []  # nodes that may write: most nodes do not
    aliases, opaque = alias_map(gm.graph.nodes, canonical, candidates)
    writers: dict[State, list[Node]] = {}
    written_roots: set[Node] = set()
    writing_nodes: list[Node] = []
    for node in candidates:
        nested = hop_operands_written(node, gm)  # read once: each read re-scans subgraphs
        hop = _hop_opaque(node, nested)
        if hop is not None:
            opaque.append(hop)
        written = written_nodes(node)
        if written:
            writing_nodes.append(node)
            written_roots.update(aliases[w].root for w in written if w in aliases)
        for target in written + (nested or []):
            state = states.get(aliases[target].root) if target in aliases else None
            if state is not None:
                writers.setdefault(state, [])
                if node not in writers[state]:
                    writers[state].append(node)
    if isinstance(program, ExportedProgram):
        outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        by_name = {n.name: n for n in gm.graph.nodes}
        for spec, value in zip(program.graph_signature.output_specs, outputs, strict=True):
            if spec.kind not in MUTATION_OUTPUT_KINDS:
                continue
            state = State(MUTATION_OUTPUT_KINDS[spec.kind], spec.target)
            node = value if isinstance(value, Node) else by_name.get(spec.arg.name)
            writers.setdefault(state, []).append(node)
    return Mutations(states, writers, opaque, aliases, written_roots, writing_nodes, candidates)


def trailing_write_backs(program: Any) -> list[Node]:
    """The ``aten.copy_(state, value)`` nodes right before the output (GraphModule form)."""
    gm = graph_module_of(program)
    found = []
    node = next(n for n in reversed(gm.graph.nodes) if n.op == "output").prev
    while (
        node.op == "call_function"
        and node.target is torch.ops.aten.copy_.default
        and isinstance(node.args[0], Node)
        and node.args[0].op in ("placeholder", "get_attr")
    ):
        found.append(node)
        node = node.prev
    return found[::-1]
