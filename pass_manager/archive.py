"""Save a program (either form) or a reproducer's data to a file and load it back, node
meta included (docs/debugging.md describes the files).

* ``"exported"``: an ExportedProgram ``torch.export.save`` can hold is its archive with
  meta-device stand-ins for the tensors (torch.export.save copies real ones twice), beside
  :func:`state_file`: plain data holding the tensors and the node meta torch.export does
  not keep. Read without trust once :mod:`._untrusted` has checked the archive.
* ``"pickled"``: anything else, all node meta kept, by torch's fx-aware ``GraphPickler``
  under ``torch.save`` (tensor data written from memory). Read only with ``trusted=True``.

The safety rule: without ``trusted=True`` nothing read runs code from the file; a refusal
is an :class:`~pass_manager.errors.UntrustedFileError` naming the file and the reason.
"""

from __future__ import annotations

import contextvars
import copy
import io
import pickle
import re
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import ExportedProgram
from torch.export.pt2_archive import is_pt2_package
from torch.fx import GraphModule, Node
from torch.fx._graph_pickler import GraphPickler, Options, _OpPickleData, _UnpickleState
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ._untrusted import archive_refusals, graph_refusals, plain_data
from .errors import ArchiveError, UntrustedFileError
from .program import graph_modules

__all__ = ["EXPORTED", "PICKLED", "PLAIN", "SavedProgram", "load_data", "load_program",
           "save_data", "save_program", "state_file"]

EXPORTED, PICKLED, PLAIN = "exported", "pickled", "plain"
# Node meta torch.export.save keeps (``tensor_meta`` is rebuilt from ``val`` on load).
KEPT_BY_TORCH = frozenset({"val", "stack_trace", "nn_module_stack", "source_fn_stack",
                           "torch_fn", "custom", "from_node"})
_STATE_KEYS = {"state_dict", "constants", "meta", "module_meta", "tensor_meta"}


@dataclass(frozen=True)
class SavedProgram:
    """What :func:`save_program` wrote: ``path``, its ``format`` (``"exported"`` or
    ``"pickled"``), why the exported format could not hold the program
    (``pickled_because``, "" if used) and what the loaded program will lack
    (``dropped``: "meta['key'] (type) of nodes")."""

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


# The pickled format ------------------------------------------------------------------

_unpickling: contextvars.ContextVar[_UnpickleState] = contextvars.ContextVar("_unpickling")


def _unpickle_state() -> _UnpickleState:
    return _unpickling.get()


class _OnLoad:
    """Pickles as a call of ``function(*args)`` when loaded."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.reduced = function, args

    def __reduce__(self) -> tuple:
        return self.reduced


class _Pickler(GraphPickler):
    """GraphPickler for torch.save: every operator and meta key kept; a node named in meta
    (a quantization annotation's key) found by name in its loaded graph; a value that
    cannot be pickled left out and listed in ``dropped``. Pickles with protocol 4."""

    dropped: ClassVar[list[str]]  # torch.save builds the pickler: one class per file

    def __init__(self, file: Any, protocol: int | None = None) -> None:
        super().__init__(file, Options(ops_filter=None, node_metadata_key_filter=None))
        # GraphPickler passes this by a persistent id, which torch.save's pickler takes over.
        self._unpickle_state = _OnLoad(_unpickle_state)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Node):
            return _node, (obj.name,)
        if not isinstance(obj, GraphModule):
            return super().reducer_override(obj)
        # GraphPickler names only torch's and the standard library's functions; a function
        # of the user's (``fx.wrap``) is pickled by reference beside the graph.
        own = {node: node.target for node in obj.graph.nodes
               if node.op == "call_function" and not _named_by_torch(node.target)}
        for node in own:
            node.target = print  # a stand-in GraphPickler names, never called: replaced on load
        try:
            _, (data, state) = super().reducer_override(obj)
        finally:
            for node, target in own.items():
                node.target = target
            if own:
                obj.recompile()
        attributes = {}
        for key, value in data.gm_dict.items():
            if isinstance(value, types.MethodType) and value.__self__ is obj:
                # ep.module() binds train/eval to the module: a cycle pickle cannot store.
                self.dropped.append(f"GraphModule attribute[{key!r}] (method of the module)")
            else:
                attributes[key] = value
        data.gm_dict = _kept(attributes, "GraphModule attribute", self.dropped)
        meta = {}
        for node in data.graph.nodes:
            meta[node.name] = _kept(node.meta, f"{node.name}.meta", self.dropped)
            node.meta = {}
        # The meta as the state: unpickled once the graph exists, names found in it.
        targets = {node.name: target for node, target in own.items()}
        return (_graph_module, (data, state), (_OnLoad(_within, obj), meta, targets), None,
                None, _set_meta)


class _Checker(_Pickler):
    """Pickles to nowhere, tensor data and nodes by id only: can a value be pickled?"""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.dropped = []

    def persistent_id(self, obj: Any) -> Any:
        by_id = (Node, torch.Tensor, torch.UntypedStorage, torch.TypedStorage)
        return id(obj) if isinstance(obj, by_id) and not isinstance(obj, FakeTensor) else None


def _named_by_torch(target: Any) -> bool:
    try:
        _OpPickleData.pickle(target, Options(ops_filter=None))
    except NotImplementedError:
        return False
    return True


def _graph_module(data: Any, state: _UnpickleState) -> GraphModule:
    return data.unpickle(state)  # compiled by _set_meta, once its targets are all back


def _within(gm: GraphModule) -> None:
    _unpickle_state().within.append((gm.graph, {n.name: n for n in gm.graph.nodes}))


def _set_meta(gm: GraphModule, state: tuple[None, dict[str, dict], dict[str, Any]]) -> None:
    _unpickle_state().within.pop()
    _, meta, targets = state
    for node in gm.graph.nodes:
        node.meta = meta[node.name]
        node.target = targets.get(node.name, node.target)
    gm.recompile()


def _node(name: str) -> Node:
    within = _unpickle_state().within
    graph, nodes = within[-1] if within else (torch.fx.Graph(), {})
    if name not in nodes:  # torchao's annotations may name nodes convert_pt2e erased
        nodes[name] = Node(graph, name, "placeholder", name, (), {})
        nodes[name]._erased = True
    return nodes[name]


def _picklable(value: Any) -> bool:
    try:
        _Checker().dump(value)
    except Exception:  # noqa: BLE001 - any failure means "cannot be stored"
        return False
    return True


def _kept(items: dict, where: str, dropped: list[str], depth: int = 0) -> dict:
    """``items`` without what cannot be pickled; a dict or a module (export's GuardsFn,
    whose forward is generated code) is kept without its own such parts."""
    kept = {}
    for key, value in items.items():
        place = f"{where}[{key!r}]"
        module = isinstance(value, torch.nn.Module) and not isinstance(value, GraphModule)
        if _picklable(value):
            kept[key] = value
        elif depth < 3 and isinstance(value, dict):
            kept[key] = _kept(value, place, dropped, depth + 1)
        elif depth < 3 and module:
            kept[key] = copy.copy(value)
            kept[key].__dict__ = _kept(value.__dict__, place, dropped, depth + 1)
        else:
            dropped.append(f"{place} ({type(value).__name__})")
    return kept


def _pickle(value: Any, path: Path) -> list[str]:
    """Write ``value`` to ``path`` in the pickled format; return what was left out."""
    pickler = type("Pickler", (_Pickler,), {"dropped": []})
    torch.save(value, str(path), pickle_module=types.SimpleNamespace(Pickler=pickler,
                                                                     __name__=__name__))
    return pickler.dropped


def _unpickle(path: Path) -> Any:
    """Read the pickled format (tensors on the CPU as saved): runs the code it names."""
    state = _UnpickleState(FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True))
    state.within = []
    token = _unpickling.set(state)
    try:
        return torch.load(str(path), weights_only=False)
    finally:
        _unpickling.reset(token)


def _pickle_refusal(error: Exception) -> str:
    named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if named:
        return (f"it is a pickle that would call {named.group(1)} when read "
                "(torch.load(weights_only=True) refuses it)")
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(error))
    what = f": {found.group(1).strip()}" if found else ""
    return f"it is a pickle, which torch.load(weights_only=True) refuses{what}"


def _read(path: Path, trusted: bool) -> tuple[str, Any]:
    """A ``torch.save`` file: (``"plain"``, its data) or, trusted only, (``"pickled"``,
    its value)."""
    try:
        with warnings.catch_warnings():  # a pickle's protocol 4: refused just below
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return PLAIN, torch.load(str(path), weights_only=True)
    except pickle.UnpicklingError as e:
        if not trusted:
            raise UntrustedFileError(path, PICKLED, _pickle_refusal(e)) from None
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise  # the path, not the file's contents: Python's own error says it best
    except (RuntimeError, EOFError, KeyError, ValueError, OSError) as e:  # "not torch.save's"
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise ArchiveError(path, "not a file save_program wrote, or a damaged one "
                                 f"({type(e).__name__}: {first_line})") from e
    return PICKLED, _unpickle(path)


# The exported format -----------------------------------------------------------------


def _side_meta(gm: GraphModule) -> tuple[dict, list[str]]:
    """The node and module meta torch.export.save does not keep, as plain data, and
    what is left out."""
    side: dict[str, dict] = {"meta": {}, "module_meta": {}, "tensor_meta": {}}
    left_out: dict[tuple[str, str], list[str]] = {}  # (key, type) -> where
    for path, module in graph_modules(gm):
        for node in module.graph.nodes:
            for key, value in node.meta.items():
                if key == "tensor_meta":
                    side["tensor_meta"].setdefault(path, []).append(node.name)
                elif key in KEPT_BY_TORCH:
                    continue
                elif plain_data(value):
                    side["meta"].setdefault(path, {}).setdefault(node.name, {})[key] = value
                else:
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


def _load_exported(path: Path, trusted: bool) -> ExportedProgram:
    if not trusted and (refusals := archive_refusals(path)):
        raise UntrustedFileError(path, EXPORTED, "; ".join(refusals))
    state_path = state_file(path)
    if not state_path.exists():
        raise ArchiveError(state_path, f"it is missing; save_program writes it beside {path.name}")
    _, state = _read(state_path, trusted)
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
        # The archive's stand-ins hold each tensor's shape and dtype as the graph uses it.
        unlike = [f"{name} is {_layout(saved[name])}, the program's {_layout(loaded[name])}"
                  for name in sorted(saved) if _layout(saved[name]) != _layout(loaded[name])]
        if unlike:
            raise ArchiveError(state_path, f"its {kind} is not the program's: "
                                           f"{'; '.join(unlike)} (damaged, or from another file)")
        loaded.update(saved)
    _restore_meta(ep.graph_module, state, state_path)
    return ep


def _layout(value: Any) -> str:
    """A tensor's dtype and shape as text (what else it is, for a value that is none)."""
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"


def _restore_meta(gm: GraphModule, state: dict[str, Any], where: Path) -> None:
    modules = dict(graph_modules(gm))
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


# The interface -----------------------------------------------------------------------


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
    return SavedProgram(path, PICKLED, because, _pickle(program, path))


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
    if is_pt2_package(str(path)):
        return _load_exported(path, trusted)
    form, value = _read(path, trusted)
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
    _pickle(value, Path(path))
    return PICKLED


def load_data(path: str | Path, *, trusted: bool = False) -> Any:
    """Read what :func:`save_data` wrote; a pickled file only with ``trusted``
    (:class:`~pass_manager.errors.UntrustedFileError` otherwise)."""
    return _read(Path(path), trusted)[1]
