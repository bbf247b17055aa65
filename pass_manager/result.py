"""What a pass returns."""

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

    ``modified`` is the pass's own claim (the manager measures the truth and reports a
    wrong claim); ``notes`` are remarks for the run report; ``statistics`` counts what the
    pass did, by a short description (``{"in-place ops rewritten: aten.add_": 3}``), per
    call (a pass is an immutable value: it returns its counts, never keeps them on self).
    """

    program: Any
    modified: bool | None = None
    notes: list[str] = field(default_factory=list)
    statistics: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return graph_module_of(self.program)
