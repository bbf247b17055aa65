"""What :class:`passes.InputsToBuffers` moved, kept on the program it returns, so the user can
read which input became which buffer and :class:`passes.BuffersToInputs` can restore the call
signature exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from pass_manager import graph_module_of

__all__ = ["CARRIED_META", "EXAMPLE_META", "CarriedRecord", "Moved", "records_of"]

CARRIED_META = "carried_state"
"""``graph_module.meta`` key: the tuple of :class:`CarriedRecord`, one per InputsToBuffers run
that changed the program, oldest first."""

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
    is still the one the run left, since the positions it keeps are positions in that one."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    moved: tuple[Moved, ...]
    example_inputs: Any = None
    arg_names: tuple[str, ...] | None = None
    resident_in_spec: pytree.TreeSpec | None = None
    resident_out_spec: pytree.TreeSpec | None = None

    def fits(self, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec) -> bool:
        """Whether a program of these call specs still has the signature the run left."""
        return self.resident_in_spec == in_spec and self.resident_out_spec == out_spec


def records_of(program: Any) -> tuple[CarriedRecord, ...]:
    """The records kept on ``program`` (empty when InputsToBuffers never moved anything)."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else graph_module_of(
        program)
    return tuple(gm.meta.get(CARRIED_META, ()))
