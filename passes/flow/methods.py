"""Factory contract v3: one model deployed as several methods sharing its state.

Backends that need static shapes deploy a decoder as a prefill of N tokens and a one-token
decode, two methods of one ``.pte`` over one KV cache. A factory says so by returning a
mapping with

* ``module``: the ``nn.Module`` every method calls (its ``forward``);
* ``methods``: method name -> how that method is exported, a mapping with
  ``example_args`` (a tuple), ``example_kwargs`` (a mapping), ``dynamic_shapes`` and
  ``export`` (``"strict"`` / ``"non-strict"``), each optional as in contract v2;
* ``steps``: the calls in deployment order, each ``(method, args)``,
  ``(method, args, kwargs)`` or ``(method, kwargs_mapping)`` (default: every method's
  export example once, in the order ``methods`` lists them);
* ``export`` (optional): the default export mode of the methods.

Every method is exported from the same module, so the methods name their buffers alike:
the same fully-qualified name is the same state in every method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pass_manager.validation import Call, as_call

from .factory import EXPORT_MODES, Exported, ModelError, export_program

__all__ = ["MethodCall", "MethodSpec", "MethodsSpec", "export_methods", "methods_spec"]

_V3_KEYS = {"module", "methods", "steps", "export"}
_METHOD_KEYS = {"example_args", "example_kwargs", "dynamic_shapes", "export"}


@dataclass
class MethodSpec:
    """How one method is exported: its example call, dynamic shapes and export mode."""

    example_args: tuple = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    dynamic_shapes: Any = None
    export: str | None = None

    @property
    def example(self) -> Call:
        return self.example_args, self.example_kwargs


MethodCall = tuple[str, tuple, dict]
"""One call of the deployment sequence: ``(method, args, kwargs)``."""


@dataclass
class MethodsSpec:
    """A model, its methods and the calls the deployment makes, in order."""

    module: torch.nn.Module
    methods: dict[str, MethodSpec]
    steps: list[MethodCall]

    @property
    def calls_by_method(self) -> dict[str, list[tuple[tuple, dict]]]:
        """Each method's own calls, in order (what quantizing it on its own calibrates on)."""
        found: dict[str, list[tuple[tuple, dict]]] = {name: [] for name in self.methods}
        for method, args, kwargs in self.steps:
            found[method].append((args, kwargs))
        return found


def is_methods_factory(made: Any) -> bool:
    """Whether a factory's result is contract v3 (a mapping naming ``methods``)."""
    return isinstance(made, Mapping) and "methods" in made


def methods_spec(made: Mapping, name: str, steps: int) -> MethodsSpec:
    """Read a v3 factory result; ``steps`` is how many calls to keep. ModelError otherwise."""
    unknown = sorted(set(made) - _V3_KEYS)
    if unknown:
        raise ModelError(f"{name}() returned unknown keys {', '.join(map(repr, unknown))} "
                         f"beside 'methods'; known: {', '.join(sorted(_V3_KEYS))}")
    module = made.get("module")
    if isinstance(module, torch.export.ExportedProgram):
        module = module.module()
    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"{name}() must return an nn.Module as 'module', got "
                         f"{type(module).__name__}")
    with contextlib.suppress(NotImplementedError):  # an ep.module() is inference form already
        module.eval()
    default_mode = _mode(made.get("export"), name, "'export'")
    methods = made["methods"]
    if not isinstance(methods, Mapping) or not methods:
        raise ModelError(f"{name}(): 'methods' must map method names to their export "
                         "examples, e.g. {'prefill': {'example_args': (...)}, 'decode': ...}")
    specs = {str(method): _method(method, entry, name, default_mode)
             for method, entry in methods.items()}
    given = made.get("steps")
    if given is not None and (not isinstance(given, Sequence) or isinstance(given, str)):
        raise ModelError(f"{name}(): 'steps' must be a list of (method, args[, kwargs]) calls")
    calls = ([_step(step, index, specs, name) for index, step in enumerate(given)]
             if given else [(m, s.example_args, dict(s.example_kwargs))
                            for m, s in specs.items()])
    return MethodsSpec(module, specs, calls[:steps])


def export_methods(spec: MethodsSpec, mode: str | None = None) -> dict[str, Exported]:
    """Export every method of ``spec`` as :func:`~passes.flow.factory.export_program` does;
    ``mode`` forces an export mode for all of them. ModelError names the failing method."""
    exported = {}
    for method, entry in spec.methods.items():
        try:
            exported[method] = export_program(
                spec.module, entry.example_args, entry.example_kwargs,
                dynamic_shapes=entry.dynamic_shapes, mode=mode or entry.export)
        except ModelError as e:
            raise ModelError(f"method {method!r} is not exportable: {e}") from e
    return exported


def _mode(mode: Any, name: str, where: str) -> str | None:
    if mode is not None and mode not in EXPORT_MODES:
        raise ModelError(f"{name}(): {where} must be one of {EXPORT_MODES}, got {mode!r}")
    return mode


def _method(method: Any, entry: Any, name: str, default_mode: str | None) -> MethodSpec:
    where = f"methods[{method!r}]"
    if not isinstance(entry, Mapping):
        raise ModelError(f"{name}(): {where} must be a mapping with 'example_args' and/or "
                         f"'example_kwargs', got {type(entry).__name__}")
    unknown = sorted(set(entry) - _METHOD_KEYS)
    if unknown:
        raise ModelError(f"{name}(): {where} has unknown keys {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(_METHOD_KEYS))}")
    args, kwargs = entry.get("example_args", ()), entry.get("example_kwargs") or {}
    if not isinstance(args, tuple) or not isinstance(kwargs, Mapping):
        raise ModelError(f"{name}(): {where}: 'example_args' must be a tuple and "
                         "'example_kwargs' a mapping")
    mode = _mode(entry.get("export"), name, f"{where}['export']") or default_mode
    return MethodSpec(args, dict(kwargs), entry.get("dynamic_shapes"), mode)


def _step(step: Any, index: int, methods: Mapping[str, MethodSpec], name: str) -> MethodCall:
    where = f"{name}(): steps[{index}]"
    if not isinstance(step, (tuple, list)) or len(step) not in (2, 3):
        raise ModelError(f"{where} must be (method, args), (method, args, kwargs) or "
                         f"(method, kwargs), got {type(step).__name__}")
    method = step[0]
    if method not in methods:
        raise ModelError(f"{where} calls {method!r}, which is not one of the methods "
                         f"({', '.join(map(repr, methods))})")
    inputs = step[1] if len(step) == 2 else (step[1], step[2])
    if len(step) == 3 and not (isinstance(step[1], tuple) and isinstance(step[2], Mapping)):
        raise ModelError(f"{where}: (method, args, kwargs) needs a tuple and a mapping")
    args, kwargs = as_call(inputs)
    return method, tuple(args), dict(kwargs)
