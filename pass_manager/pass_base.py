"""The Pass abstraction: a small, immutable unit of rewriting with a declared contract."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.fx.passes.infra.pass_base import PassResult as TorchPassResult

from .conditions import ALL_CONDITIONS, Condition, as_condition_set
from .effects import Effects
from .errors import PipelineElementError
from .pipeline_text import format_value, pass_options, register
from .program import EXPORTED_PROGRAM, GRAPH_MODULE, graph_module_of
from .report import PassResult
from .running import Runner, default_instruments

__all__ = ["Pass", "PassResult", "as_pass", "function_pass"]


class Pass:
    """Base class of every pass.

    A subclass declares what it ``requires``, ``provides`` and ``preserves`` (conditions;
    every other one is invalidated when it changes the program), the program forms it
    ``accepts`` and its ``effects`` (what it may change), and implements ``call``, which may
    rewrite in place and return None, or return a :class:`PassResult` (a torch
    ``PassResult`` or a bare program also do). Options are fields of a frozen dataclass,
    so a pass prints as ``Name(option=value)`` and as pipeline text ``Name{option=value}``;
    every subclass is registered by its class name for ``parse_pipeline``::

        @dataclass(frozen=True, repr=False)
        class DropDeadCode(Pass):
            provides = frozenset({NoDeadCode})
            keep_prints: bool = False

            def call(self, program):
                changed = graph_module_of(program).graph.eliminate_dead_code()
                return PassResult(program, changed)
    """

    requires: ClassVar[Iterable[Condition]] = frozenset()
    provides: ClassVar[Iterable[Condition]] = frozenset()
    preserves: ClassVar[Iterable[Condition]] = frozenset()
    accepts: ClassVar[tuple[str, ...]] = (GRAPH_MODULE, EXPORTED_PROGRAM)
    # The cautious default: may change anything but tensor data, edit meta objects in
    # place, and returns the program it was given.
    effects: ClassVar[Effects] = Effects()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register(cls)

    @property
    def name(self) -> str:
        return type(self).__name__

    def call(self, program: Any) -> PassResult | None:
        raise NotImplementedError(f"{self.name} must implement call(program)")

    def __call__(self, graph_module: Any) -> TorchPassResult:
        """Torch-style entry point: run this pass alone, conditions checked, transactionally."""
        alone = as_pass(self)  # checks its declarations
        result = Runner([alone], default_instruments(), name=self.name, alone=True).run(
            graph_module)
        return TorchPassResult(result.graph_module, result.modified)

    def __repr__(self) -> str:
        # A pass that is not a dataclass shows what its constructor stored, not "Name()".
        options = pass_options(self) or {
            key: value for key, value in getattr(self, "__dict__", {}).items()
            if not key.startswith("_")}
        shown = ", ".join(f"{key}={format_value(value, python=True)}"
                          for key, value in options.items())
        return f"{self.name}({shown})"


class _CallablePass(Pass):
    """A plain function or torch ``PassBase`` in a pipeline: nothing is known of it, so it
    has no conditions, preserves nothing, and may change anything (tensor data included)
    and return its input or a new program. Given an ExportedProgram, it gets its graph."""

    _unregistered = True
    effects = Effects.anything()

    def __init__(self, fn: Callable[[Any], Any], name: str):
        self._fn = fn
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def call(self, program: Any) -> Any:
        out = self._fn(graph_module_of(program))
        # The core loop puts a graph module returned for an ExportedProgram back into it.
        return TorchPassResult(out, None) if isinstance(out, torch.fx.GraphModule) else out

    def __repr__(self) -> str:
        return f"<pass {self._name}>"


# What a pipeline element must be (said when one is not).
_NEEDS = ("a Pass instance (implementing call(program)), a torch PassBase or a callable "
          "taking a GraphModule")


def as_pass(item: Any) -> Pass:
    """Wrap a pipeline element (Pass, torch PassBase, or plain callable) as a Pass."""
    if isinstance(item, Pass):
        if not isinstance(item.effects, Effects):  # it would fail inside its run, cryptically
            raise PipelineElementError(item.name, "pass", _NEEDS, (
                f"{item.name}.effects is {item.effects!r}: declare an Effects, e.g. "
                "effects = Effects.rewrite() or Effects.only_meta('key')"))
        if type(item).call is Pass.call:  # it would fail at its turn, after the passes before
            raise PipelineElementError(item.name, "pass", _NEEDS,
                                       f"{item.name} must implement call(program)")
        return item
    if isinstance(item, type) and issubclass(item, Pass):
        raise PipelineElementError(item.__name__, "pass", _NEEDS, (
            f"pipeline got the class {item.__name__}; pass an instance: {item.__name__}()"))
    if callable(item):  # a torch PassBase too: named by its class, having no __name__
        return _CallablePass(item, getattr(item, "__name__", None) or type(item).__name__)
    raise PipelineElementError(item, "pass", _NEEDS,
                               f"pipeline element {item!r} is not a pass: give {_NEEDS}")


# A function may return its input or a new program unless its effects say which.
_FUNCTION_EFFECTS = Effects(in_place=None)


def function_pass(
    fn: Callable[[Any], Any] | None = None,
    *,
    requires: Iterable[Condition] = (),
    provides: Iterable[Condition] = (),
    preserves: Iterable[Condition] = (),
    accepts: tuple[str, ...] = (GRAPH_MODULE, EXPORTED_PROGRAM),
    effects: Effects = _FUNCTION_EFFECTS,
    name: str | None = None,
) -> Any:
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
            "preserves": (preserves if preserves == ALL_CONDITIONS
                          else as_condition_set(preserves)),
            "accepts": tuple(accepts),
            "effects": effects,
            "call": lambda self, program: func(program),
            "__doc__": func.__doc__,
            "__module__": getattr(func, "__module__", __name__),
        }
        return type(name or func.__name__, (Pass,), attrs)()

    return wrap(fn) if fn is not None else wrap
