"""BuffersToInputs: make resident state explicit inputs (and outputs), the reverse of
InputsToBuffers."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch.fx.graph import _Namespace

from pass_manager import Effects, Pass, PassResult
from pass_manager.collector import collector_paused

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.buffers import BUFFER, state_nodes, tied_names
from ._carried.explicit import Explicit, make_explicit
from ._carried.record import CarriedRecord, fitting_runs, records_of, unsaved_reason
from ._carried.view import ProgramView
from .errors import CarriedStateError, StateNameError

__all__ = ["BuffersToInputs"]

_NAME = "BuffersToInputs"


@dataclass(frozen=True, repr=False)
class BuffersToInputs(Pass):
    """Turn resident mutable buffers into explicit inputs, for backends and runtimes that
    take state as I/O (QNN's static llama, Core ML's multifunction flows).

    ``buffers`` (FQNs; default: every buffer the program writes) become inputs. Each is
    written in place (``returned=False``: a ``USER_INPUT_MUTATION`` output, or a
    GraphModule's trailing ``copy_(input, value)``) or its next value returned as an output
    (``returned=True``). The buffers :class:`~passes.InputsToBuffers` runs made resident
    come back exactly as they were (``returned=None``, the default: each as it was carried),
    in any order and any part: same inputs, names, positions, outputs, call specs and
    example inputs, those left resident missing from them until they come back too; state a
    prefill created goes back to being created and returned (``buffers={"h": "a"}`` then
    ``{"g": "b"}``: ``BuffersToInputs(["a"])`` gives ``h`` back in its place, ``g`` staying
    resident). This holds for the last runs back to one after which the call signature
    changed otherwise (another buffer made an input since): a buffer an earlier run moved
    becomes a keyword input, and a note says why. The record
    (:func:`~passes.inputs_to_buffers.carried_buffers`) names the buffers still resident.
    Other buffers
    (the program's own state beside them included)
    become keyword inputs named by their FQN as a Python identifier (``layers.0.k_cache``
    -> ``layers_0_k_cache``; their value in the example inputs), appended after the others;
    returned values are appended to the outputs (a returned tuple grows, anything else
    becomes ``(outputs, *new values)``). Tied buffers (one tensor registered
    under several names) become one input, named by the first of them chosen; none stays
    resident. A GraphModule keeps no example inputs: each input placeholder made from a
    buffer keeps the value the buffer held instead, which InputsToBuffers starts the buffer
    from again. The result is a new program; its input is left untouched. Requires the
    functional form.

    Example (GraphModule form, ``returned=True``)::

        before:  %h = get_attr[h]               after:  %x = placeholder[x]
                 %x = placeholder[x]                    %h = placeholder[h]
                 %add = aten.add(%h, %x)                %add = aten.add(%h, %x)
                 %copy_ = aten.copy_(%h, %add)          return (%add, %add)
                 return (%add,)

    Raises:
        PreconditionError: Functional or MutableBuffersMarked does not hold.
        ProgramFormError: the program is neither a GraphModule nor an ExportedProgram.
        PassFailedError: run by a PassManager or as ``pass_(program)``, in place of the
            errors below (its ``__cause__``); the program is left as it was.
        StateNameError: ``buffers`` names no buffer of the program, or is a string or a
            mapping (not a sequence of names).
        CarriedStateError: ``buffers`` names part of the buffers one InputsToBuffers run
            made resident that cannot come back alone: one leaf of a namedtuple or
            ``StaticCache`` whose other leaves stay resident, or a buffer whose next value
            one output returned for another buffer too.
    """

    buffers: Sequence[str] | None = None
    returned: bool | None = None

    requires = frozenset({Functional, MutableBuffersMarked})
    preserves = frozenset({Functional, MutableBuffersMarked})
    effects = Effects.rewrite(in_place=False)  # a new program; its input is left untouched

    def call(self, program: Any) -> PassResult:
        if isinstance(self.buffers, str):  # read letter by letter, it would move other buffers
            raise StateNameError(_NAME, self.buffers, "buffers is one string, not a sequence "
                                 f"of buffer names: pass [{self.buffers!r}]")
        if isinstance(self.buffers, Mapping):  # its values would be dropped unread
            raise StateNameError(_NAME, "buffers", "buffers is a mapping; BuffersToInputs "
                                 "takes a sequence of buffer names (each input is named for "
                                 "you: the name it had before InputsToBuffers, else the FQN)")
        with collector_paused():
            view = ProgramView.of(program)
            nodes: dict[str, list] = {}
            for node, state in state_nodes(view.gm if not view.exported else program).items():
                if state.kind == BUFFER:
                    nodes.setdefault(state.name, []).append(
                        node if not view.exported else _named(view, node))
            written = {fqn for fqn, ns in nodes.items() if any(n in view.writes for n in ns)}
            if self.buffers is None:
                chosen = [fqn for fqn in nodes if fqn in written]
            else:
                for fqn in self.buffers:
                    if not isinstance(fqn, str) or fqn not in nodes:
                        raise StateNameError(_NAME, str(fqn), "buffers names no buffer of the "
                                             f"program (buffers: {', '.join(sorted(nodes))})")
                chosen = list(dict.fromkeys(self.buffers))
            # Tied names go with their tensor: left resident, one would keep its old value.
            tied = tied_names(program, nodes)
            # One input per tensor: a name tied to one chosen before it goes with that one.
            chosen = [fqn for i, fqn in enumerate(chosen)
                      if not set(tied.get(fqn, ())) & set(chosen[:i])]
            if not chosen:
                return PassResult(program, False)
            undoing = _undoing(records_of(program), chosen, self.returned, view)
            record = undoing.record
            explicit = self._plan(view, nodes, chosen, record, tied)
            result = make_explicit(view, explicit, record, undoing.records)
        statistics = Counter(
            "written in place" if e.in_place and e.value is not None else
            "returned" if e.value is not None else "read only" for e in explicit)
        notes = [f"buffer {e.buffer!r} -> input {e.input_name!r}" if e.keep_input else
                 f"buffer {e.buffer!r} -> created and returned again" for e in explicit]
        if record is not None:
            notes.append("the call signature before InputsToBuffers is restored")
        if undoing.staying:
            notes.append("but for the inputs of the buffers InputsToBuffers made resident "
                         f"with them, which stay resident: {', '.join(undoing.staying)}")
        if record is not None and record.loaded:
            notes.append("its record was read back from the saved program, which keeps no "
                         "example inputs of it: each restored input's example is the value "
                         "its buffer holds")
        if record is None and (reason := unsaved_reason(program)) is not None:
            notes.append("the program was saved without InputsToBuffers' record, whose call "
                         f"specs could not be written ({reason}): the call signature before "
                         "it is not restored, the buffers become keyword inputs")
        if undoing.stale:
            notes.append("the call signature changed after the InputsToBuffers run that made "
                         "these buffers (inputs or outputs added or taken since), so it is not "
                         "restored: the buffers become keyword inputs")
        return PassResult(result, True, notes, statistics)

    def _plan(self, view: ProgramView, nodes: dict[str, list], chosen: list[str],
              record: CarriedRecord | None, tied: dict[str, tuple[str, ...]]
              ) -> list[Explicit]:
        moved = {m.buffer: m for m in record.moved} if record is not None else {}
        # A keyword input is a Python identifier, of no node's name: torch's and fx's code
        # generation write it as a parameter of forward (``layers.0.k_cache`` cannot be).
        keywords = _Namespace()
        leaving = {n for fqn in chosen for name in (fqn, *tied.get(fqn, ())) for n in nodes[name]}
        # a buffer's own node goes: its name is free
        taken = [node.name for node in view.gm.graph.nodes if node not in leaving]
        # The forward's own argument names and keywords too: a keyword input ``state`` (a
        # dict whose leaves are placeholders ``state_a`` ...) beside a buffer ``state`` made
        # a forward with the argument ``state`` twice, which Python refuses.
        taken += [str(n) for n in (*view.in_spec.child(1).context, *(view.arg_names() or ()))]
        if record is not None:  # the restored signature's keywords come back beside them
            taken += [*record.in_spec.child(1).context, *(record.arg_names or ())]
        for name in dict.fromkeys(taken):  # each once: a second would take ``name_1`` too
            keywords.create_name(name, None)
        explicit = []
        for fqn in chosen:
            # Every name of the tensor reads the one input (export reads one of them).
            read = [n for name in (fqn, *tied.get(fqn, ())) for n in nodes[name]]
            value = next((view.writes[n] for n in read if n in view.writes), None)
            m = moved.get(fqn)
            if m is not None:
                explicit.append(Explicit(fqn, read, value, m.in_place,
                                         m.input or fqn, m.input_index, m.output_indices,
                                         m.input is not None, tied.get(fqn, ())))
            else:
                explicit.append(Explicit(fqn, read, value, not self.returned,
                                         keywords.create_name(fqn, None),
                                         tied=tied.get(fqn, ())))
        return explicit


def _named(view: ProgramView, node: Any) -> Any:
    """The copy's node of the source program's placeholder ``node`` (same name)."""
    return next(p for p in view.gm.graph.find_nodes(op="placeholder") if p.name == node.name)


class _Undoing(NamedTuple):
    """What making some buffers inputs undoes of the InputsToBuffers runs.

    Attributes:
        record: restores the call signature for the chosen buffers the runs that can still
            be undone moved (None: nothing to restore).
        records: the records the result keeps (None: unchanged); none names a buffer made
            an input.
        stale: a run that cannot be undone any more (the call signature changed since)
            moved a chosen buffer: it becomes a keyword input.
        staying: the buffers those same runs moved that stay resident.
    """

    record: CarriedRecord | None
    records: tuple[CarriedRecord, ...] | None
    stale: bool
    staying: tuple[str, ...]


def _undoing(records: tuple[CarriedRecord, ...], chosen: list[str], returned: bool | None,
             view: ProgramView) -> _Undoing:
    """The runs that can still be undone (the last runs, back to one after which the call
    signature changed otherwise: :func:`fitting_runs`) undo as one, for any subset of their
    buffers in any order: the others stay resident, their record rewritten to restore them
    from the signature this leaves. Earlier runs forget the chosen buffers (their entries,
    and their places in the signature before them), which become keyword inputs. With
    ``returned`` given nothing is restored, and every run forgets them."""
    wanted = set(chosen)

    def refuse(buffer: str, why: str) -> CarriedStateError:
        return CarriedStateError(_NAME, buffer, f"{why}: make inputs of them together, in "
                                 f"one BuffersToInputs (buffers asked for: {', '.join(chosen)})")

    start = fitting_runs(records, view.in_spec, view.out_spec) if returned is None else len(
        records)
    kept: list[CarriedRecord] = []
    stale = False
    for run in records[:start]:
        if {m.buffer for m in run.moved} & wanted:
            stale = returned is None
            run = run.dropping(wanted, refuse)
        if run is not None:
            kept.append(run)
    record, staying = None, ()
    if records[start:]:
        run = functools.reduce(CarriedRecord.then, records[start:])
        if {m.buffer for m in run.moved} & wanted:
            record, rest = run.restoring(wanted, refuse)
            if rest is not None:
                kept.append(rest)
                staying = tuple(m.buffer for m in rest.moved)
        else:
            kept.extend(records[start:])
    return _Undoing(record, None if tuple(kept) == records else tuple(kept), stale, staying)
