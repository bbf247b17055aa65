"""Observer constructors that keep the union of the ranges they see instead of an average.

A pt2e ``QuantizationSpec.observer_or_fake_quant_ctr`` is an observer or fake-quantize
class, or a torchao ``PartialWrapper`` around one (``Cls.with_args(**kwargs)``).
:func:`union_observer_ctr` gives the same constructor, keyword arguments and all, with a
moving-average observer (``MovingAverageMinMaxObserver``,
``MovingAveragePerChannelMinMaxObserver``, torchao's or ``torch.ao``'s) replaced by the
min-max observer of the same kind, inside a ``FakeQuantize`` (its ``observer`` argument)
as well. A ``FusedMovingAvgObsFakeQuantize`` (XNNPACK's and QnnQuantizer's QAT activations)
averages in its fused kernel whatever observer it holds, so it becomes a plain
``FakeQuantize`` of the same library around the min-max observer: the same fake
quantization forward and backward (straight-through), over the union of the ranges. A moving
average of per-call ranges is right for a value each call recomputes and wrong for state
written a part at a time, which holds the union of what was written.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["averages_by_construction", "class_name", "union_observer_ctr"]

# The keyword a moving-average observer takes and a min-max one does not.
_AVERAGING_ONLY = ("averaging_constant",)


@functools.cache
def _quantization_modules() -> tuple[tuple[Any, Any], ...]:
    """``(observer module, fake_quantize module)`` of torchao's pt2e flow and, where this
    torch still has it, of ``torch.ao``'s legacy flow: a spec may hold either's classes."""
    # Imported here: importing torchao is slow and noisy, and `import passes` should not.
    from torchao.quantization.pt2e import fake_quantize, observer

    modules = [(observer, fake_quantize)]
    try:
        from torch.ao.quantization import fake_quantize as legacy_fake_quantize
        from torch.ao.quantization import observer as legacy_observer
    except ImportError:  # torch without the legacy flow: torchao's classes only
        pass
    else:
        modules.append((legacy_observer, legacy_fake_quantize))
    return tuple(modules)


@functools.cache
def _union_classes() -> dict[type, type]:
    """Each moving-average observer class to its min-max counterpart."""
    classes = {}
    for obs, _ in _quantization_modules():
        classes[obs.MovingAverageMinMaxObserver] = obs.MinMaxObserver
        classes[obs.MovingAveragePerChannelMinMaxObserver] = obs.PerChannelMinMaxObserver
    return classes


@functools.cache
def _fake_quantize_classes() -> dict[type, type]:
    """Each FakeQuantize class whose ``observer`` argument can be swapped, to the observer
    class it defaults to."""
    return {fakes.FakeQuantize: fakes.MovingAverageMinMaxObserver
            for _, fakes in _quantization_modules()}


@functools.cache
def _fused_classes() -> dict[type, type]:
    """Each fused moving-average FakeQuantize class to the plain FakeQuantize of its library,
    which takes the same arguments and calls its observer instead of averaging itself."""
    return {fakes.FusedMovingAvgObsFakeQuantize: fakes.FakeQuantize
            for _, fakes in _quantization_modules()}


def _split(ctr: Any) -> tuple[Any, tuple, dict[str, Any], dict[str, Any]] | None:
    """``(class, positional args, keyword args, callable args)`` of a class or a
    ``PartialWrapper`` around one; None for anything else."""
    if isinstance(ctr, type):
        return ctr, (), {}, {}
    partial = getattr(ctr, "p", None)
    if isinstance(partial, functools.partial) and isinstance(partial.func, type):
        return partial.func, partial.args, dict(partial.keywords), dict(ctr.callable_args)
    return None


def _join(cls: type, args: tuple, keywords: dict[str, Any], callable_args: dict[str, Any]) -> Any:
    from torchao.quantization.pt2e.observer import PartialWrapper

    wrapper = PartialWrapper(functools.partial(cls, *args, **keywords))
    wrapper.callable_args = callable_args
    return wrapper


def union_observer_ctr(ctr: Any) -> Any | None:
    """``ctr`` observing the union of the ranges it sees, or None when it already does, or
    is not a constructor this knows. The class's other keyword arguments are kept; a fused
    moving-average fake-quantize becomes its library's plain ``FakeQuantize``."""
    parts = _split(ctr)
    if parts is None:
        return None
    cls, args, keywords, callable_args = parts
    union = _union_classes().get(cls)
    if union is not None:
        for name in _AVERAGING_ONLY:
            keywords.pop(name, None)
        return _join(union, args, keywords, callable_args)
    unfused = _fused_classes().get(cls)
    if unfused is not None:
        # Its fused kernel averages with the observer's averaging constant, whatever the
        # observer: only the plain FakeQuantize, which calls its observer, can take the union.
        default_observer = _fake_quantize_classes()[unfused]
        cls = unfused
    else:
        default_observer = _fake_quantize_classes().get(cls)
    if default_observer is None or args:
        return None
    observer = union_observer_ctr(keywords.get("observer", default_observer))
    if observer is None:
        return None
    keywords["observer"] = observer
    return _join(cls, args, keywords, callable_args)


def averages_by_construction(ctr: Any) -> bool:
    """Whether ``ctr`` builds a fused moving-average fake-quantize
    (``FusedMovingAvgObsFakeQuantize``, XNNPACK's and QnnQuantizer's QAT activations) that
    :func:`union_observer_ctr` cannot replace: one given positional arguments, or an
    observer it does not know."""
    parts = _split(ctr)
    return (parts is not None and issubclass(parts[0], tuple(_fused_classes()))
            and union_observer_ctr(ctr) is None)


def class_name(ctr: Any) -> str:
    """The observer class ``ctr`` builds (inside a FakeQuantize: ``FakeQuantize(observer)``)."""
    parts = _split(ctr)
    if parts is None:
        return repr(ctr)
    cls, _, keywords, _ = parts
    observer = keywords.get("observer", _fake_quantize_classes().get(cls))
    return cls.__name__ if observer is None else f"{cls.__name__}({class_name(observer)})"
