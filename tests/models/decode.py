"""How far a quantized program decodes from the fp32 model, call by call.

Shared by the quantization tests and ``benchmarks/bench_quantization_accuracy.py``:
:func:`decode` runs both and measures outputs and buffers (:class:`Decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pass_manager.validation import buffer_errors, output_errors, run_program

__all__ = ["Decode", "decode"]


@dataclass
class Decode:
    """Per call: max abs output error and max abs error of each buffer, vs fp32 eager."""

    output_errors: list[float] = field(default_factory=list)
    buffer_errors: list[dict[str, float]] = field(default_factory=list)
    buffer_scale: dict[str, float] = field(default_factory=dict)

    def worst_buffer_error(self, name: str) -> float:
        return max(step[name] for step in self.buffer_errors)


def decode(reference: torch.nn.Module, program: torch.nn.Module, inputs: Sequence[Any]) -> Decode:
    """Run deep copies of both once per call (``pass_manager.run_program``) and measure.

    Outputs and buffers are compared by FQN with ``output_errors`` / ``buffer_errors``;
    ``buffer_scale`` is each floating-point buffer's largest fp32 magnitude over the calls.
    """
    expected, actual = run_program(reference, inputs), run_program(program, inputs)
    scale: dict[str, float] = {}
    for buffers in expected.buffers:
        for name, value in buffers.items():
            if value.is_floating_point():
                scale[name] = max(scale.get(name, 0.0), value.abs().max().item())
    return Decode(output_errors(expected, actual), buffer_errors(expected, actual), scale)
