"""What :class:`passes.InputsToBuffers` moved, kept on the program it returns, so the user can
read which input became which buffer and :class:`passes.BuffersToInputs` can restore the call
signature exactly.

The records live in ``graph_module.meta`` and, written as JSON, in its ``"custom"`` entry, the
one part of a graph module's meta ``torch.export.save`` keeps: a program saved and loaded
again still restores its call signature. The saved form has no example inputs (tensors);
BuffersToInputs rebuilds them from the program's own and its buffers' values."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from pass_manager import graph_module_of

from .specs import kept_arg_names, without_leaves

__all__ = ["CARRIED_META", "EXAMPLE_META", "SAVED_META", "CarriedRecord", "Moved",
           "fitting_runs", "records_of", "set_records", "unsaved_reason"]

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

    def then(self, later: CarriedRecord) -> CarriedRecord:
        """This run and ``later``, which started from the signature this one left, as one
        run: ``later``'s positions become positions in the signature before this run."""
        inputs_gone = {m.input_index for m in self.moved if m.input_index is not None}
        outputs_gone = {i for m in self.moved for i in m.output_indices}
        kept_in = [i for i in range(self.in_spec.num_leaves) if i not in inputs_gone]
        kept_out = [i for i in range(self.out_spec.num_leaves) if i not in outputs_gone]
        moved = tuple(replace(m, input_index=None if m.input_index is None else
                              kept_in[m.input_index],
                              output_indices=tuple(kept_out[i] for i in m.output_indices))
                      for m in later.moved)
        loaded = self.loaded or later.loaded
        return replace(self, moved=self.moved + moved, example_inputs=None if loaded else
                       self.example_inputs, resident_in_spec=later.resident_in_spec,
                       resident_out_spec=later.resident_out_spec, loaded=loaded)

    def dropping(self, buffers: Iterable[str], refuse: Callable[[str, str], Exception]
                 ) -> CarriedRecord | None:
        """The run as if it had never moved ``buffers``: their entries gone, and their inputs
        and outputs gone from the signature before it (None: it moved nothing else). Its
        positions are then positions in that smaller signature. ``refuse(buffer,
        why)`` is the error for a buffer whose input or output is one leaf of a
        container that cannot lose it alone (a ``StaticCache``)."""
        gone = {m.buffer for m in self.moved} & set(buffers)
        moved = [m for m in self.moved if m.buffer not in gone]
        if not moved:
            return None
        drop_in = {m.input_index for m in self.moved if m.buffer in gone
                   and m.input_index is not None}
        kept_outputs = {i for m in moved for i in m.output_indices}
        drop_out = {i for m in self.moved if m.buffer in gone for i in m.output_indices
                    } - kept_outputs

        def refusing(index_of: Callable[[Moved], tuple[int, ...]]):
            def refuse_leaf(leaf: int, container: str, _staying: list[int]) -> Exception:
                return refuse(next(m.buffer for m in self.moved if leaf in index_of(m)),
                              f"it and other leaves of one {container} were made resident "
                              f"together, and a {container} cannot be passed with only some "
                              "of its leaves")
            return refuse_leaf

        in_spec = without_leaves(self.in_spec, drop_in, refusing(
            lambda m: () if m.input_index is None else (m.input_index,)), keep=2)
        out_spec = without_leaves(self.out_spec, drop_out, refusing(lambda m: m.output_indices))

        def shifted(index: int, dropped: set[int]) -> int:
            return index - sum(1 for d in dropped if d < index)

        moved = tuple(replace(m, input_index=None if m.input_index is None else
                              shifted(m.input_index, drop_in),
                              output_indices=tuple(shifted(i, drop_out)
                                                   for i in m.output_indices))
                      for m in moved)
        example_inputs = self.example_inputs
        if example_inputs is not None:
            leaves = pytree.tree_leaves(example_inputs)
            example_inputs = pytree.tree_unflatten(
                [v for i, v in enumerate(leaves) if i not in drop_in], in_spec)
        return replace(self, in_spec=in_spec, out_spec=out_spec, moved=moved,
                       example_inputs=example_inputs,
                       arg_names=None if self.arg_names is None else tuple(kept_arg_names(
                           list(self.arg_names), self.in_spec, in_spec, drop_in)))

    def restoring(self, buffers: Iterable[str], refuse: Callable[[str, str], Exception]
                  ) -> tuple[CarriedRecord, CarriedRecord | None]:
        """The run split in two where the program still has the signature it left:
        the record that restores ``buffers`` alone (the others staying resident), and the
        record of the others, which restores them from the signature that leaves (None:
        there are none). One output returning two buffers' value cannot be split:
        ``refuse(buffer, why)`` is the error."""
        chosen = set(buffers)
        staying = [m for m in self.moved if m.buffer not in chosen]
        shared = {i for m in staying for i in m.output_indices} & {
            i for m in self.moved if m.buffer in chosen for i in m.output_indices}
        if shared:
            index = min(shared)
            buffer = next(m.buffer for m in staying if index in m.output_indices)
            raise refuse(buffer, f"one output (flat output {index} before InputsToBuffers) "
                         "returned its next value and that of a buffer undone now")
        undone = self.dropping((m.buffer for m in staying), refuse)
        if not staying:
            return self, None
        assert undone is not None  # some buffers of chosen were moved by this run
        return undone, replace(self, moved=tuple(staying),
                               resident_in_spec=undone.in_spec,
                               resident_out_spec=undone.out_spec)


def fitting_runs(records: tuple[CarriedRecord, ...], in_spec: pytree.TreeSpec,
                 out_spec: pytree.TreeSpec) -> int:
    """Where the last runs that can still be undone begin: the last record fits a program
    of these call specs, and each before it left the signature the next started from (the
    runs in between changed nothing else). ``len(records)``: none can."""
    start = len(records)
    while start > 0:
        record = records[start - 1]
        later = records[start] if start < len(records) else None
        if later is None and not record.fits(in_spec, out_spec):
            break
        if later is not None and not record.fits(later.in_spec, later.out_spec):
            break
        start -= 1
    return start


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
