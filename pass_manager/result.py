"""What a pass returns: the program, its own claim of having changed it, and notes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .program import graph_module_of

__all__ = ["PassResult"]


@dataclass
class PassResult:
    """What a pass returns: the program (same form as its input) and whether it changed.

    ``modified`` is the pass's own claim; the manager measures the truth and reports a
    pass whose claim is wrong. ``notes`` are human-readable remarks that end up in the run
    report (for example why a rewrite was skipped). ``statistics`` counts what the pass
    did, by a short description (``{"in-place ops rewritten: aten.add_": 3}``); the report
    shows them per pass, like MLIR's ``-pass-statistics``. A pass is an immutable value
    that may run many times, so it counts per call (a ``collections.Counter`` is handy)
    and returns the counts rather than keeping them on ``self``.
    """

    program: Any
    modified: bool | None = None
    notes: list[str] = field(default_factory=list)
    statistics: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return graph_module_of(self.program)
