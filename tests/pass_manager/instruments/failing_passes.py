"""Deliberately broken passes for the reproducer tests (importable by a replay subprocess)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pass_manager import Pass, PassResult, graph_module_of

__all__ = ["AddToSub", "FailAfterRewrite", "FailsWithAnyOption", "FailsWithItsConstructorOption",
           "Nothing"]

aten = torch.ops.aten


def _add_to_sub(program: Any) -> bool:
    changed = False
    for node in graph_module_of(program).graph.nodes:
        if node.target == aten.add.Tensor:
            node.target = aten.sub.Tensor
            changed = True
    return changed


@dataclass(frozen=True, repr=False)
class FailAfterRewrite(Pass):
    """Rewrites every add into a sub, then raises: a bug a reproducer must catch."""

    message: str = "deliberate failure"

    def call(self, program: Any) -> PassResult:
        _add_to_sub(program)
        raise RuntimeError(self.message)


@dataclass(frozen=True, repr=False)
class AddToSub(Pass):
    """Rewrites every add into a sub and says nothing: only validation sees it is wrong."""

    def call(self, program: Any) -> PassResult:
        return PassResult(program, _add_to_sub(program))


@dataclass(frozen=True, repr=False)
class Nothing(Pass):
    """Changes nothing (puts a failing pass at another place than the first)."""

    def call(self, program: Any) -> PassResult:
        return PassResult(program, False)


class FailsWithItsConstructorOption(Pass):
    """Not a dataclass: its option lives only in its constructor (a common first pass),
    and its failure depends on it."""

    def __init__(self, threshold: float = 1.0):
        self.threshold = threshold

    def call(self, program: Any) -> PassResult:
        _add_to_sub(program)
        raise RuntimeError(f"threshold {self.threshold} exceeded")


@dataclass(frozen=True, repr=False)
class FailsWithAnyOption(Pass):
    """An option of any value (a tensor, a dtype, a function): its failure depends on it."""

    option: Any = None

    def call(self, program: Any) -> PassResult:
        _add_to_sub(program)
        raise RuntimeError(f"failed with {self.option!r}")
