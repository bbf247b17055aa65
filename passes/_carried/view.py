"""A program's call signature, flat, in either form: a private copy the carried-state passes
rewrite, then build into a new program of the same form.

* ExportedProgram: user inputs are the ``USER_INPUT`` placeholders, an in-place mutation of one
  is a ``USER_INPUT_MUTATION`` output, user outputs the ``USER_OUTPUT`` outputs; state is
  ``BUFFER`` placeholders and ``BUFFER_MUTATION`` outputs. The new program is built by
  ``ExportedProgram``'s own constructor (its verifier runs), with its signature, call specs
  (``module_call_graph``), example inputs and constants made to agree.
* GraphModule (``ep.module()``): every placeholder is an input, an in-place mutation a
  trailing ``copy_(input, value)``; a buffer is a ``get_attr`` and its update a trailing
  ``copy_(buffer, value)``. The pytree codegen (``_in_spec`` / ``_out_spec``) keeps the specs.

Nothing of the source program is changed: the graph is copied, tensors are shared.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import GraphModule, Node
from torch.fx.graph import _PyTreeCodeGen

from pass_manager.program import graph_module_copy

from .._analysis.buffers import (
    MUTATION_OUTPUT_KINDS,
    named_input_specs,
    named_output_specs,
    trailing_write_backs,
)

__all__ = ["ProgramView", "graph_module_io"]


def _copy_graph_module(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` (its class, hooks, specs, submodules) sharing every tensor."""
    memo: dict[int, Any] = {}
    for module in gm.modules():
        for value in (*module._parameters.values(), *module._buffers.values(),
                      *vars(module).values()):
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
    return copy.deepcopy(gm, memo)


def graph_module_io(
    gm: GraphModule,
) -> tuple[list[Node], list[Any], pytree.TreeSpec, pytree.TreeSpec]:
    """A GraphModule's inputs and outputs flat, with the call specs that nest them (its
    pytree codegen's, or a flat tuple in and the output's own structure out)."""
    inputs = gm.graph.find_nodes(op="placeholder")
    output = gm.graph.output_node().args[0]
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info.out_spec is not None:
        outputs = list(output) if isinstance(output, (list, tuple)) else [output]
        return inputs, outputs, codegen.pytree_info.in_spec, codegen.pytree_info.out_spec
    outputs, out_spec = pytree.tree_flatten(output)
    return inputs, outputs, pytree.tree_structure((tuple(inputs), {})), out_spec


@dataclass
class ProgramView:
    """The flat call signature and state writes of a private copy of a program.

    Attributes:
        source: the program it copies.
        gm: the copy's graph module (rewritten in place by the passes).
        inputs: the user input placeholders, in flat call order.
        outputs: the flat user outputs (nodes or constants), in call order.
        in_spec, out_spec: the ``(args, kwargs)`` and output pytree specs.
        writes: every written piece of state (a user input's placeholder; a buffer's or
            parameter's placeholder (EP) or get_attr (GM)) -> the value written into it.
            On a GraphModule its trailing ``copy_`` nodes are taken out and put back by
            :meth:`build`, in this order.
        specs: (EP) every placeholder's input spec.
        constants: (EP) the program's constants, new non-persistent buffers included.
    """

    source: Any
    gm: GraphModule
    inputs: list[Node]
    outputs: list[Any]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    writes: dict[Node, Node]
    specs: dict[Node, InputSpec] = field(default_factory=dict)
    constants: dict[str, Any] = field(default_factory=dict)

    @property
    def exported(self) -> bool:
        return isinstance(self.source, ExportedProgram)

    @classmethod
    def of(cls, program: Any) -> ProgramView:
        if isinstance(program, ExportedProgram):
            return cls._of_exported(program)
        return cls._of_graph_module(program)

    @classmethod
    def _of_exported(cls, ep: ExportedProgram) -> ProgramView:
        gm = graph_module_copy(ep.graph_module)
        placeholders = gm.graph.find_nodes(op="placeholder")
        specs = dict(zip(placeholders, named_input_specs(ep), strict=True))
        inputs = [p for p, s in specs.items() if s.kind == InputKind.USER_INPUT]
        # By kind and name: a buffer and a user input may share a name (buffer ``x``,
        # input ``x``), and a mutation output names which one it writes by its kind.
        by_state = {(s.kind, s.target if s.kind != InputKind.USER_INPUT else p.name): p
                    for p, s in specs.items()}
        values = list(gm.graph.output_node().args[0])
        outputs, writes = [], {}
        for spec, value in zip(named_output_specs(ep), values, strict=True):
            if spec.kind == OutputKind.USER_OUTPUT:
                outputs.append(value)
            elif spec.kind in MUTATION_OUTPUT_KINDS:
                writes[by_state[_INPUT_KINDS[spec.kind], spec.target]] = value
            else:
                raise NotImplementedError(f"output kind {spec.kind.name}")
        signature = ep.call_spec
        return cls(ep, gm, inputs, outputs, signature.in_spec, signature.out_spec, writes,
                   specs, dict(ep.constants))

    @classmethod
    def _of_graph_module(cls, source: GraphModule) -> ProgramView:
        gm = _copy_graph_module(source)
        inputs, outputs, in_spec, out_spec = graph_module_io(gm)
        writes = {}
        for copy_ in trailing_write_backs(gm):
            writes[copy_.args[0]] = copy_.args[1]
            gm.graph.erase_node(copy_)
        return cls(source, gm, inputs, outputs, in_spec, out_spec, writes)

    def arg_names(self) -> list[str] | None:
        """The forward's argument names: the root call signature's ``forward_arg_names``
        (ExportedProgram), the pytree codegen's ``orig_args`` (GraphModule)."""
        if not self.exported:
            codegen = self.gm.graph._codegen
            return list(codegen.pytree_info.orig_args) if isinstance(
                codegen, _PyTreeCodeGen) else None
        root = next((e for e in self.source.module_call_graph if e.fqn == ""), None)
        return None if root is None or root.signature is None else (
            root.signature.forward_arg_names)

    # -- building the result ----------------------------------------------------------
    def build(self, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
              example_inputs: Any = None, arg_names: list[str] | None = None) -> Any:
        """The program of the copy's graph with the given call specs (and, for an
        ExportedProgram, example inputs and forward argument names)."""
        if self.exported:
            return self._build_exported(in_spec, out_spec, example_inputs, arg_names)
        return self._build_graph_module(in_spec, out_spec, arg_names)

    def _build_graph_module(self, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
                            arg_names: list[str] | None) -> GraphModule:
        gm, graph = self.gm, self.gm.graph
        output = graph.output_node()
        with graph.inserting_before(output):
            for target, value in self.writes.items():
                write = graph.call_function(torch.ops.aten.copy_.default, (target, value))
                if "val" in value.meta:
                    write.meta["val"] = value.meta["val"]
        codegen = graph._codegen
        if isinstance(codegen, _PyTreeCodeGen):
            output.args = (tuple(self.outputs) if isinstance(output.args[0], tuple)
                           else list(self.outputs),)
            codegen.pytree_info = codegen.pytree_info._replace(
                orig_args=arg_names, in_spec=in_spec, out_spec=out_spec)
            if hasattr(gm, "_in_spec"):
                gm._in_spec = in_spec
            if hasattr(gm, "_out_spec"):
                gm._out_spec = out_spec
        else:
            output.args = (pytree.tree_unflatten(list(self.outputs), out_spec),)
        gm.recompile()
        return gm

    def _build_exported(self, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
                        example_inputs: Any, arg_names: list[str] | None) -> ExportedProgram:
        ep, graph = self.source, self.gm.graph
        placeholders = graph.find_nodes(op="placeholder")
        position = {p: i for i, p in enumerate(placeholders)}
        mutations = []
        for target, value in sorted(self.writes.items(), key=lambda w: position[w[0]]):
            spec = self.specs[target]
            kind = _MUTATION_KINDS[spec.kind]
            name = target.name if spec.kind == InputKind.USER_INPUT else spec.target
            mutations.append((value, OutputSpec(kind, TensorArgument(value.name), target=name)))
        user_outputs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name)
                                   if isinstance(o, Node) else ConstantArgument("", o),
                                   target=None) for o in self.outputs]
        graph.output_node().args = (tuple([m[0] for m in mutations] + list(self.outputs)),)
        self.gm.recompile()
        signature = ExportGraphSignature(
            [_named(self.specs[p], p) for p in placeholders],
            [m[1] for m in mutations] + user_outputs)
        # State that became an input leaves the state dict and constants: kept, it would be
        # saved and lowered for nothing (a whole KV cache), and a buffer of the same name
        # made again (InputsToBuffers after BuffersToInputs) would collide with it.
        gone = ({s.target for s in ep.graph_signature.input_specs if s.target}
                - {s.target for s in signature.input_specs if s.target})
        return ExportedProgram(
            root=self.gm, graph=graph, graph_signature=signature,
            state_dict={k: v for k, v in ep.state_dict.items() if k not in gone},
            range_constraints=ep.range_constraints,
            module_call_graph=_call_graph(ep, in_spec, out_spec, arg_names),
            example_inputs=example_inputs,
            constants={k: v for k, v in self.constants.items() if k not in gone},
            verifiers=list(ep.verifiers))


_MUTATION_KINDS = {InputKind.PARAMETER: OutputKind.PARAMETER_MUTATION,
                   InputKind.BUFFER: OutputKind.BUFFER_MUTATION,
                   InputKind.USER_INPUT: OutputKind.USER_INPUT_MUTATION}
_INPUT_KINDS = {output: kind for kind, output in _MUTATION_KINDS.items()}


def _named(spec: InputSpec, node: Node) -> InputSpec:
    """``spec`` naming ``node`` as the graph now calls it."""
    if isinstance(spec.arg, TensorArgument) and spec.arg.name != node.name:
        return dataclasses.replace(spec, arg=TensorArgument(name=node.name))
    return spec


def _call_graph(ep: ExportedProgram, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
                arg_names: list[str] | None) -> list:
    """``ep``'s module call graph with the root's signature taking the new call specs."""
    entries = []
    for entry in ep.module_call_graph:
        if entry.fqn == "" and entry.signature is not None:
            signature = dataclasses.replace(entry.signature, in_spec=in_spec, out_spec=out_spec,
                                            forward_arg_names=arg_names)
            entry = dataclasses.replace(entry, signature=signature)
        entries.append(entry)
    return entries
