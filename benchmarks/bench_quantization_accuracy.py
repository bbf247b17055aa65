"""Decode accuracy of pt2e-quantized stateful models, without and with the passes.

For each model (KV decoder with an ``index_copy_`` / ``index_put_`` cache, accumulator
updated by ``add_``), quantizer (annotate-every-op QNN style, torchao's XNNPACK-style),
program form (in-place ``ep.module()``, functional after InplaceToFunctional) and
``fold_quantize``, prints the max abs error vs the fp32 eager model at every decode step:

* ``plain``: torchao's flow as is (prepare, calibrate, convert; no reset):
  :func:`passes.flow.quantization.torchao_recipe`, on ``ep.module()`` (in-place) or after
  ``run_decompositions`` (functional);
* ``passes``: :func:`passes.quantization.quantize_program` (PassQuantizer with
  MarkMutableBuffers + InplaceToFunctional and SkipAnnotateDataMovementOps,
  reset_mutable_buffers, convert, UnfreezeMutableBuffer), on the exported program
  (in-place) or on its functional form (MarkMutableBuffers + InplaceToFunctional first).

The fp32 reference has error 0 by definition. The KV decoders are calibrated on single
tokens at position 0 (without the passes the cache is put back to empty before each;
with them calibration is one run of calls, the cache sharing the written value's grid),
the accumulator on one decode sequence. Both flows are the main job's; the models and the
decode measure come from ``tests/models``. Run:
``python -m benchmarks.bench_quantization_accuracy [--steps N]``.
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import torch

from pass_manager import PassManager
from pass_manager.validation import copy_program
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.flow.examples import (
    AnnotateEveryOpQuantizer,
    decode_inputs,
    kv_decoder,
    xnnpack_quantizer,
)
from passes.flow.quantization import torchao_recipe
from passes.quantization import quantize_program
from tests.models.accumulators import Accumulator, accumulator_inputs
from tests.models.decode import decode

__all__ = ["accuracy_rows", "main"]

QUANTIZERS = {"every_op": AnnotateEveryOpQuantizer, "xnnpack": xnnpack_quantizer}


def _cases(steps: int):
    for cache_update in ("index_copy", "index_put"):
        model, example = kv_decoder(1, cache_update=cache_update)
        inputs = decode_inputs(model.cfg, steps, seed=3)
        calibration = [[(x, torch.tensor([0]))] for x, _ in inputs]
        yield f"kv_{cache_update}", model, example, inputs, calibration
    model = Accumulator()
    inputs = accumulator_inputs(steps, seed=3)
    yield "accumulator_add_", model, inputs[0], inputs, [inputs]


def accuracy_rows(steps: int = 10):
    """Yield ``(model, quantizer, form, fold, flow, step errors, worst buffer error)``."""
    for name, model, example, inputs, calibration in _cases(steps):
        for quantizer, functional in itertools.product(sorted(QUANTIZERS), (False, True)):
            form = "functional" if functional else "inplace"
            for passes, fold in itertools.product((False, True), (True, False)):
                program = torch.export.export(copy_program(model), example)
                if passes:
                    if functional:
                        program = PassManager([MarkMutableBuffers(), InplaceToFunctional()]
                                              ).run(program).program
                    quantized = quantize_program(program, QUANTIZERS[quantizer](),
                                                 [call for sequence in calibration
                                                  for call in sequence], fold=fold)
                else:
                    quantized = torchao_recipe(program, QUANTIZERS[quantizer](), calibration,
                                               decompose=functional, fold=fold).left
                result = decode(model, quantized, inputs)
                worst_buffer = max(
                    result.worst_buffer_error(b) / result.buffer_scale[b]
                    for b in result.buffer_scale
                )
                yield (
                    name,
                    quantizer,
                    form,
                    fold,
                    "passes" if passes else "plain",
                    result.output_errors,
                    worst_buffer,
                )


def main(argv: list[str] | None = None) -> str:
    """Print the decode-accuracy table and return it as Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    steps = " | ".join(f"s{i}" for i in range(args.steps))
    lines = [
        "## Decode accuracy: max abs output error vs fp32 per decode step",
        "",
        "`plain` = torchao's flow as is, `passes` = with the mutable-buffer passes; "
        "growth = worst step / first step; buffer = worst buffer error relative to the "
        "fp32 buffer's magnitude.",
        "",
        f"| model | quantizer | form | fold | flow | {steps} | growth | buffer |",
        "|---|---|---|---|---|" + "---:|" * (args.steps + 2),
    ]
    for name, quantizer, form, fold, flow, errors, buffer in accuracy_rows(args.steps):
        cells = " | ".join(f"{e:.3f}" for e in errors)
        growth = max(errors) / errors[0] if errors[0] > 0 else float("inf")
        lines.append(
            f"| {name} | {quantizer} | {form} | {fold} | {flow} | {cells} "
            f"| {growth:.1f} | {buffer:.1%} |"
        )
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
