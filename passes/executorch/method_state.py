"""Which methods of one ``.pte`` share which buffers, and which method a program is.

ExecuTorch lowers several methods of one model (``to_edge_transform_and_lower({"prefill":
ep1, "decode": ep2})``) by calling a partitioner once per method without saying which, and
hands it a transformed copy (decomposed, Edge dialect, fake state), never the program the
user gave. :class:`MethodState` reads the user's mapping once: the buffers each method reads
or writes, by FQN; :meth:`MethodState.methods_of` recognizes a program as one of the
methods by what lowering keeps, its call signature (user inputs' and outputs' shapes and
dtypes) and the buffers it holds. Two methods that look alike are both candidates, and
state either may share is treated as shared.

Only buffers some method writes are state: a buffer every method only reads is a constant,
which each delegate may keep its own copy of.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .._analysis.buffers import BUFFER, find_mutations
from . import ExecuTorchInputError

__all__ = ["MethodState", "SharedBuffer", "checked_methods", "method_state"]

Fingerprint = tuple[tuple[Any, ...], tuple[Any, ...], frozenset[str]]


@dataclass(frozen=True)
class SharedBuffer:
    """A buffer of the program being lowered that other methods use too.

    Attributes:
        fqn: the buffer.
        methods: every method of the mapping that reads or writes it, in mapping order.
        this: the methods the program being lowered may be (several when ambiguous, none
            when it matches no method of the mapping).
    """

    fqn: str
    methods: tuple[str, ...]
    this: tuple[str, ...]

    def describe(self) -> str:
        names = ", ".join(repr(m) for m in self.methods)
        if not self.this:
            return (f"{names} use it too (the program being lowered matches none of the "
                    "methods given)")
        if len(self.this) > 1:
            return (f"the methods {names} use it (the program being lowered may be any of "
                    f"{', '.join(repr(m) for m in self.this)}, so it is taken as shared)")
        return f"the methods {names} use it"


def _value(value: Any) -> Any:
    """Shape and dtype of a tensor (a symbolic size as None), else its type."""
    if isinstance(value, torch.Tensor):
        sizes = tuple(s if isinstance(s, int) else None for s in value.shape)
        return sizes, str(value.dtype)
    return type(value).__name__


def _buffers(ep: ExportedProgram) -> set[str]:
    return {s.target for s in ep.graph_signature.input_specs
            if s.kind == InputKind.BUFFER and s.target is not None}


def _touched(ep: ExportedProgram, written: set[str]) -> set[str]:
    """The buffers ``ep`` reads or writes: export lifts every buffer of the module, also
    those the traced branch never touches (a prefill's or a decode's own buffers)."""
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    return {fqn for name, fqn in ep.graph_signature.inputs_to_buffers.items()
            if fqn in written or (name in placeholders and placeholders[name].users)}


def _fingerprint(ep: ExportedProgram, known: set[str]) -> Fingerprint:
    sig = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    inputs = tuple(_value(placeholders[s.arg.name].meta.get("val"))
                   for s in sig.input_specs
                   if s.kind == InputKind.USER_INPUT and s.arg.name in placeholders)
    returned = ep.graph.output_node().args[0]
    outputs = tuple(
        _value(returned[i].meta.get("val")) if isinstance(returned[i], torch.fx.Node) else
        _value(returned[i])
        for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.USER_OUTPUT)
    # Lowering lifts tensor constants into buffers of its own naming: only the buffers the
    # user's methods hold say which method this is.
    return inputs, outputs, frozenset(_buffers(ep) & known)


def _written(ep: ExportedProgram) -> set[str]:
    """The buffers ``ep`` writes, functional or in place (export's IR lists no mutation)."""
    written = set(ep.graph_signature.buffers_to_mutate.values())
    try:
        scan = find_mutations(ep)
    except Exception:  # noqa: BLE001 - unreadable: every buffer it holds may be written
        return _buffers(ep)
    written.update(state.name for state, nodes in scan.writers.items()
                   if state.kind == BUFFER and nodes)
    return written


@dataclass
class MethodState:
    """The buffers each method of a mapping uses, and which of them are state."""

    used: dict[str, frozenset[str]]
    """method -> the buffers it reads or writes."""
    written: frozenset[str]
    """the buffers some method writes."""
    fingerprints: dict[str, Fingerprint]
    known: frozenset[str]
    """every buffer some method holds."""

    def methods_of(self, ep: ExportedProgram) -> tuple[str, ...]:
        """The methods ``ep`` (or a lowering's copy of it) may be; empty if none."""
        wanted = _fingerprint(ep, self.known)
        return tuple(m for m, found in self.fingerprints.items() if found == wanted)

    def users(self, fqn: str) -> tuple[str, ...]:
        return tuple(m for m, used in self.used.items() if fqn in used)

    def shared(self, ep: ExportedProgram, written_here: set[str] = frozenset()
               ) -> dict[str, SharedBuffer]:
        """The buffers of ``ep`` that are state another method uses too.

        ``written_here``: buffers the lowered program writes (beyond what the mapping says).
        Conservative when ``ep`` is ambiguous: shared if any method besides any candidate
        uses it; when ``ep`` matches no method, shared if any method uses it.
        """
        this = self.methods_of(ep)
        found = {}
        for fqn in sorted(_touched(ep, set(written_here)) & self.known):
            if fqn not in self.written and fqn not in written_here:
                continue
            users = self.users(fqn)
            # Candidates hold the same buffers as ep, so with two or more every buffer is
            # used by a method ep may not be; with none, ep is one more user.
            others = set(users) - {this[0]} if len(this) == 1 else set(users)
            if others:
                found[fqn] = SharedBuffer(fqn, users, this)
        return found


def method_state(programs: Mapping[str, ExportedProgram]) -> MethodState:
    """Read ``programs`` (method name -> ExportedProgram) once; see :class:`MethodState`."""
    writes = {name: _written(ep) for name, ep in programs.items()}
    used = {name: frozenset(_touched(ep, writes[name])) for name, ep in programs.items()}
    known = set().union(*(_buffers(ep) for ep in programs.values()))
    prints = {name: _fingerprint(ep, known) for name, ep in programs.items()}
    return MethodState(used, frozenset().union(*writes.values()), prints, frozenset(known))


def checked_methods(helper: str, argument: str, methods: Any) -> dict[str, ExportedProgram]:
    """``methods`` as a dict, if it is a non-empty mapping of method names (strings) to
    ExportedPrograms; ExecuTorchInputError naming ``helper`` and ``argument`` otherwise."""
    if not isinstance(methods, Mapping) or not methods:
        raise ExecuTorchInputError(
            helper, argument, "the mapping {method name: ExportedProgram} of one model's "
            f"methods, e.g. {{'prefill': ep4, 'decode': ep1}}, as to_edge_transform_and_lower "
            f"takes it; got {type(methods).__name__}"
            + (" (empty)" if isinstance(methods, Mapping) else ""))
    for name, program in methods.items():
        if not isinstance(name, str) or not isinstance(program, ExportedProgram):
            raise ExecuTorchInputError(
                helper, f"{argument}[{name!r}]", "each method is an ExportedProgram "
                f"(torch.export.export) under its name (a str); got {type(name).__name__} "
                f"-> {type(program).__name__}")
    return dict(methods)
