"""The exported format: an ExportedProgram in a file read without running code from it.

The file is a ``torch.save`` of plain data (it loads with ``torch.load(weights_only=True)``):

* ``program``: the bytes of ``torch.export.save`` of the program, its tensors replaced by
  meta-device stand-ins. It holds the graph (higher-order op bodies included), signature,
  call graph, range constraints, example inputs and the node meta torch.export keeps
  (:data:`KEPT_BY_TORCH`);
* ``state_dict``, ``constants``: the program's tensors, written by ``torch.save`` straight
  from their memory (``torch.export.save`` copies each tensor into ``bytes`` first, which
  doubles a large model's memory);
* ``meta``: every other node meta entry that is plain data, per graph module and node
  name: the passes' marks (``mutable_buffer``, its kept initial value,
  ``delegation_tag``) travel this way; ``module_meta`` likewise for each graph module;
* ``tensor_meta``: the nodes whose ``meta["tensor_meta"]`` is rebuilt from ``val``.

A node meta entry that is not plain data (torch's bookkeeping such as ``original_aten``,
``eager_input_vals``, ``desc``; a quantization annotation naming nodes; an observer) is
left out and listed, grouped by key: the reproducer's manifest shows the list as
``not_saved``. A program this format cannot hold at all raises :class:`NotExportable` with
the reason: a tensor subclass or non-tensor constant in its state, or a graph
``torch.export.save`` refuses (a delegate call). ``torch.export.load`` gives the operands
of a higher-order op as a list where export gave a tuple; nothing else changes.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from .untrusted import archive_refusals, graph_refusals, plain_data

__all__ = [
    "FORMAT",
    "KEPT_BY_TORCH",
    "Malformed",
    "NotExportable",
    "Refused",
    "is_exported",
    "pack",
    "unpack",
]

FORMAT = "pass_manager.exported_program"
_VERSION = 1
KEPT_BY_TORCH = frozenset(
    {"val", "stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "custom",
     "from_node"}
)
"""Node meta ``torch.export.save`` stores and ``torch.export.load`` restores."""
_REBUILT = "tensor_meta"


class NotExportable(Exception):
    """The program needs the pickled format; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Refused(Exception):
    """The file holds something that is not read without trust; ``reasons`` list it."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class Malformed(Exception):
    """The file is not what :func:`pack` writes (damaged, or made by something else)."""


def _graph_modules(gm: torch.fx.GraphModule) -> dict[str, torch.fx.GraphModule]:
    return {path: m for path, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}


def _side_meta(gm: torch.fx.GraphModule) -> tuple[dict, dict, dict, list[str]]:
    meta: dict[str, dict] = {}
    module_meta: dict[str, dict] = {}
    rebuilt: dict[str, list[str]] = {}
    left_out: dict[tuple[str, str], list[str]] = {}  # (key, type) -> nodes
    for path, module in _graph_modules(gm).items():
        prefix = f"{path}." if path else ""
        for node in module.graph.nodes:
            for key, value in node.meta.items():
                if key in KEPT_BY_TORCH:
                    continue
                if key == _REBUILT:
                    rebuilt.setdefault(path, []).append(node.name)
                elif plain_data(value):
                    meta.setdefault(path, {}).setdefault(node.name, {})[key] = value
                else:
                    left_out.setdefault((key, type(value).__name__), []).append(
                        prefix + node.name)
        for key, value in module.meta.items():
            if plain_data(value):
                module_meta.setdefault(path, {})[key] = value
            else:
                left_out.setdefault((key, type(value).__name__), []).append(
                    f"graph module {path or '(root)'}")
    dropped = [f"meta[{key!r}] ({kind}) of {', '.join(names[:4])}"
               + (f" and {len(names) - 4} more" if len(names) > 4 else "")
               for (key, kind), names in left_out.items()]
    return meta, module_meta, rebuilt, dropped


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty


def pack(ep: ExportedProgram) -> tuple[dict[str, Any], list[str]]:
    """The plain data to ``torch.save`` for ``ep``, and what it leaves out."""
    for kind, values in (("state", ep.state_dict), ("constant", ep.constants)):
        for name, value in values.items():
            if not (isinstance(value, torch.Tensor) and plain_data(value)):
                raise NotExportable(f"{kind} {name!r} is a {type(value).__name__}, not a "
                                    "plain tensor")
    meta, module_meta, rebuilt, dropped = _side_meta(ep.graph_module)
    shell = copy.copy(ep)  # shares the graph; only the state is swapped
    shell._state_dict = {k: _stand_in(v) for k, v in ep.state_dict.items()}
    shell._constants = {k: _stand_in(v) for k, v in ep.constants.items()}
    archive = io.BytesIO()
    try:
        torch.export.save(shell, archive)
    except Exception as e:  # whatever torch refuses goes to the pickled format
        raise NotExportable(f"torch.export.save cannot hold it ({type(e).__name__}: {e})") from e
    container = {
        "format": FORMAT, "version": _VERSION, "program": archive.getvalue(),
        "state_dict": dict(ep.state_dict), "constants": dict(ep.constants),
        "meta": meta, "module_meta": module_meta, "tensor_meta": rebuilt,
    }
    return container, dropped


_FIELDS = {"program": bytes, "state_dict": dict, "constants": dict, "meta": dict,
           "module_meta": dict, "tensor_meta": dict}


def is_exported(container: Any) -> bool:
    return isinstance(container, dict) and container.get("format") == FORMAT


def unpack(container: dict[str, Any], trusted: bool) -> ExportedProgram:
    """The program ``pack`` described. Without trust, the archive and the loaded graphs are
    checked first (:mod:`.untrusted`); :class:`Refused` says what failed."""
    wrong = [f"{k!r} is not a {t.__name__}" for k, t in _FIELDS.items()
             if not isinstance(container.get(k), t)]
    if container.get("version") != _VERSION or wrong:
        raise Malformed("; ".join([f"it is not version {_VERSION} of {FORMAT}", *wrong]))
    if not trusted and (refusals := archive_refusals(container["program"])):
        raise Refused(refusals)
    ep = torch.export.load(io.BytesIO(container["program"]))
    if not trusted and (refusals := graph_refusals(ep)):
        raise Refused(refusals)
    for kind, loaded, saved in (("state", ep._state_dict, container["state_dict"]),
                                ("constant", ep._constants, container["constants"])):
        if set(loaded) != set(saved):
            raise Malformed(f"its {kind} names {sorted(saved)}, its program {sorted(loaded)}")
        loaded.update(saved)
    _restore_meta(ep.graph_module, container)
    return ep


def _restore_meta(gm: torch.fx.GraphModule, container: dict[str, Any]) -> None:
    modules = _graph_modules(gm)
    nodes = {(path, n.name): n for path, m in modules.items() for n in m.graph.nodes}
    named = [(path, name) for field in ("meta", "tensor_meta")
             for path, names in container[field].items() for name in names]
    missing = [f"{path}.{name}" if path else name for path, name in named
               if (path, name) not in nodes]
    missing += [f"graph module {path!r}" for path in container["module_meta"]
                if path not in modules]
    if missing:
        raise Malformed(f"its meta names what the loaded program lacks: {missing}")
    for path, by_node in container["meta"].items():
        for name, entries in by_node.items():
            nodes[path, name].meta.update(entries)
    for path, entries in container["module_meta"].items():
        for key, value in entries.items():
            modules[path].meta.setdefault(key, value)
    for path, names in container["tensor_meta"].items():
        for name in names:
            value = nodes[path, name].meta.get("val")
            if isinstance(value, torch.Tensor):
                nodes[path, name].meta[_REBUILT] = _extract_tensor_metadata(value)
