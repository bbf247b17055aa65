"""The Pass abstraction: a unit of rewriting with declared conditions.

A pass declares what it ``requires`` before it runs, what it ``provides`` after, and
what it ``preserves`` (conditions that hold afterwards if they held before). Everything
else is assumed invalidated when the pass changes the program. The manager checks the
declarations; the pass only implements ``call``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from .conditions import Condition, as_condition_set
from .program import EXPORTED_PROGRAM, GRAPH_MODULE, graph_module_of, program_form

__all__ = ["Pass", "PassResult", "as_pass", "function_pass", "known_passes"]


@dataclass
class PassResult:
    """What a pass returns: the program (same form as its input) and whether it changed.

    ``modified`` is the pass's own claim; the manager measures the truth with a
    fingerprint and reports a pass whose claim is wrong. ``notes`` are human-readable
    remarks that end up in the run report (for example why a rewrite was skipped).
    """

    program: Any
    modified: bool | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return graph_module_of(self.program)

    def to_torch(self) -> TorchPassResult:
        return TorchPassResult(self.graph_module, bool(self.modified))


class Pass:
    """Base class of every pass.

    Subclasses set the class attributes and implement :meth:`call`::

        class DropDeadCode(Pass):
            provides = {NoDeadCode}
            preserves = {Functional}

            def call(self, program):
                changed = graph_module_of(program).graph.eliminate_dead_code()
                return PassResult(program, changed)

    ``call`` may rewrite in place and return None, or return a :class:`PassResult`
    (also accepted: a torch ``PassResult`` or a bare program).
    """

    requires: ClassVar[Iterable[Condition]] = frozenset()
    provides: ClassVar[Iterable[Condition]] = frozenset()
    preserves: ClassVar[Iterable[Condition]] = frozenset()
    # The program forms this pass accepts; the manager raises ProgramFormError otherwise.
    accepts: ClassVar[tuple[str, ...]] = (GRAPH_MODULE, EXPORTED_PROGRAM)

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def required(self) -> frozenset:
        return as_condition_set(self.requires)

    @property
    def provided(self) -> frozenset:
        return as_condition_set(self.provides)

    @property
    def preserved(self) -> frozenset:
        return as_condition_set(self.preserves)

    def call(self, program: Any) -> PassResult | None:
        raise NotImplementedError(f"{self.name} must implement call(program)")

    def __call__(self, graph_module: Any) -> TorchPassResult:
        """Torch-style entry point: run this pass alone, conditions checked, transactionally."""
        from .manager import PassManager

        return PassManager([self])(graph_module)

    def __repr__(self) -> str:
        return f"{self.name}()"


class _CallablePass(Pass):
    """A plain function or torch ``PassBase`` in a pipeline: no conditions, preserves nothing."""

    def __init__(self, fn: Callable[[Any], Any], name: str):
        self._fn = fn
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def call(self, program: Any) -> Any:
        if program_form(program) == EXPORTED_PROGRAM:
            gm = program.graph_module
            out = self._fn(gm)
            new_gm = out.graph_module if isinstance(out, TorchPassResult) else out
            if isinstance(new_gm, torch.fx.GraphModule) and new_gm is not gm:
                return PassResult(program._update(new_gm, program.graph_signature))
            return PassResult(program, getattr(out, "modified", None))
        return self._fn(program)


def as_pass(item: Any) -> Pass:
    """Wrap a pipeline element (Pass, torch PassBase, or plain callable) as a Pass."""
    if isinstance(item, Pass):
        return item
    if isinstance(item, type) and issubclass(item, Pass):
        raise TypeError(
            f"pipeline got the class {item.__name__}; pass an instance: {item.__name__}()"
        )
    if isinstance(item, PassBase):
        return _CallablePass(item, type(item).__name__)
    if callable(item):
        name = getattr(item, "__name__", None) or type(item).__name__
        return _CallablePass(item, name)
    raise TypeError(f"pipeline element {item!r} is not a pass or a callable")


def function_pass(
    fn: Callable[[Any], Any] | None = None,
    *,
    requires: Iterable[Condition] = (),
    provides: Iterable[Condition] = (),
    preserves: Iterable[Condition] = (),
    accepts: tuple[str, ...] = (GRAPH_MODULE, EXPORTED_PROGRAM),
    name: str | None = None,
):
    """Turn ``fn(program) -> PassResult | program | None`` into a Pass with conditions.

    Example:
        >>> @function_pass(provides={NoDeadCode})
        ... def drop_dead_code(gm):
        ...     gm.graph.eliminate_dead_code()
        >>> PassManager([drop_dead_code]).run(gm)
    """

    def wrap(func: Callable[[Any], Any]) -> Pass:
        attrs = {
            "requires": as_condition_set(requires),
            "provides": as_condition_set(provides),
            "preserves": as_condition_set(preserves),
            "accepts": tuple(accepts),
            "call": lambda self, program: func(program),
            "__doc__": func.__doc__,
            "__module__": getattr(func, "__module__", __name__),
        }
        cls = type(name or func.__name__, (Pass,), attrs)
        instance = cls()
        functools.update_wrapper(instance, func, assigned=("__doc__",), updated=())
        return instance

    return wrap(fn) if fn is not None else wrap


def known_passes() -> list[type[Pass]]:
    """Every Pass subclass imported so far (used to suggest providers of a condition)."""
    seen: list[type[Pass]] = []
    stack = list(Pass.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls in seen or cls is _CallablePass:
            continue
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return seen
