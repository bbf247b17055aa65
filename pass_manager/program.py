"""The two program forms a pass works on, and what the manager needs to know of them.

* ``GraphModule`` (``ep.module()``, ``symbolic_trace``, the graph torchao quantizes).
* ``ExportedProgram`` (``torch.export.export``): a graph module plus a graph signature
  and a state dict.

This module tells the forms apart, fingerprints a program (a digest for comparing two
programs; the manager measures change against its snapshot instead, see ``snapshot``)
and renders a program as text for diffs.
"""

from __future__ import annotations

import difflib
import hashlib
from typing import Any, NamedTuple

import torch
from torch.export import ExportedProgram

__all__ = [
    "EXPORTED_PROGRAM",
    "GRAPH_MODULE",
    "Fingerprint",
    "fingerprint",
    "graph_module_of",
    "graph_of",
    "modules_of",
    "node_count",
    "program_form",
    "program_text",
    "text_diff",
]

GRAPH_MODULE = "GraphModule"
EXPORTED_PROGRAM = "ExportedProgram"

# Meta entries that describe values or provenance rather than program structure; they
# are costly to hash and no pass's correctness claim depends on their identity.
_UNHASHED_META = frozenset(
    {
        "val",
        "tensor_meta",
        "example_value",
        "stack_trace",
        "nn_module_stack",
        "source_fn_stack",
        "from_node",
        "seq_nr",
        "original_aten",
        "torch_fn",
        "unbacked_bindings",
        "custom",
        "fwd_nn_module_stack",
        "fwd_source_fn_stack",
    }
)


def program_form(program: Any) -> str:
    if isinstance(program, ExportedProgram):
        return EXPORTED_PROGRAM
    if isinstance(program, torch.fx.GraphModule):
        return GRAPH_MODULE
    raise TypeError(
        "expected a torch.fx.GraphModule or torch.export.ExportedProgram, "
        f"got {type(program).__name__}"
    )


def graph_module_of(program: Any) -> torch.fx.GraphModule:
    return program.graph_module if isinstance(program, ExportedProgram) else program


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


def node_count(program: Any) -> int:
    return len(graph_of(program).nodes)


def _meta_token(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor@{id(value)}"
    if isinstance(value, (list, tuple)) and len(value) <= 16:
        return "(" + ",".join(_meta_token(v) for v in value) + ")"
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a meta value whose repr fails still counts as "some object"
        return f"{type(value).__name__}@{id(value)}"


def _tensor_token(t: torch.Tensor) -> str:
    return f"{id(t)}:{t._version}:{tuple(t.shape)}:{t.dtype}"


class Fingerprint(NamedTuple):
    """Digests of a program: ``code`` covers what recompile() depends on, ``state`` the rest."""

    code: str
    state: str


def fingerprint(program: Any) -> Fingerprint:
    """A structural digest: graph (ops, targets, args, meta), module state, signature.

    Two programs with equal fingerprints run the same code on the same state objects.
    Tensor *contents* enter through identity and the in-place version counter, so an
    in-place update of a buffer by a pass is seen without hashing its data.
    """
    gm = graph_module_of(program)
    code = hashlib.blake2b(digest_size=16)
    h = hashlib.blake2b(digest_size=16)
    for node in gm.graph.nodes:
        code.update(f"{node.op}|{node.name}|{node.target}|{node.args}|{node.kwargs}\n".encode())
        meta = ";".join(
            f"{k}={_meta_token(v)}" for k, v in node.meta.items() if k not in _UNHASHED_META
        )
        h.update(f"{node.name}|{meta}\n".encode())
    for name, module in gm.named_modules():
        for key, value in module.__dict__.items():
            if isinstance(value, torch.Tensor):
                h.update(f"{name}.{key}={_tensor_token(value)}\n".encode())
        for kind in ("_buffers", "_parameters"):
            for key, value in getattr(module, kind, {}).items():
                token = _tensor_token(value) if value is not None else "None"
                h.update(f"{name}.{kind}.{key}={token}\n".encode())
        h.update(f"{name}:{type(module).__name__}\n".encode())
    if isinstance(program, ExportedProgram):
        h.update(repr(program.graph_signature).encode())
        for key, value in program.state_dict.items():
            h.update(f"state.{key}={_tensor_token(value)}\n".encode())
        for key, value in program.constants.items():
            token = _tensor_token(value) if isinstance(value, torch.Tensor) else id(value)
            h.update(f"const.{key}={token}\n".encode())
    return Fingerprint(code.hexdigest(), h.hexdigest())


def program_text(program: Any) -> str:
    """The program as readable text: the graph, and for an ExportedProgram its signature."""
    text = str(graph_of(program))
    if isinstance(program, ExportedProgram):
        text += "\n" + str(program.graph_signature)
    return text


def text_diff(
    before: str, after: str, before_name: str = "before", after_name: str = "after"
) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=before_name,
            tofile=after_name,
        )
    )
