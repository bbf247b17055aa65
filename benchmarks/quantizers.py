"""A stateful model and the pt2e flow shared by the quantization tests and the
decode-accuracy benchmark.

The quantizers themselves (:class:`~passes.examples.AnnotateEveryOpQuantizer`, the QNN
style, and :func:`~passes.examples.xnnpack_quantizer`) ship with the package.
:func:`quantize` runs torchao's prepare / calibrate / convert with or without the
mutable-buffer passes; :func:`decode` compares a program with fp32 eager call by call.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import Quantizer

from pass_manager import PassManager
from pass_manager.validation import buffer_errors, output_errors, run_program
from passes import InplaceToFunctional, MarkMutableBuffers, reset_mutable_buffers
from passes.quantization import PassQuantizer
from passes.skip_annotate_data_movement_ops import SkipAnnotateDataMovementOps
from passes.unfreeze_mutable_buffer import UnfreezeMutableBuffer

__all__ = [
    "Accumulator",
    "Decode",
    "accumulator_inputs",
    "convert",
    "decode",
    "prepare_and_calibrate",
    "quantize",
]


class Accumulator(torch.nn.Module):
    """Keeps a decaying running sum in a buffer updated by a compute op (``add_``).

    ``forward`` reads the state before updating it, through an ``add`` and a ``mul`` that
    quantizers annotate; ``acc <- acc / 2 + y`` stays bounded (at most twice the largest
    input's projection).
    """

    def __init__(self, dim: int = 16, seed: int = 0):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.proj = torch.nn.Linear(dim, dim)
            self.out = torch.nn.Linear(dim, dim)
            initial = torch.randn(1, dim)
        finally:
            torch.random.set_rng_state(generator_state)
        # A non-zero initial state: the first call already reads (quantized) state.
        self.register_buffer("acc", initial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        out = self.out(y + self.acc)
        self.acc.add_(y - 0.5 * self.acc)
        return out


def accumulator_inputs(steps: int, dim: int = 16, seed: int = 0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, dim, generator=generator),) for _ in range(steps)]


def quantize(
    model: torch.nn.Module,
    example_inputs: tuple,
    quantizer: Quantizer,
    calibration: Sequence[Sequence[tuple]],
    *,
    passes: bool,
    functional: bool = False,
    fold_quantize: bool = True,
    reset: bool = True,
) -> GraphModule:
    """Export a deep copy of ``model`` and quantize it with torchao's pt2e flow.

    :func:`prepare_and_calibrate`, then :func:`convert`.
    """
    prepared = prepare_and_calibrate(
        model,
        example_inputs,
        quantizer,
        calibration,
        passes=passes,
        functional=functional,
        reset=reset,
    )
    return convert(prepared, passes=passes, fold_quantize=fold_quantize)


def prepare_and_calibrate(
    model: torch.nn.Module,
    example_inputs: tuple,
    quantizer: Quantizer,
    calibration: Sequence[Sequence[tuple]],
    *,
    passes: bool,
    functional: bool = False,
    reset: bool = True,
) -> GraphModule:
    """Export a deep copy of ``model``, ``prepare_pt2e`` it and run the calibration.

    ``calibration`` is a list of sequences (each a list of argument tuples); the buffers
    start every sequence from their initial values, and are reset once more after the
    last one unless ``reset`` is False. With ``passes``: ``PassQuantizer`` runs
    MarkMutableBuffers (+ InplaceToFunctional when ``functional``) before annotation and
    SkipAnnotateDataMovementOps after it, and resets use ``reset_mutable_buffers``.
    Without: the plain flow, resets by hand, and ``functional`` takes the functional form
    from ``run_decompositions({})``.
    """
    exported = torch.export.export(copy.deepcopy(model), example_inputs)
    if functional and not passes:
        exported = exported.run_decompositions({})
    gm = exported.module()
    initial = {name: b.detach().clone() for name, b in gm.named_buffers()}
    if passes:
        transform = [MarkMutableBuffers()] + ([InplaceToFunctional()] if functional else [])
        quantizer = PassQuantizer(
            quantizer, transform=transform, after_annotate=[SkipAnnotateDataMovementOps()]
        )
    prepared = prepare_pt2e(gm, quantizer)

    def restore() -> None:
        if passes:
            reset_mutable_buffers(prepared)
            return
        with torch.no_grad():
            for name, value in initial.items():
                prepared.get_buffer(name).copy_(value)

    with torch.no_grad():
        for index, sequence in enumerate(calibration):
            if index:
                restore()
            for args in sequence:
                prepared(*copy.deepcopy(args))
    if reset:
        restore()
    return prepared


def convert(prepared: GraphModule, *, passes: bool, fold_quantize: bool = True) -> GraphModule:
    """``convert_pt2e`` a deep copy of ``prepared``; with ``passes``, then UnfreezeMutableBuffer."""
    converted = convert_pt2e(copy.deepcopy(prepared), fold_quantize=fold_quantize)
    if passes:
        converted = PassManager([UnfreezeMutableBuffer()]).run(converted).program
    return converted


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
