"""The two program forms a pass works on, told apart and rendered as text for diffs.

* ``GraphModule`` (``ep.module()``, ``symbolic_trace``, the graph torchao quantizes).
* ``ExportedProgram`` (``torch.export.export``): a graph module, a graph signature and state.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

import torch
from torch.export import ExportedProgram

__all__ = ["EXPORTED_PROGRAM", "GRAPH_MODULE", "graph_module_copy", "graph_module_of",
           "graph_modules", "graph_of", "graphs_text", "modules_of", "node_count", "pass_diff",
           "program_form", "program_text"]

GRAPH_MODULE = "GraphModule"
EXPORTED_PROGRAM = "ExportedProgram"


def program_form(program: Any) -> str:
    if isinstance(program, ExportedProgram):
        return EXPORTED_PROGRAM
    if isinstance(program, torch.fx.GraphModule):
        return GRAPH_MODULE
    raise TypeError("expected a torch.fx.GraphModule or torch.export.ExportedProgram, "
                    f"got {type(program).__name__}")


def graph_module_of(program: Any) -> torch.fx.GraphModule:
    return program.graph_module if isinstance(program, ExportedProgram) else program


def graph_module_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module over a copy of ``gm``'s graph, sharing its submodules, attributes and
    state (``meta`` copied shallowly), to rewrite without touching ``gm``.

    Each node keeps its name: ``copy.deepcopy`` of a graph renames the names Python
    reserves (an input ``input`` becomes ``input_1``, ``list`` ``list_1``), which an
    ExportedProgram's signature still names (``SpecViolationError: Input spec name input
    does not match node name input_1`` once it is checked)."""
    graph = copy.deepcopy(gm.graph)
    for original, node in zip(gm.graph.nodes, graph.nodes, strict=True):
        node.name = original.name
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    return copied


def graph_of(program: Any) -> torch.fx.Graph:
    return graph_module_of(program).graph


def modules_of(gm: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every module under ``gm`` once, by qualified name (``named_modules`` without its
    chain of generators, which costs as much as the rest of a snapshot on deep trees)."""
    found = [("", gm)]
    seen = {id(gm)}
    for prefix, module in found:  # grows while it is walked: breadth first
        for key, sub in module._modules.items():
            if sub is not None and id(sub) not in seen:
                seen.add(id(sub))
                found.append((f"{prefix}.{key}" if prefix else key, sub))
    return found


def graph_modules(program: Any) -> list[tuple[str, torch.fx.GraphModule]]:
    """The program's graph module and those below it (torch.cond's and while_loop's
    branches), by qualified name."""
    return [(name, m) for name, m in modules_of(graph_module_of(program))
            if isinstance(m, torch.fx.GraphModule)]


def node_count(program: Any) -> int:
    return len(graph_of(program).nodes)


def graphs_text(named_graphs: Any) -> str:
    """``(name, graph)`` pairs as text: the top graph (named "") as is, each below it (a
    torch.cond branch) headed by its name."""
    return "".join(f"\n{name}:\n{graph}" if name else str(graph) for name, graph in named_graphs)


def program_text(program: Any) -> str:
    """The program as readable text: its graphs, and for an ExportedProgram its signature."""
    text = graphs_text((name, m.graph) for name, m in graph_modules(program))
    if isinstance(program, ExportedProgram):
        text += "\n" + str(program.graph_signature)
    return text


def pass_diff(before: str, program: Any, pass_name: str) -> str:
    """What pass ``pass_name`` changed: a unified diff from ``before`` (the program's text
    before it) to ``program``, headed ``before NAME`` / ``after NAME``."""
    return "".join(difflib.unified_diff(before.splitlines(keepends=True),
                                        program_text(program).splitlines(keepends=True),
                                        "before " + pass_name, "after " + pass_name))
