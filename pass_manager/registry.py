"""Every Pass subclass by name, so pipeline text can name passes and errors can suggest them.

``Pass.__init_subclass__`` registers each subclass here. The registry holds weak
references: a class defined in a function (a test, ``function_pass``) leaves it when it
is garbage collected. Two live classes with one name make that name ambiguous; looking
it up then raises rather than picking one.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["register", "registered", "registered_name", "registered_passes"]

_classes: weakref.WeakSet = weakref.WeakSet()


def register(cls: type) -> None:
    """Record a pass class (called by ``Pass.__init_subclass__``)."""
    _classes.add(cls)


def registered_passes() -> list[type]:
    """Every registered pass class still alive, in a stable order (module, then name)."""
    return sorted(
        (cls for cls in _classes if not cls.__dict__.get("_unregistered", False)),
        key=lambda cls: (cls.__module__, cls.__qualname__),
    )


def registered(name: str) -> list[type]:
    """The live pass classes registered under ``name`` (more than one means ambiguous)."""
    return [cls for cls in registered_passes() if registered_name(cls) == name]


def registered_name(cls: Any) -> str:
    """The name a pass class is known by in pipeline text: its class name."""
    return cls.__name__
