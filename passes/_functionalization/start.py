"""What the rewrite behind InplaceToFunctional does before its walk.

State-writing grad-mode regions are inlined and metadata mutations become views (both
logged, so they are undone or committed with the rewrite); then the program's state, the
roots to functionalize and its mutation outputs are read from the mutation scan, and
``has_writes`` tells a program with nothing to rewrite. Mixed into ``Rewrite`` beside
``ProgramEnd`` (``end``), which finishes the walk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export.graph_signature import OutputSpec
from torch.fx import Node

from .._analysis.buffers import MUTATION_OUTPUT_KINDS, State, find_mutations, trailing_write_backs
from .._analysis.fake_values import FakeValues
from .._analysis.op_schema import target_of
from .end import fresh_like
from .grad_regions import InlinedRegions, inline_grad_regions
from .metadata_mutations import MetadataMutations, normalize_metadata_mutations

__all__ = ["ProgramStart"]

aten = torch.ops.aten


class ProgramStart:
    """The preparation of a Rewrite (mixed into Rewrite, whose ``gm``, ``graph`` and
    ``is_ep`` it reads)."""

    def _prepare(self, program: Any) -> tuple[InlinedRegions, MetadataMutations]:
        """Inline state-writing grad-mode regions, turn metadata mutations into views and
        read the program's state, roots and outputs from the mutation scan; the logs of the
        first two steps are returned (their changes join the rewrite's undo log)."""
        _repair_use_lists(self.graph)
        # The scan MarkMutableBuffers made (cached), whose candidates (the nodes that may
        # write) are all the two steps below look at. It is taken again only after one of
        # them changed the graph: their undo logs record every change they make.
        scan = find_mutations(program)
        # no_grad regions that write state are inlined first (logged for undo/commit).
        inlined = self.inlined = inline_grad_regions(self.gm, type(self), scan.candidates)
        if inlined.new_nodes or inlined.arg_changes or inlined.dead or (
            inlined.replaced_bodies or inlined.meta_changes
        ):
            scan = find_mutations(program)
        self.fake = FakeValues(self.graph, tensor_meta=True)
        # Metadata mutations become views / renames first (logged for undo/commit too).
        metadata = normalize_metadata_mutations(program, self.gm, self.fake, scan.candidates)
        if metadata.new_nodes or metadata.arg_changes or metadata.dead:
            scan = find_mutations(program)
        self.refused_metadata = metadata.refused
        self.state_views = metadata.state_views
        self.skipped = set(inlined.dead) | set(metadata.dead)
        self.states = scan.states
        self.state_root: dict[State, Node] = {}
        for node, state in self.states.items():
            self.state_root.setdefault(state, node)
        self.aliases = scan.aliases
        self.opaque = {o.node: o.reason for o in scan.opaque}
        self.writing_nodes = scan.writing_nodes
        self.output = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        self.mutation_outputs: list[tuple[State, Any]] = []
        self.other_outputs: list[tuple[OutputSpec, Any]] = []
        if self.is_ep:
            specs = program.graph_signature.output_specs
            for spec, arg in zip(specs, self.output.args[0], strict=True):
                if spec.kind in MUTATION_OUTPUT_KINDS:
                    state = State(MUTATION_OUTPUT_KINDS[spec.kind], spec.target)
                    self.mutation_outputs.append((state, arg))
                else:
                    self.other_outputs.append((spec, arg))
        # A program whose only writes are trailing write-backs is functional already.
        write_backs = set() if self.is_ep else set(trailing_write_backs(program))
        self.roots = {self.state_root[s] for s, _ in self.mutation_outputs} | scan.written_roots
        self.roots |= set(self.state_views)
        self.has_writes = bool(self.skipped) or bool(self.refused_metadata) or any(
            str(n.target).endswith("_") or "writes" in reason
            for n, reason in self.opaque.items() if n not in self.skipped)
        # A whole-state copy as a mutation output is a write to fold away, unless its
        # source is another output too: then it is that output's own value (ProgramEnd).
        returned = set(self.output.all_input_nodes)
        self.has_writes |= any(n not in write_backs for n in scan.writing_nodes) or any(
            isinstance(a, Node) and target_of(a) is aten.copy.default
            and fresh_like(a.args[1], a) and a.args[1] not in returned
            for _, a in self.mutation_outputs)
        return inlined, metadata


def _repair_use_lists(graph: torch.fx.Graph) -> None:
    """Record every use in its input's ``users``: torch.export can leave a graph where a
    node reads an input whose ``users`` misses it (seen around no_grad regions), and
    re-wiring such a node then fails inside FX. Adds bookkeeping only, no graph change."""
    for node in graph.nodes:
        for arg in node._input_nodes:  # all_input_nodes, without building a list per node
            if node not in arg.users:
                arg.users[node] = None
