"""Pausing Python's cyclic garbage collector while a pass builds its many small objects.

A pass over a decoder allocates tens of thousands of small tuples, dicts and lists, none of
which becomes garbage before it returns; with the collector running, every 700 of them
trigger a collection that walks them all again (about a tenth of the functionalization
pipeline's time on a 16-layer Llama). Paused, they are walked once, by the first
collection after the pass. The rollback record pauses it likewise while it records.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block (if it was enabled); re-enabled on
    exit, also when the block raises. Nested use is harmless."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
