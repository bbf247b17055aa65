"""Each built-in pass's real input, built from the KV decoder: the program as that pass
meets it in the flow.

Shared by the pass-contract tests and ``benchmarks/bench_manager_overhead.py`` (which times
every pass on these inputs, bare and managed): :data:`PASSES` names the five passes,
:func:`inputs_for` gives a factory of fresh input programs per pass.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
)
from passes.delegation import AllNodePartitioner, to_delegate
from passes.flow.examples import AnnotateEveryOpQuantizer, kv_decoder
from passes.flow.quantization import torchao_recipe

__all__ = ["PASSES", "inputs_for"]

PASSES: dict[str, Callable[[], Any]] = {
    "MarkMutableBuffers": MarkMutableBuffers,
    "InplaceToFunctional": InplaceToFunctional,
    "SkipAnnotateDataMovementOps": SkipAnnotateDataMovementOps,
    "UnfreezeMutableBuffer": UnfreezeMutableBuffer,
    "ConsumeBufferMutationsInDelegate": ConsumeBufferMutationsInDelegate,
}


def _annotated(functional: Any) -> torch.fx.GraphModule:
    """The graph SkipAnnotateDataMovementOps sees: marked, annotated by a QNN-style quantizer."""
    gm = copy.deepcopy(functional).module()
    quantizer = AnnotateEveryOpQuantizer()
    gm = quantizer.transform_for_annotation(gm)
    MarkMutableBuffers().call(gm)
    quantizer.annotate(gm)
    return gm


def _converted(functional: Any, example: tuple) -> torch.fx.GraphModule:
    """The graph UnfreezeMutableBuffer sees: torchao's flow (no passes, no reset) after one
    calibration call."""
    return torchao_recipe(functional, AnnotateEveryOpQuantizer(), [[example]],
                          decompose=False).left


def inputs_for(
    config: dict[str, Any], only: str | None = None
) -> tuple[dict[str, Callable[[], Any]], int]:
    """Per pass (or only ``only``), a factory of fresh input programs; the buffer bytes."""
    model, example = kv_decoder(**config)
    ep = torch.export.export(model, example)
    buffer_bytes = sum(b.numel() * b.element_size() for b in ep.state_dict.values()
                       if not isinstance(b, torch.nn.Parameter))
    if only == "MarkMutableBuffers":
        return {only: lambda: copy.deepcopy(ep)}, buffer_bytes
    marked = copy.deepcopy(ep)
    MarkMutableBuffers().call(marked)
    if only == "InplaceToFunctional":
        return {only: lambda: copy.deepcopy(marked)}, buffer_bytes
    functional = copy.deepcopy(marked)
    InplaceToFunctional().call(functional)
    functional.graph_module.recompile()
    factories: dict[str, Callable[[], Any]] = {
        "MarkMutableBuffers": lambda: copy.deepcopy(ep),
        "InplaceToFunctional": lambda: copy.deepcopy(marked),
        "SkipAnnotateDataMovementOps": lambda: _annotated(functional),
    }
    if only in (None, "UnfreezeMutableBuffer"):
        converted = _converted(functional, example)
        factories["UnfreezeMutableBuffer"] = lambda: copy.deepcopy(converted)
    if only in (None, "ConsumeBufferMutationsInDelegate"):
        lowered = to_delegate(copy.deepcopy(functional), AllNodePartitioner())
        factories["ConsumeBufferMutationsInDelegate"] = lambda: copy.deepcopy(lowered)
    return factories, buffer_bytes
