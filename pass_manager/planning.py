"""Planning: order passes by what they require and provide.

Passes and conditions are nodes of one networkx DiGraph: ``pass -> condition`` for what the
pass provides, ``condition -> pass`` for what it requires. The plan is the topological order
of that graph that keeps the user's list order wherever no dependency decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from .conditions import Condition, preserves_of, provides_of, requires_of
from .errors import PipelineElementError, PipelineError

__all__ = ["Plan", "build_plan"]


@dataclass
class Placement:
    """Why a pass sits where it does in the plan."""

    pass_: Any
    listed_at: int
    after: list[tuple[str, str]] = field(default_factory=list)  # (provider name, condition)
    unprovided: list[Condition] = field(default_factory=list)  # required, provided by no pass

    def reason(self) -> str:
        parts = [f"after {provider} (provides {condition})" for provider, condition in self.after]
        parts += [f"requires {condition}: no pass here provides it, checked on the input"
                  for condition in self.unprovided]
        return "; ".join(parts) or "no requirements: kept at its place in the list"


@dataclass
class Plan:
    placements: list[Placement]
    listed: Sequence[Any] = ()  # the passes in the order they were listed

    @property
    def passes(self) -> list[Any]:
        return [p.pass_ for p in self.placements]

    def explain(self) -> str:
        lines = []
        for i, placement in enumerate(self.placements):
            moved = "" if placement.listed_at == i else f" [listed #{placement.listed_at}]"
            p = placement.pass_
            provides = ", ".join(sorted(c.name for c in provides_of(p))) or "-"
            lines.append(f"{i}. {p.name}{moved}: {placement.reason()}; provides {provides}")
        return "\n".join(lines)

    def to_dot(self) -> str:
        """The pass/condition DAG as Graphviz DOT text (built per call: running needs no graph
        when the list order is the plan, and a graph built to order the passes is not kept)."""
        graph = _dependency_graph(self.listed)
        lines = ["digraph passes {", "  rankdir=LR;"]
        for node, data in graph.nodes(data=True):
            shape = "box" if data["kind"] == "pass" else "ellipse"
            lines.append(f'  "{node}" [shape={shape}, label="{data["label"]}"];')
        lines += [f'  "{src}" -> "{dst}";' for src, dst in graph.edges]
        return "\n".join([*lines, "}"]) + "\n"


def _check_condition_names(passes: Sequence[Any]) -> None:
    """Conditions are keyed by name in the plan: one name must mean one condition (and a
    declaration that is not of conditions is named with its pass)."""
    by_name: dict[str, Condition] = {}
    for p in passes:
        declared: set[Condition] = set()
        for kind, read in (("requires", requires_of), ("provides", provides_of),
                           ("preserves", preserves_of)):
            try:
                declared |= read(p)
            except TypeError as e:
                raise PipelineElementError(p.name, "pass", "sets of Condition objects",
                                           f"{p.name}.{kind}: {e}") from None
        for c in declared:
            if by_name.setdefault(c.name, c) is not c:
                raise PipelineError(
                    f"two different Condition objects are named {c.name!r} in one "
                    f"pipeline (the second one is declared by {p.name}); conditions are "
                    "equal only to themselves, so give one of them another name",
                    condition=c.name,
                )


def build_plan(passes: Sequence[Any]) -> Plan:
    """Order ``passes``; raise PipelineError on a cycle, an impossible placement or two
    conditions sharing a name. When every requirement is provided only by passes listed
    before it (most pipelines), the list order is the DAG's order and no graph is built."""
    _check_condition_names(passes)
    providers: dict[Condition, list[int]] = {}
    for index, p in enumerate(passes):
        for c in provides_of(p) - requires_of(p):
            providers.setdefault(c, []).append(index)
    order: Sequence[int] = range(len(passes))
    if any(providers.get(c, [-1])[-1] >= index
           for index, p in enumerate(passes) for c in requires_of(p)):
        order = _topological_order(_dependency_graph(passes))
    placements = []
    for index in order:
        placement = Placement(passes[index], index)
        for c in sorted(requires_of(passes[index]), key=lambda c: c.name):
            if c in providers:  # the order placed every provider before the pass
                placement.after.extend((passes[q].name, c.name) for q in providers[c])
            else:
                placement.unprovided.append(c)
        placements.append(placement)
    return Plan(placements, passes)


def _topological_order(graph: nx.DiGraph) -> list[int]:
    """The passes' list indices in the DAG's order that keeps the list order where it can."""
    if not nx.is_directed_acyclic_graph(graph):
        cycle = [graph.nodes[u]["label"] for u, _ in nx.find_cycle(graph)]
        cycle.append(cycle[0])
        raise PipelineError(
            "pass dependency cycle: " + " -> ".join(cycle)
            + " (each pass requires a condition only a later one in the cycle provides)",
            cycle=cycle,
        )

    def key(node: str) -> tuple[int, int]:
        data = graph.nodes[node]
        # Conditions are released as soon as all their providers are placed.
        return (0, 0) if data["kind"] == "condition" else (1, data["index"])

    return [graph.nodes[n]["index"] for n in nx.lexicographical_topological_sort(graph, key=key)
            if graph.nodes[n]["kind"] == "pass"]


def _dependency_graph(passes: Sequence[Any]) -> nx.DiGraph:
    graph = nx.DiGraph()
    for index, p in enumerate(passes):
        own = f"pass:{index}:{p.name}"
        graph.add_node(own, kind="pass", label=p.name, index=index)
        for c in provides_of(p) | requires_of(p):
            graph.add_node(f"condition:{c.name}", kind="condition", label=c.name)
        graph.add_edges_from((own, f"condition:{c.name}") for c in provides_of(p) - requires_of(p))
        graph.add_edges_from((f"condition:{c.name}", own) for c in requires_of(p))
    return graph
