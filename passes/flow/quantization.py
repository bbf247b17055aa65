"""The reference the main job measures the passes against: torchao's pt2e recipe on a
program with mutable buffers as users run it today, with no pass.

This is a baseline, not a driver of the passes: quantizing *with* them is
:func:`passes.quantization.quantize_program`. :func:`torchao_recipe` is ``prepare_pt2e``
-> calibrate -> ``convert_pt2e`` on the functional form ``run_decompositions({})`` gives (or
on ``ep.module()`` as it is). Calibration leaves its state in the buffers, so the recipe's
program is converted twice: as it is (``left``) and with the buffers put back by hand
(``reset``), the like-for-like comparison for ``quantize_program``, where
``reset_mutable_buffers`` does the same. Both converts read one calibration, so each
observer's statistics are searched once
(:mod:`~passes.flow.histogram_searches`). The names of the main job's quantized columns
(:data:`COLUMN_NOTES`) live here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.fx import GraphModule

from pass_manager.validation import as_call, copy_program

from .histogram_searches import histogram_searches_found_once

__all__ = ["COLUMN_NOTES", "NO_PASSES", "RESET", "WITH_PASSES", "TorchaoRecipe",
           "check_quantizable", "holds_float64", "torchao_recipe"]

NO_PASSES, RESET, WITH_PASSES = (
    "quantized, no passes",
    "quantized, no passes, caches reset by hand",
    "quantized, with passes",
)


# What each of those programs is, for the main job's decode table.
COLUMN_NOTES = {
    NO_PASSES: "torchao's recipe as users run it (run_decompositions, prepare, calibrate, "
               "convert): the state calibration left behind is where decoding starts",
    RESET: "the same, with the buffers put back by hand after calibration",
    WITH_PASSES: "quantize_program: the passes, reset_mutable_buffers after calibration, "
                 "UnfreezeMutableBuffer after convert",
}


class TorchaoRecipe(NamedTuple):
    """:func:`torchao_recipe`'s two converted programs: ``left`` starts from the state the
    calibration left in the buffers, ``reset`` from their values before it (put back by
    hand)."""

    left: GraphModule
    reset: GraphModule


def torchao_recipe(
    program: ExportedProgram,
    quantizer: Any,
    calibration: Sequence[Sequence[Any]],
    *,
    decompose: bool = True,
    fold: bool = True,
    on_call: Callable[[int], None] | None = None,
) -> TorchaoRecipe:
    """torchao's pt2e recipe without the passes, on a copy of ``program``.

    ``decompose`` takes the functional form ``run_decompositions({})`` first (as the main
    job's reference does); without it ``ep.module()`` is prepared as it is, in place.
    ``calibration`` is a list of sequences of calls (each an argument tuple, an ``(args,
    kwargs)`` pair or a keyword mapping), run under ``torch.no_grad()``; the buffers are put
    back by hand before every sequence after the first. ``fold`` is ``convert_pt2e``'s
    ``fold_quantize``; ``on_call(index)`` runs after each call, counted over all of them.
    """
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    program = copy_program(program)
    if decompose:
        program = program.run_decompositions({})
    module = program.module()
    initial = {name: b.detach().clone() for name, b in module.named_buffers()}
    prepared = prepare_pt2e(module, quantizer)

    def put_back() -> None:
        with torch.no_grad():
            for name, value in initial.items():
                prepared.get_buffer(name).copy_(value)

    index = 0
    with torch.no_grad():
        for number, sequence in enumerate(calibration):
            if number:
                put_back()
            for args, kwargs in copy_program([as_call(call) for call in sequence]):
                prepared(*args, **kwargs)
                if on_call is not None:
                    on_call(index)
                index += 1
    with histogram_searches_found_once():  # both converts read one calibration
        left = convert_pt2e(copy_program(prepared), fold_quantize=fold)
        put_back()
        return TorchaoRecipe(left, convert_pt2e(prepared, fold_quantize=fold))


def holds_float64(module: torch.nn.Module, calls: Any) -> bool:
    """Whether ``module``'s parameters or buffers, or a tensor in ``calls``, are float64:
    the one floating-point dtype pt2e's quantize ops refuse (float16 and bfloat16 they
    convert)."""
    tensors = [*module.parameters(), *module.buffers(), *pytree.tree_leaves(calls)]
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tensors)


def check_quantizable(program: ExportedProgram, quantizer: Any) -> None:
    """Prepare ``program`` as :func:`~passes.quantization.quantize_program` does, without
    calibrating: a value the quantizer observes in a dtype pt2e's quantize ops cannot take
    (float64) is its :class:`~passes.errors.QuantizationInputError`, naming the node, found
    here in a fraction of a second instead of after the flow's fp32 stages."""
    from ..quantization import PassQuantizer, _flow_quantizer, _prepare

    _prepare(program, _flow_quantizer(quantizer, PassQuantizer), "quantize_program")
