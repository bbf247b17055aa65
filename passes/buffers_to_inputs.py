"""BuffersToInputs: make resident state explicit inputs (and outputs), the reverse of
InputsToBuffers."""

from __future__ import annotations

import keyword
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pass_manager import Effects, Pass, PassResult
from pass_manager.collector import collector_paused

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.buffers import BUFFER, state_nodes
from ._carried.explicit import Explicit, make_explicit
from ._carried.record import CarriedRecord, records_of
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
    was carried): same inputs, names, positions, outputs, call specs and example inputs;
    state that run's prefill created goes back to being created and returned. Other buffers
    become keyword inputs named by their FQN with ``_`` for each character a Python name
    cannot hold (``layers.0.k_cache`` -> ``layers_0_k_cache``: torch generates a ``forward``
    with them as parameters; the notes say which), their value in the example inputs, appended
    after the others; returned values are appended to the outputs (a returned tuple grows,
    anything else becomes ``(outputs, *new values)``). The result is a new program; its
    input is left untouched. Requires the functional form.

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
        StateNameError: ``buffers`` names no buffer of the program.
    """

    buffers: Sequence[str] | None = None
    returned: bool | None = None

    requires = frozenset({Functional, MutableBuffersMarked})
    preserves = frozenset({Functional, MutableBuffersMarked})
    effects = Effects.rewrite(in_place=False)  # a new program; its input is left untouched

    def call(self, program: Any) -> PassResult:
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
                    if fqn not in nodes:
                        raise StateNameError(_NAME, fqn, "buffers names no buffer of the "
                                             f"program (buffers: {', '.join(sorted(nodes))})")
                chosen = list(dict.fromkeys(self.buffers))
            if not chosen:
                return PassResult(program, False)
            record = _restorable(records_of(program), chosen, self.returned)
            explicit = self._plan(view, nodes, chosen, record)
            result = make_explicit(view, explicit, record)
        statistics = Counter(
            "written in place" if e.in_place and e.value is not None else
            "returned" if e.value is not None else "read only" for e in explicit)
        notes = [f"buffer {e.buffer!r} -> input {e.input_name!r}" if e.keep_input else
                 f"buffer {e.buffer!r} -> created and returned again" for e in explicit]
        if record is not None:
            notes.append("the call signature before InputsToBuffers is restored")
        return PassResult(result, True, notes, statistics)

    def _plan(self, view: ProgramView, nodes: dict[str, list], chosen: list[str],
              record: CarriedRecord | None) -> list[Explicit]:
        moved = {m.buffer: m for m in record.moved} if record is not None else {}
        own = {node for fqn in chosen for node in nodes[fqn]}
        taken = {node.name for node in view.gm.graph.find_nodes(op="placeholder")
                 if node not in own}
        explicit = []
        for fqn in chosen:
            value = next((view.writes[n] for n in nodes[fqn] if n in view.writes), None)
            m = moved.get(fqn)
            if m is not None:
                explicit.append(Explicit(fqn, nodes[fqn], value, m.in_place,
                                         m.input or fqn, m.input_index, m.output_indices,
                                         m.input is not None))
            else:
                explicit.append(Explicit(fqn, nodes[fqn], value, not self.returned,
                                         _keyword(fqn, taken)))
        return explicit


def _keyword(fqn: str, taken: set[str]) -> str:
    """The keyword input a buffer becomes: its FQN with every character a Python name
    cannot hold as ``_`` (``layers.0.k_cache`` -> ``layers_0_k_cache``), made unique
    among the other inputs' names ``taken`` (which it joins). torch writes keyword inputs
    as the parameters of the ``forward`` it generates (``ep.module()``,
    ``run_decompositions``, hence ExecuTorch's lowering): a dotted name is a SyntaxError."""
    base = re.sub(r"\W", "_", fqn)
    base = base if base.isidentifier() else f"_{base}"
    name, suffix = base, 1
    while name in taken or keyword.iskeyword(name):
        name, suffix = f"{base}_{suffix}", suffix + 1
    taken.add(name)
    return name


def _named(view: ProgramView, node: Any) -> Any:
    """The copy's node of the source program's placeholder ``node`` (same name)."""
    return next(p for p in view.gm.graph.find_nodes(op="placeholder") if p.name == node.name)


def _restorable(records: tuple[CarriedRecord, ...], chosen: list[str], returned: bool | None
                ) -> CarriedRecord | None:
    """The last InputsToBuffers record, when it moved exactly ``chosen`` and the user asked
    for it to come back as it was."""
    if not records or returned is not None:
        return None
    record = records[-1]
    return record if {m.buffer for m in record.moved} == set(chosen) else None
