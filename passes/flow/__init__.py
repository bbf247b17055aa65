"""The main job: the whole mutable-buffer flow on one model (``python -m passes run``).

* :mod:`~passes.flow.cli`: the command line, its report and exit statuses;
* :mod:`~passes.flow.factory`: the factory contract (v1 tuple, v2 mapping) and export;
* :mod:`~passes.flow.run`: export -> passes -> quantization -> delegation -> decode, checked
  against eager (:func:`run_flow`), quantizing through ``quantize_program`` (no re-export)
  next to torchao's recipe without the passes (:mod:`~passes.flow.quantization`); its
  other stages live in :mod:`~passes.flow.integer_state`
  (``--quantize-state``), :mod:`~passes.flow.delegation` and
  :mod:`~passes.flow.executorch_stage`; the checks on quantized programs in
  :mod:`~passes.flow.checks`;
* :mod:`~passes.flow.result`: what a run found (checks, failures, tables);
* :mod:`~passes.flow.examples`: the built-in decoder and quantizers (also
  ``passes.examples``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Check",
    "FlowError",
    "FlowResult",
    "ModelError",
    "ModelSpec",
    "model_spec",
    "run_flow",
    "run_model",
]

# Imported on first use: the command line quiets torchao's import-time logging before
# anything imports torchao, and ``python -m passes run`` enters through this package.
_DEFINED_IN = {
    "ModelError": "factory", "ModelSpec": "factory", "model_spec": "factory",
    "Check": "result", "FlowError": "result", "FlowResult": "result",
    "run_flow": "run", "run_model": "run",
}


def __getattr__(name: str) -> Any:
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
