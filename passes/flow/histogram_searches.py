"""torchao's ``HistogramObserver`` parameter search, done once for each set of statistics
while the main job runs.

``HistogramObserver.calculate_qparams`` searches its histogram for the range that loses the
least (an L2 search stepping one bin at a time in Python): about 0.15 s an observer, where
everything else a convert does to it takes microseconds. XNNPACK's static config observes
every activation with one, and the main job converts the same calibration more than once: torchao's recipe as calibration left the buffers and reset by hand (the same
statistics), and ``quantize_program``, whose observers see what the recipe's reset
observers saw whenever the passes change no observed value. Searching again gave the same
answer: 86 of the default job's 139 searches, 10.8 of its 23.2 s of CPU.

The search reads only the observer's histogram, its ``min_val`` / ``max_val`` and its
``bins`` / ``dst_nbins`` (the quantized dtype's levels), so the answer is keyed on exactly
those (and the observer's class): within :func:`histogram_searches_found_once` the same
statistics are searched once and answered with copies of the same tensors after that,
bit for bit what searching again gives. Outside it torchao's search runs as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["histogram_searches_found_once"]

_Found = tuple[torch.Tensor, torch.Tensor]
# The memo of the outermost open scope; None when no scope is open.
_found: dict[tuple, _Found] | None = None


def _statistics(observer: torch.nn.Module) -> tuple:
    digest = hashlib.blake2b()
    for tensor in (observer.histogram, observer.min_val, observer.max_val):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return type(observer), observer.bins, observer.dst_nbins, digest.hexdigest()


def _search_found_once(search):
    def search_once(observer: torch.nn.Module) -> _Found:
        if _found is None:  # a copy of the observer's method kept past the scope
            return search(observer)
        key = _statistics(observer)
        if key not in _found:
            _found[key] = tuple(t.clone() for t in search(observer))
        return tuple(t.clone() for t in _found[key])

    search_once.__wrapped__ = search
    return search_once


@contextmanager
def histogram_searches_found_once() -> Iterator[None]:
    """Within this block, torchao's ``HistogramObserver`` searches each set of statistics
    once (see the module docstring). Blocks nest: an inner one shares the outer one's
    answers, and the outermost restores torchao's search when it ends."""
    global _found
    from torchao.quantization.pt2e.observer import HistogramObserver

    if _found is not None:
        yield
        return
    search = HistogramObserver._non_linear_param_search
    HistogramObserver._non_linear_param_search = _search_found_once(search)
    _found = {}
    try:
        yield
    finally:
        _found = None
        HistogramObserver._non_linear_param_search = search
