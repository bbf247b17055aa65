"""``exported_program_from(gm, like=None)``: a graph module back into an ExportedProgram,
without tracing it: the inverse of ``ep.module()`` (``torch.export._unlift``).

``ep.module()`` makes each lifted input a ``get_attr`` and each mutation output a trailing
``copy_``, and keeps the call specs in a pytree codegen. Lifting undoes each step on a copy
of the graph: state reads become placeholders (export's names and order), trailing
write-backs become mutation outputs, the inserted input guard goes, values torchao's
convert left without a fake tensor get one, and torch's own ``ExportedProgram``
constructor (with its verifier) builds the result from those parts.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._export.utils import _rename_without_collisions
from torch._export.verifier import SpecViolationError, TrainingIRVerifier
from torch.export import ExportedProgram
from torch.export._unlift import GuardsFn
from torch.export.graph_signature import (
    ConstantArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    SymBoolArgument,
    SymFloatArgument,
    SymIntArgument,
    TensorArgument,
)
from torch.fx import Graph, GraphModule, Node

from pass_manager.collector import collector_paused

from .._analysis.fake_values import fake_mode_of, fake_state_value, fill_missing_values, storage_key
from ..errors import LiftError
from .calls import call_specs, check_like, module_call_graph, range_constraints
from .state import LiftedState, export_name, graph_state
from .write_backs import WriteBack, check_write_back_values, trailing_writes

__all__ = ["exported_program_from"]

_MUTATION_KINDS = {InputKind.PARAMETER: OutputKind.PARAMETER_MUTATION,
                   InputKind.BUFFER: OutputKind.BUFFER_MUTATION,
                   InputKind.USER_INPUT: OutputKind.USER_INPUT_MUTATION}


def exported_program_from(gm: GraphModule, like: ExportedProgram | None = None) -> ExportedProgram:
    """The ExportedProgram ``torch.export.export`` would give for ``gm``, built without a trace.

    ``gm`` is a graph module of ATen ops whose state is read through ``get_attr`` — what
    ``ep.module()`` gives, and what torchao's ``prepare_pt2e`` / ``convert_pt2e`` return
    from it. Its parameters, buffers and tensor constants become inputs as export lifts
    them (parameters, buffers, constants, each in the order the graph first reads them,
    then the user inputs; named ``p_``/``b_``/``c_`` + FQN); its trailing ``copy_(state,
    value)`` write-backs become the mutation outputs they stand for (``ep.module()`` made
    them from those), so a functional graph gives a functional program. Other in-place
    ops stay as export would leave them. The program shares ``gm``'s tensors, as ``ep``
    and ``ep.module()`` share theirs; ``gm`` itself is not changed.

    Args:
        gm: the graph module.
        like: the program ``gm`` came from (``like.module()``, maybe quantized since): its
            module call graph, example inputs, input names, range constraints and verifier
            are kept. Without it they are rebuilt from ``gm`` (no example inputs; each
            symbolic size ranged as its shape environment bounds it).

    Raises:
        LiftError: naming the node, for what only a trace could lift (a ``call_module``
            or ``call_method``, an op export would decompose, a script-object attribute)
            and for write-backs a mutation output cannot say.

    Example:
        >>> ep = torch.export.export(model, args)
        >>> quantized = convert_pt2e(prepared)           # prepared from ep.module()
        >>> program = exported_program_from(quantized, like=ep)
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"exported_program_from takes a torch.fx.GraphModule, got "
                        f"{type(gm).__name__}")
    if like is not None and not isinstance(like, ExportedProgram):
        raise TypeError(f"like must be an ExportedProgram, got {type(like).__name__}")
    with collector_paused():  # nothing the lift allocates is garbage before it returns
        parts = _program_parts(gm, like)
    try:
        return ExportedProgram(**parts)
    except SpecViolationError as e:
        message = str(e).splitlines()[0]
        raise LiftError(message, _node_named_in(message, parts["graph"])) from e


def _program_parts(gm: GraphModule, like: ExportedProgram | None) -> dict[str, Any]:
    """The finished parts of the program: the lifted graph with a fake value on every
    node, its signature, state, call graph and ranges (``ExportedProgram``'s arguments)."""
    states, state_of = graph_state(gm)
    if like is not None:
        _keep_non_persistent(states, like)
    writes = trailing_writes(gm, state_of)
    inputs = gm.graph.find_nodes(op="placeholder")
    for node in inputs:
        if "val" not in node.meta:
            raise LiftError("the input has no fake value (meta['val']): its shape is known "
                            "only to a trace", node.name)
    source_output = gm.graph.output_node()
    flat_outputs, _ = pytree.tree_flatten(source_output.args[0])
    specs = call_specs(gm, inputs, source_output.args[0])
    if like is not None:
        check_like(specs, like)
    _name_inputs(states, inputs, like)

    mode = fake_mode_of(gm)
    graph = Graph()
    env: dict[Node, Any] = {}
    lifted_state: dict[Node, LiftedState] = {}  # by placeholder: fx may rename an illegal name
    storages = [storage_key(s.value) for s in states]
    tensors_per_storage = Counter(storages)
    for state, storage in zip(states, storages, strict=True):
        shared = storage is None or tensors_per_storage[storage] > 1
        placeholder = _state_placeholder(graph, state, mode, shared)
        lifted_state[placeholder] = state
        env.update(dict.fromkeys(state.nodes, placeholder))
    for node in inputs:
        env[node] = graph.placeholder(node.name, type_expr=node.type)
        env[node].meta = dict(node.meta)
    written = {w.node: w for w in writes}
    skipped = set()
    missing: list[Node] = []  # the copies of the nodes convert left without a fake value
    for node in gm.graph.nodes:
        if node in env or node.op == "output":
            continue
        if node in written:  # its users (outputs returning the state) see the value
            env[node] = env[written[node].value]
        elif node.op == "call_module" and isinstance(
                getattr(gm, str(node.target), None), GuardsFn) and not node.users:
            skipped.add(str(node.target))  # ep.module()'s input guard; the program checks its own
        elif node.op in ("call_module", "call_method"):
            raise LiftError(f"{node.op} {node.target!r}: export would trace into it; "
                            "exported_program_from does not trace", node.name)
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
            if node.op == "call_function" and "val" not in node.meta:
                missing.append(env[node])

    placeholders = {w.target: env[w.target] for w in writes}
    # Mutation outputs come first, in input order (parameters, buffers, user inputs), as
    # run_decompositions orders them and the verifier expects.
    position = {p: i for i, p in enumerate(graph.find_nodes(op="placeholder"))}
    mutations = sorted(writes, key=lambda w: position[placeholders[w.target]])
    user_outputs = [env[o] if isinstance(o, Node) else o for o in flat_outputs]
    values = _own_values(graph, [(w, placeholders[w.target], env[w.value]) for w in mutations],
                         user_outputs, missing)
    output = graph.output(tuple(values + user_outputs))
    output.meta = dict(source_output.meta)

    fill_missing_values(missing, gm, mode)
    check_write_back_values([(w, placeholders[w.target], env[w.value]) for w in mutations])
    signature = ExportGraphSignature(
        [_input_spec(p, lifted_state.get(p)) for p in graph.find_nodes(op="placeholder")],
        [_mutation_spec(w, placeholders[w.target], value, state_of)
         for w, value in zip(mutations, values, strict=True)]
        + [_user_output_spec(o) for o in user_outputs],
    )
    call_graph = module_call_graph(gm, specs, like, graph, skipped)
    shape_env = mode.shape_env
    user_inputs = [env[n] for n in inputs]
    ranges = range_constraints(gm, user_inputs, like, shape_env)
    state_dict = {s.target: s.value for s in states
                  if s.kind == InputKind.PARAMETER or (s.kind == InputKind.BUFFER and s.persistent)}
    constants = {s.target: s.value for s in states if s.target not in state_dict}
    return {
        "root": gm, "graph": graph, "graph_signature": signature, "state_dict": state_dict,
        "range_constraints": ranges, "module_call_graph": call_graph,
        "example_inputs": like.example_inputs if like is not None else None,
        "constants": constants,
        "verifiers": list(like.verifiers) if like is not None else [TrainingIRVerifier],
    }


def _keep_non_persistent(states: list[LiftedState], like: ExportedProgram) -> None:
    """A buffer ``like`` holds as non-persistent (a KV cache registered with
    ``persistent=False``, as HF and ExecuTorch register theirs) stays so: torchao's
    ``prepare_pt2e`` copies the graph module and re-registers every buffer as persistent,
    which would move it from the program's constants into its state dict."""
    non_persistent = set(like.graph_signature.non_persistent_buffers)
    for state in states:
        if state.kind == InputKind.BUFFER and state.target in non_persistent:
            state.persistent = False


def _own_values(graph: Graph, mutations: list[tuple[WriteBack, Node, Node]],
                user_outputs: list[Any], missing: list[Node]) -> list[Node]:
    """Each mutation output's value, each its own: one value written back into several
    pieces of state (``a.copy_(v); b.copy_(v)``), or also returned, is copied
    (``aten.copy(state, value)``) for every write-back after its first use, as
    InplaceToFunctional makes it. torch's signature keys mutations by output name, so a
    node standing for two would collapse into one and fail the verifier; the new copies
    join ``missing`` to get their fake values."""
    taken = {o for o in user_outputs if isinstance(o, Node)}
    values = []
    for write, target, value in mutations:
        if value in taken:
            copy = graph.call_function(torch.ops.aten.copy.default, (target, value))
            copy.meta.update((k, v) for k, v in write.node.meta.items()
                             if k not in ("val", "tensor_meta"))
            missing.append(copy)
            value = copy
        taken.add(value)
        values.append(value)
    return values


def _name_inputs(states: list[LiftedState], inputs: list[Node], like: ExportedProgram | None
                 ) -> None:
    """Export's placeholder names: user inputs keep theirs and win collisions, then each
    piece of state is named as ``like`` named it, or by export's rule."""
    names_in_like = {}
    if like is not None:
        names_in_like = {spec.target: spec.arg.name for spec in like.graph_signature.input_specs
                         if spec.target is not None and hasattr(spec.arg, "name")}
    name_map: dict[str, str] = {}
    available: defaultdict[str, int] = defaultdict(int)
    used: set[str] = set()
    for node in inputs:
        _rename_without_collisions(name_map, available, used, node.name, node.name,
                                   is_placeholder=True)
    for state in states:
        wanted = names_in_like.get(state.target) or export_name(state.kind, state.target)
        state.name = _rename_without_collisions(name_map, available, used, state.target,
                                                wanted, is_placeholder=True)


def _state_placeholder(graph: Graph, state: LiftedState, mode: Any, shares_storage: bool
                       ) -> Node:
    node = graph.placeholder(state.name)
    for read in state.nodes:  # marks (MarkMutableBuffers') may sit on any of the reads
        for key, value in read.meta.items():
            node.meta.setdefault(key, value)
    if "val" not in node.meta:
        node.meta["val"] = fake_state_value(mode, state.value, shares_storage)
    return node


def _argument(node: Any, name: str | None = None) -> Any:
    """The signature argument for a graph value, as export types it."""
    if isinstance(node, Node):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return SymIntArgument(name=node.name)
        if isinstance(val, torch.SymFloat):
            return SymFloatArgument(name=node.name)
        if isinstance(val, torch.SymBool):
            return SymBoolArgument(name=node.name)
        if isinstance(val, torch.Tensor):
            return TensorArgument(name=node.name)
        if val is None or isinstance(val, (int, float, bool, str)):
            return ConstantArgument(name=node.name, value=val)
        raise LiftError(f"a value of type {type(val).__name__} has no signature argument",
                        node.name)
    return ConstantArgument(name=name or "", value=node)


def _input_spec(node: Node, state: LiftedState | None) -> InputSpec:
    if state is None:
        return InputSpec(InputKind.USER_INPUT, _argument(node), target=None)
    return InputSpec(state.kind, TensorArgument(name=node.name), target=state.target,
                     persistent=state.persistent)


def _mutation_spec(write: WriteBack, target: Node, value: Node,
                   state_of: dict[Node, LiftedState]) -> OutputSpec:
    state = state_of.get(write.target)
    kind = state.kind if state is not None else InputKind.USER_INPUT
    name = state.target if state is not None else target.name
    return OutputSpec(_MUTATION_KINDS[kind], TensorArgument(name=value.name), target=name)


def _user_output_spec(value: Any) -> OutputSpec:
    return OutputSpec(OutputKind.USER_OUTPUT, _argument(value), target=None)


def _node_named_in(message: str, graph: Graph) -> str | None:
    """The node a verifier message is about: one it names, or whose operator it names."""
    names = {node.name for node in graph.nodes}
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message):
        if word in names:
            return word
    for node in graph.nodes:
        if node.op == "call_function" and f"'{node.target}'" in message:
            return node.name
    return None
