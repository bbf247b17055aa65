"""BuffersToInputs: make resident state explicit inputs (and outputs), the reverse of
InputsToBuffers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.fx.graph import _Namespace

from pass_manager import Effects, Pass, PassResult
from pass_manager.collector import collector_paused

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.buffers import BUFFER, state_nodes, tied_names
from ._carried.explicit import Explicit, make_explicit
from ._carried.record import CarriedRecord, records_of, unsaved_reason
from ._carried.view import ProgramView
from .errors import StateNameError

__all__ = ["BuffersToInputs"]

_NAME = "BuffersToInputs"


@dataclass(frozen=True, repr=False)
class BuffersToInputs(Pass):
    """Turn resident mutable buffers into explicit inputs, for backends and runtimes that
    take state as I/O (QNN's static llama, Core ML's multifunction flows).

    ``buffers`` (FQNs; default: every buffer the program writes) become inputs. Each is
    written in place (``returned=False``: a ``USER_INPUT_MUTATION`` output, or a
    GraphModule's trailing ``copy_(input, value)``) or its next value returned as an output
    (``returned=True``). Exactly the buffers the last :class:`~passes.InputsToBuffers` run
    made resident come back exactly as they were (``returned=None``, the default: each as it
    was carried; while the program's call signature is still the one that run left, and
    ``buffers`` names all of them):
    same inputs, names, positions, outputs, call specs and example inputs;
    state that run's prefill created goes back to being created and returned. The run before
    it is then undone the same way when ``buffers`` names all of its buffers too, and so on
    (``buffers={"h": "a"}`` then ``{"g": "b"}``: one BuffersToInputs gives ``h`` and ``g``
    back). Other buffers
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
            error below (its ``__cause__``); the program is left as it was.
        StateNameError: ``buffers`` names no buffer of the program, or is a string or a
            mapping (not a sequence of names).
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
            record, stale = _restorable(records_of(program), chosen, self.returned, view)
            restored = {m.buffer for m in record.moved} if record is not None else set()
            rest = [fqn for fqn in chosen if fqn not in restored]
            if not (record is not None and rest):
                explicit = self._plan(view, nodes, chosen, record, tied)
                result = make_explicit(view, explicit, record)
        if record is not None and rest:
            return self._restore_then_rest(program, [m.buffer for m in record.moved], rest)
        statistics = Counter(
            "written in place" if e.in_place and e.value is not None else
            "returned" if e.value is not None else "read only" for e in explicit)
        notes = [f"buffer {e.buffer!r} -> input {e.input_name!r}" if e.keep_input else
                 f"buffer {e.buffer!r} -> created and returned again" for e in explicit]
        if record is not None:
            notes.append("the call signature before InputsToBuffers is restored")
        if record is not None and record.loaded:
            notes.append("its record was read back from the saved program, which keeps no "
                         "example inputs of it: each restored input's example is the value "
                         "its buffer holds")
        if record is None and (reason := unsaved_reason(program)) is not None:
            notes.append("the program was saved without InputsToBuffers' record, whose call "
                         f"specs could not be written ({reason}): the call signature before "
                         "it is not restored, the buffers become keyword inputs")
        if stale:
            notes.append("the call signature changed after the InputsToBuffers run that made "
                         "these buffers (inputs or outputs added or taken since), so it is not "
                         "restored: the buffers become keyword inputs")
        return PassResult(result, True, notes, statistics)

    def _restore_then_rest(self, program: Any, restored: list[str], rest: list[str]
                           ) -> PassResult:
        """The last InputsToBuffers run undone alone, then ``rest`` from the program it gives
        back, whose signature is again the one the run before left: several runs
        (``buffers={"h": ...}``, then ``{"g": ...}``) are undone in turn, as many
        BuffersToInputs runs would, rather than all but the last leaving as keyword inputs
        under their buffer names with the earlier run's record left behind."""
        first = BuffersToInputs(restored, None).call(program)
        then = BuffersToInputs(rest, None).call(first.program)
        statistics = Counter(first.statistics)
        statistics.update(then.statistics)
        return PassResult(then.program, True, [*first.notes, *then.notes], statistics)

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


def _restorable(records: tuple[CarriedRecord, ...], chosen: list[str], returned: bool | None,
                view: ProgramView) -> tuple[CarriedRecord | None, bool]:
    """The last InputsToBuffers record, when it moved only buffers of ``chosen`` (the others,
    the program's own state, such as a rotary embedding's frequencies Phi3's longrope
    rewrites, are appended to the restored signature), the user asked for it to come back
    as it was, and the program still has the call signature that run left (its positions
    are positions in that signature: restored into another, inputs would go missing); and
    whether such a record was passed over for that last reason."""
    if not records or returned is not None:
        return None, False
    record = records[-1]
    if not {m.buffer for m in record.moved} <= set(chosen):
        return None, False
    if not record.fits(view.in_spec, view.out_spec):
        return None, True
    return record, False
