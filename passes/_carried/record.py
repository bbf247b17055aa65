"""What :class:`passes.InputsToBuffers` moved, kept on the program it returns, so the user can
read which input became which buffer and :class:`passes.BuffersToInputs` can restore the call
signature exactly.

The records live in ``graph_module.meta`` and, written as JSON, in its ``"custom"`` entry, the
one part of a graph module's meta ``torch.export.save`` keeps: a program saved and loaded
again still restores its call signature. The saved form has no example inputs (tensors);
BuffersToInputs rebuilds them from the program's own and its buffers' values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from pass_manager import graph_module_of

__all__ = ["CARRIED_META", "EXAMPLE_META", "SAVED_META", "CarriedRecord", "Moved",
           "records_of", "set_records", "unsaved_reason"]

CARRIED_META = "carried_state"
"""``graph_module.meta`` key: the tuple of :class:`CarriedRecord`, one per InputsToBuffers run
that changed the program, oldest first."""

SAVED_META = "passes.carried_state"
"""Key in ``graph_module.meta["custom"]``: the records as JSON (``{"records": [...]}``), or
``{"unsaved": reason}`` when a call spec of theirs cannot be written (a pytree type
registered without ``serialized_type_name``)."""

EXAMPLE_META = "carried_example"
"""``node.meta`` key of an input placeholder of a GraphModule: the value the buffer held when
:class:`passes.BuffersToInputs` made it this input. A GraphModule keeps no example inputs;
this is its input's example, which :class:`passes.InputsToBuffers` starts the buffer from
(an ExportedProgram keeps it in its example inputs)."""


@dataclass(frozen=True)
class Moved:
    """One piece of carried state made resident.

    Attributes:
        buffer: the buffer's FQN.
        input: the input it was (its placeholder's name); None for state the graph created
            and returned.
        input_index: that input's flat position in the old call signature.
        output_indices: the flat positions of the outputs that returned its next value.
        in_place: whether the program wrote the input in place.
    """

    buffer: str
    input: str | None
    input_index: int | None
    output_indices: tuple[int, ...]
    in_place: bool


@dataclass(frozen=True)
class CarriedRecord:
    """One InputsToBuffers run: the call signature before it (specs, example inputs, the
    forward's argument names), what it moved, and the call specs it left (``resident_in_spec``,
    ``resident_out_spec``): the record restores the signature before only while the program's
    is still the one the run left, since the positions it keeps are positions in that one.
    ``loaded``: read back from a saved program, whose record kept no example inputs."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    moved: tuple[Moved, ...]
    example_inputs: Any = None
    arg_names: tuple[str, ...] | None = None
    resident_in_spec: pytree.TreeSpec | None = None
    resident_out_spec: pytree.TreeSpec | None = None
    loaded: bool = False

    def fits(self, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec) -> bool:
        """Whether a program of these call specs still has the signature the run left."""
        return self.resident_in_spec == in_spec and self.resident_out_spec == out_spec


def _meta(program: Any) -> dict[str, Any]:
    gm = program.graph_module if isinstance(program, ExportedProgram) else graph_module_of(
        program)
    return gm.meta


def records_of(program: Any) -> tuple[CarriedRecord, ...]:
    """The records kept on ``program`` (empty when InputsToBuffers never moved anything), read
    back from their JSON when the program was saved and loaded."""
    meta = _meta(program)
    if CARRIED_META in meta:
        return tuple(meta[CARRIED_META])
    saved = (meta.get("custom") or {}).get(SAVED_META) or {}
    return tuple(_loads(r) for r in saved.get("records", ()))


def unsaved_reason(program: Any) -> str | None:
    """Why the records of a loaded ``program`` were not saved with it (None: they were, or
    there were none)."""
    meta = _meta(program)
    if CARRIED_META in meta:
        return None
    return ((meta.get("custom") or {}).get(SAVED_META) or {}).get("unsaved")


def set_records(meta: dict[str, Any], records: tuple[CarriedRecord, ...]) -> None:
    """Keep ``records`` in a graph module's ``meta``, and as JSON where a save keeps it."""
    meta[CARRIED_META] = records
    try:
        saved: dict[str, Any] = {"records": [_dumps(r) for r in records]}
    except (NotImplementedError, TypeError, ValueError) as error:
        saved = {"unsaved": f"{type(error).__name__}: {error}"}
    # A new dict: a copied graph module may share the old one.
    custom = {k: v for k, v in (meta.get("custom") or {}).items() if k != SAVED_META}
    if records or "unsaved" in saved:
        custom[SAVED_META] = saved
    if custom:
        meta["custom"] = custom
    else:
        meta.pop("custom", None)


def _spec(spec: pytree.TreeSpec | None) -> str | None:
    return None if spec is None else pytree.treespec_dumps(spec)


def _dumps(record: CarriedRecord) -> dict[str, Any]:
    return {
        "in_spec": _spec(record.in_spec), "out_spec": _spec(record.out_spec),
        "resident_in_spec": _spec(record.resident_in_spec),
        "resident_out_spec": _spec(record.resident_out_spec),
        "arg_names": None if record.arg_names is None else list(record.arg_names),
        "moved": [[m.buffer, m.input, m.input_index, list(m.output_indices), m.in_place]
                  for m in record.moved],
    }


def _loads(saved: dict[str, Any]) -> CarriedRecord:
    def spec(key: str) -> pytree.TreeSpec | None:
        return None if saved[key] is None else pytree.treespec_loads(saved[key])

    moved = tuple(Moved(buffer, input_, index, tuple(outputs), in_place)
                  for buffer, input_, index, outputs, in_place in saved["moved"])
    names = saved["arg_names"]
    return CarriedRecord(spec("in_spec"), spec("out_spec"), moved, None,
                         None if names is None else tuple(names), spec("resident_in_spec"),
                         spec("resident_out_spec"), loaded=True)
