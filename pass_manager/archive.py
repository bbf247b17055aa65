"""Save a program (either form) to one file and load it back, graph and node meta included;
read a file someone else made without running code from it.

:func:`save_program` picks one of two formats, and says which (:class:`SavedProgram`):

* ``"exported"``: an ExportedProgram ``torch.export.save`` can hold, in a ``torch.save`` file
  of plain data (:mod:`pass_manager._archive.exported`): the ``torch.export.save`` archive,
  the program's tensors (streamed from their memory, no second copy) and the node meta
  torch.export does not keep when it is plain data (the passes' marks and kept initial
  values, delegation tags); other meta (torch's ``original_aten``, a quantization
  annotation naming nodes) is left out and listed in :attr:`SavedProgram.dropped`.
  :func:`load_program` reads it with ``torch.load(weights_only=True)`` and, after checking
  the archive holds nothing that runs code (:mod:`pass_manager._archive.untrusted`),
  ``torch.export.load``: safe for a file from anyone.
* ``"pickled"``: everything else (a GraphModule; an ExportedProgram holding a delegate call
  or a tensor subclass), all of its meta included: a Python pickle that knows fx
  (:mod:`pass_manager._archive.pickled`). A pickle runs the code it names when read, so
  :func:`load_program` reads one only with ``trusted=True``; without, it raises
  :class:`~pass_manager.errors.UntrustedFileError` naming the file and what would run.

:func:`save_data` / :func:`load_data` do the same for other values (a reproducer's
validation inputs and reference): plain data (tensors, numbers, strings, lists, tuples,
dicts) loads with ``weights_only=True``, anything else is pickled and needs trust.
"""

from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from ._archive import exported, pickled
from ._archive.untrusted import plain_data
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
]

EXPORTED, PICKLED, PLAIN = "exported", "pickled", "plain"


@dataclass(frozen=True)
class SavedProgram:
    """What :func:`save_program` wrote.

    Attributes:
        path: the file.
        format: ``"exported"`` (read without trust) or ``"pickled"`` (read with
            ``trusted=True`` only).
        pickled_because: why the exported format could not hold the program ("" if used).
        dropped: what the loaded program will lack ("node.meta['key'] (type)").
    """

    path: Path
    format: str
    pickled_because: str
    dropped: list[str]

    @property
    def needs_trust(self) -> bool:
        return self.format == PICKLED


def save_program(program: Any, path: str | Path) -> SavedProgram:
    """Write ``program`` (GraphModule or ExportedProgram) to ``path``, in the exported
    format when it can hold the program, else pickled."""
    path = Path(path)
    if not isinstance(program, ExportedProgram):
        because = (f"it is a {type(program).__name__}; torch.export.save holds only an "
                   "ExportedProgram")
    else:
        try:
            container, dropped = exported.pack(program)
        except exported.NotExportable as e:
            because = e.reason
        else:
            torch.save(container, str(path))
            return SavedProgram(path, EXPORTED, "", dropped)
    return SavedProgram(path, PICKLED, because, pickled.save(program, path))


def _pickle_refusal(error: Exception) -> str:
    named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if named:
        return (f"it is a pickle that would call {named.group(1)} when read "
                "(torch.load(weights_only=True) refuses it)")
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(error))
    what = f": {found.group(1).strip()}" if found else ""
    return f"it is a pickle, which torch.load(weights_only=True) refuses{what}"


def _load(path: Path, trusted: bool) -> tuple[str, Any]:
    """(format, value) of a file written by save_program or save_data."""
    try:
        with warnings.catch_warnings():  # a pickled file's protocol 4: refused just below
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            value = torch.load(str(path), weights_only=True)
    except pickle.UnpicklingError as e:
        if not trusted:
            raise UntrustedFileError(path, PICKLED, _pickle_refusal(e)) from None
        return PICKLED, pickled.load(path)
    return (EXPORTED if exported.is_exported(value) else PLAIN), value


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
    form, value = _load(path, trusted)
    if form == PICKLED:
        return value
    if form != EXPORTED:
        raise ArchiveError(path, f"it holds a {type(value).__name__}, not a program "
                                 "save_program wrote")
    try:
        return exported.unpack(value, trusted)
    except exported.Refused as e:
        raise UntrustedFileError(path, f"{EXPORTED} format", "; ".join(e.reasons)) from None
    except exported.Malformed as e:
        raise ArchiveError(path, str(e)) from None
    except Exception as e:  # torch.export.load on a damaged archive
        raise ArchiveError(path, f"torch.export.load failed: {type(e).__name__}: {e}") from e


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
    return _load(Path(path), trusted)[1]
