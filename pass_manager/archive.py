"""Save a program (either form) to a file and load it back, node meta included; read a
file someone else made without running code from it.

:func:`save_program` picks one of two formats, and says which (:class:`SavedProgram`):

* ``"exported"``: an ExportedProgram ``torch.export.save`` can hold. ``path`` is its
  ``torch.export.save`` archive (graph, signature, call graph, example inputs and the node
  meta torch.export keeps), its tensors replaced by meta-device stand-ins: saving the real
  ones, torch.export.save copies each tensor twice first (measured: a 100 MiB state raised
  the peak memory by 200 MiB). Beside it, :func:`state_file` of ``path`` is a ``torch.save``
  of plain data: the tensors, written from their memory, and every other node meta entry
  that is plain data (the passes' marks and kept initial values, delegation tags), by
  graph module and node name. Meta that is not plain data (torch's ``original_aten``, a
  quantization annotation naming nodes) is left out and listed in
  :attr:`SavedProgram.dropped`. :func:`load_program` reads both without trust, after
  checking that the archive holds nothing that runs code
  (:mod:`pass_manager._archive.untrusted`; ``torch.export.load`` is not safe by itself).
* ``"pickled"``: everything else (a GraphModule; an ExportedProgram holding a delegate call
  or a tensor subclass), with all of its meta: ``torch.save`` with a pickler that knows fx
  (:mod:`pass_manager._archive.pickled`; torch's own pickling of a GraphModule re-traces
  its code and loses the meta). A pickle runs the code it names when read, so
  :func:`load_program` reads one only with ``trusted=True``; without, it raises
  :class:`~pass_manager.errors.UntrustedFileError` naming the file and what would run.

:func:`save_data` / :func:`load_data` do the same for other values (a reproducer's
validation inputs and reference): plain data loads with ``weights_only=True``, anything
else is pickled and needs trust.
"""

from __future__ import annotations

import copy
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ._archive import pickled
from ._archive.untrusted import archive_refusals, graph_refusals, plain_data
from .errors import ArchiveError, UntrustedFileError

__all__ = [
    "EXPORTED",
    "PICKLED",
    "PLAIN",
    "SavedProgram",
    "load_data",
    "load_program",
    "save_data",
    "save_program",
    "state_file",
]

EXPORTED, PICKLED, PLAIN = "exported", "pickled", "plain"
KEPT_BY_TORCH = frozenset(
    {"val", "stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "custom",
     "from_node"}
)
"""Node meta ``torch.export.save`` stores and ``torch.export.load`` restores;
``tensor_meta`` is rebuilt from ``val`` on load."""
_STATE_KEYS = {"state_dict", "constants", "meta", "module_meta", "tensor_meta"}


@dataclass(frozen=True)
class SavedProgram:
    """What :func:`save_program` wrote.

    Attributes:
        path: the file (an exported program also has :func:`state_file` of it).
        format: ``"exported"`` (read without trust) or ``"pickled"`` (read with
            ``trusted=True`` only).
        pickled_because: why the exported format could not hold the program ("" if used).
        dropped: what the loaded program will lack ("meta['key'] (type) of nodes").
    """

    path: Path
    format: str
    pickled_because: str
    dropped: list[str]

    @property
    def needs_trust(self) -> bool:
        return self.format == PICKLED


def state_file(path: str | Path) -> Path:
    """The file holding the tensors and node meta of the exported program at ``path``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.state.pt")


def _graph_modules(gm: torch.fx.GraphModule) -> dict[str, torch.fx.GraphModule]:
    return {path: m for path, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}


def _side_meta(gm: torch.fx.GraphModule) -> tuple[dict, list[str]]:
    """The node and module meta torch.export.save does not keep, as plain data, and
    what is left out."""
    side: dict[str, dict] = {"meta": {}, "module_meta": {}, "tensor_meta": {}}
    left_out: dict[tuple[str, str], list[str]] = {}  # (key, type) -> where
    for path, module in _graph_modules(gm).items():
        for node in module.graph.nodes:
            for key, value in node.meta.items():
                if key == "tensor_meta":
                    side["tensor_meta"].setdefault(path, []).append(node.name)
                elif plain_data(value):
                    if key not in KEPT_BY_TORCH:
                        side["meta"].setdefault(path, {}).setdefault(node.name, {})[key] = value
                elif key not in KEPT_BY_TORCH:
                    where = f"{path}.{node.name}" if path else node.name
                    left_out.setdefault((key, type(value).__name__), []).append(where)
        for key, value in module.meta.items():
            if plain_data(value):
                side["module_meta"].setdefault(path, {})[key] = value
            else:
                left_out.setdefault((key, type(value).__name__), []).append(
                    f"graph module {path or '(root)'}")
    dropped = [f"meta[{key!r}] ({kind}) of {', '.join(names[:4])}"
               + (f" and {len(names) - 4} more" if len(names) > 4 else "")
               for (key, kind), names in left_out.items()]
    return side, dropped


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty


def _save_exported(ep: ExportedProgram, path: Path) -> list[str]:
    """Write ``ep`` in the exported format; raise ValueError with the reason it cannot."""
    for kind, values in (("state", ep.state_dict), ("constant", ep.constants)):
        for name, value in values.items():
            if not (isinstance(value, torch.Tensor) and plain_data(value)):
                raise ValueError(f"{kind} {name!r} is a {type(value).__name__}, not a "
                                 "plain tensor")
    side, dropped = _side_meta(ep.graph_module)
    shell = copy.copy(ep)  # shares the graph; only the state is swapped
    shell._state_dict = {k: _stand_in(v) for k, v in ep.state_dict.items()}
    shell._constants = {k: _stand_in(v) for k, v in ep.constants.items()}
    try:
        with open(path, "wb") as file:  # any name: torch warns about a path not ending .pt2
            torch.export.save(shell, file)
    except Exception as e:  # whatever torch refuses goes to the pickled format
        path.unlink(missing_ok=True)
        raise ValueError(f"torch.export.save cannot hold it ({type(e).__name__}: {e})") from e
    torch.save({"state_dict": dict(ep.state_dict), "constants": dict(ep.constants), **side},
               state_file(path))
    return dropped


def save_program(program: Any, path: str | Path) -> SavedProgram:
    """Write ``program`` (GraphModule or ExportedProgram) to ``path``, in the exported
    format when it can hold the program, else pickled."""
    path = Path(path)
    if not isinstance(program, ExportedProgram):
        because = (f"it is a {type(program).__name__}; torch.export.save holds only an "
                   "ExportedProgram")
    else:
        try:
            return SavedProgram(path, EXPORTED, "", _save_exported(program, path))
        except ValueError as e:
            because = str(e)
    return SavedProgram(path, PICKLED, because, pickled.save(program, path))


def _pickle_refusal(error: Exception) -> str:
    named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if named:
        return (f"it is a pickle that would call {named.group(1)} when read "
                "(torch.load(weights_only=True) refuses it)")
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(error))
    what = f": {found.group(1).strip()}" if found else ""
    return f"it is a pickle, which torch.load(weights_only=True) refuses{what}"


def _read(path: Path, trusted: bool, unpickle: Callable[[Path], Any]) -> tuple[str, Any]:
    """A ``torch.save`` file: (``"plain"``, its data) or, trusted only, (``"pickled"``,
    what ``unpickle`` reads)."""
    try:
        with warnings.catch_warnings():  # a pickled file's protocol 4: refused just below
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return PLAIN, torch.load(str(path), weights_only=True)
    except pickle.UnpicklingError as e:
        if not trusted:
            raise UntrustedFileError(path, PICKLED, _pickle_refusal(e)) from None
    return PICKLED, unpickle(path)


def _is_pt2(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/archive_format") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _load_exported(path: Path, trusted: bool) -> ExportedProgram:
    if not trusted and (refusals := archive_refusals(path)):
        raise UntrustedFileError(path, EXPORTED, "; ".join(refusals))
    state_path = state_file(path)
    if not state_path.exists():
        raise ArchiveError(state_path, f"it is missing; save_program writes it beside {path.name}")
    _, state = _read(state_path, trusted, lambda p: torch.load(str(p), weights_only=False))
    if not (isinstance(state, dict) and set(state) == _STATE_KEYS
            and all(isinstance(v, dict) for v in state.values())):
        raise ArchiveError(state_path, f"it is not the state file save_program writes beside "
                                       f"{path.name}")
    try:
        ep = torch.export.load(str(path))
    except Exception as e:  # torch.export.load on a damaged archive
        raise ArchiveError(path, f"torch.export.load failed: {type(e).__name__}: {e}") from e
    if not trusted and (refusals := graph_refusals(ep)):
        raise UntrustedFileError(path, EXPORTED, "; ".join(refusals))
    for kind, loaded, saved in (("state", ep._state_dict, state["state_dict"]),
                                ("constant", ep._constants, state["constants"])):
        if set(loaded) != set(saved):
            raise ArchiveError(state_path, f"its {kind} names {sorted(saved)}, the program "
                                           f"{sorted(loaded)}")
        loaded.update(saved)
    _restore_meta(ep.graph_module, state, state_path)
    return ep


def _restore_meta(gm: torch.fx.GraphModule, state: dict[str, Any], where: Path) -> None:
    modules = _graph_modules(gm)
    nodes = {(path, n.name): n for path, m in modules.items() for n in m.graph.nodes}
    named = [(path, name) for field in ("meta", "tensor_meta")
             for path, names in state[field].items() for name in names]
    missing = [f"{path}.{name}" if path else name for path, name in named
               if (path, name) not in nodes]
    missing += [f"graph module {path!r}" for path in state["module_meta"] if path not in modules]
    if missing:
        raise ArchiveError(where, f"its meta names what the loaded program lacks: {missing}")
    for path, by_node in state["meta"].items():
        for name, entries in by_node.items():
            nodes[path, name].meta.update(entries)
    for path, entries in state["module_meta"].items():
        for key, value in entries.items():
            modules[path].meta.setdefault(key, value)
    for path, names in state["tensor_meta"].items():
        for name in names:
            value = nodes[path, name].meta.get("val")
            if isinstance(value, torch.Tensor):
                nodes[path, name].meta["tensor_meta"] = _extract_tensor_metadata(value)


def load_program(path: str | Path, *, trusted: bool = False) -> Any:
    """Read a program written by :func:`save_program` (tensors on the CPU as saved).

    Args:
        path: the file.
        trusted: read a pickled file too, which runs code it names: only for a file you
            made or whose source you trust. An exported file is read either way.

    Raises:
        UntrustedFileError: without ``trusted``, the file is pickled or holds something
            that could run code; the message names the file and what.
        ArchiveError: the file is not a program ``save_program`` wrote.
    """
    path = Path(path)
    if _is_pt2(path):
        return _load_exported(path, trusted)
    form, value = _read(path, trusted, pickled.load)
    if form == PLAIN:  # torch.load(weights_only=True) read it: no program
        raise ArchiveError(path, f"it holds a {type(value).__name__}, not a program "
                                 "save_program wrote")
    return value


def save_data(value: Any, path: str | Path) -> str:
    """Write ``value`` to ``path``; return the format: ``"plain"`` (reads with
    ``weights_only=True``) or ``"pickled"`` (reads with ``trusted=True`` only)."""
    if plain_data(value):
        torch.save(value, str(path))
        return PLAIN
    pickled.save(value, path)
    return PICKLED


def load_data(path: str | Path, *, trusted: bool = False) -> Any:
    """Read what :func:`save_data` wrote; a pickled file only with ``trusted``
    (:class:`~pass_manager.errors.UntrustedFileError` otherwise)."""
    return _read(Path(path), trusted, pickled.load)[1]
