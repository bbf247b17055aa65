"""Decode accuracy of a model deployed as prefill + decode methods sharing their KV cache:
each method quantized on its own (today's way) against ``quantize_methods``.

The main job's decoder is exported as a prefill of 4 positions and a one-token decode
(``tests.models.methods``). Both ways calibrate on the same prompts (each a prefill and 4
decode steps): ``per-method`` quantizes each method with ``quantize_program`` on its own
calls alone (decode never sees what prefill wrote) and deploys the two sharing the caches;
``quantize_methods`` calibrates along the calls in order over one state and gives each
cache one grid. Both run along other prompts (prefill, then decode steps) against the fp32
eager module called in the same order. Printed: per call of the first evaluation prompt the
max and mean abs output error, then over all prompts the mean of per-call errors, the
worst call, how many calls ``quantize_methods`` is no worse on, each cache's grid, and
whether the integer-stored methods (``quantize_state=True``) decode bit for bit as the
fp32-stored ones. Run: ``python -m benchmarks.bench_methods_accuracy [--layers N]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings

import torch

from pass_manager.validation import copy_program
from passes import reset_mutable_buffers
from passes._methods.grid_facet import buffer_grids
from passes.flow.examples import AnnotateEveryOpQuantizer, xnnpack_quantizer
from passes.flow.quantized_graphs import output_grid
from passes.quantization import quantize_methods, quantize_program
from tests.models.methods import calls_in_sequence, decoder_calls, decoder_methods

__all__ = ["main"]

QUANTIZERS = {"xnnpack": xnnpack_quantizer, "every_op": AnnotateEveryOpQuantizer}


def _errors(reference, methods, prompts):
    """Per call over every prompt: (max abs error, mean abs error); the state is reset
    after each prompt run."""
    found = []
    for calls in prompts:
        expected = calls_in_sequence(copy.deepcopy(reference), calls)
        actual = calls_in_sequence(methods, calls)
        reset_mutable_buffers(methods)
        found += [(float((a - b).abs().max()), float((a - b).abs().mean()))
                  for a, b in zip(expected, actual, strict=True)]
    return found


def main(argv: list[str] | None = None) -> str:
    """Print the tables and return them as Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=8, help="decode steps per prompt")
    parser.add_argument("--prompts", type=int, default=5, help="evaluation prompts")
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    module, programs, _ = decoder_methods(n_layers=options.layers)
    reference = copy.deepcopy(module)
    dim = module.cfg.dim
    calibration = [c for seed in (10, 11, 12) for c in decoder_calls(dim, 4, seed)]
    prompts = [decoder_calls(dim, options.decodes, seed)
               for seed in range(20, 20 + options.prompts)]
    lines = ["## Methods sharing a KV cache: per-method quantization vs quantize_methods", "",
             "The main job's decoder as prefill (4 positions) + decode, calibrated on 3 "
             "prompts (prefill + 4 decodes each), evaluated on "
             f"{options.prompts} others (prefill + {options.decodes} decodes) against fp32 "
             "eager called in the same order; abs output errors."]

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
    for name, quantizer in QUANTIZERS.items():
        alone_programs = copy_program(dict(programs))  # the copies share one cache
        alone = {method: quantize_program(program, quantizer(),
                                          [(a, k) for m, a, k in calibration if m == method])
                 for method, program in alone_programs.items()}
        ours = quantize_methods(copy_program(dict(programs)), quantizer(), calibration)
        stored = quantize_methods(copy_program(dict(programs)), quantizer(), calibration,
                                  quantize_state=True)
        exact = all(torch.equal(a, b) for a, b in zip(
            calls_in_sequence(ours, prompts[0]), calls_in_sequence(stored, prompts[0]),
            strict=True))
        reset_mutable_buffers(ours)
        theirs, mine = _errors(reference, alone, prompts), _errors(reference, ours, prompts)
        step = max(output_grid(p.graph_module) for p in [*alone.values(), *ours.values()])
        emit("")
        emit(f"### {name}, {options.layers} layers (output grid step {step:.4f}; "
              f"integer-stored == fp32-stored bit for bit: {exact})")
        emit("| call | method | max err per-method | max err quantize_methods "
             "| mean err per-method | mean err quantize_methods |")
        emit("|---|---|---:|---:|---:|---:|")
        for index, (method, _, _) in enumerate(prompts[0]):
            (tm, ta), (mm, ma) = theirs[index], mine[index]
            emit(f"| {index} | {method} | {tm:.4f} | {mm:.4f} | {ta:.5f} | {ma:.5f} |")
        count = len(theirs)
        emit("")
        emit(f"Over {options.prompts} prompts x {len(prompts[0])} calls: mean max err "
              f"{statistics.mean(t for t, _ in theirs):.4f} per-method vs "
              f"{statistics.mean(m for m, _ in mine):.4f}; worst call "
              f"{max(t for t, _ in theirs):.4f} vs {max(m for m, _ in mine):.4f}; mean abs err "
              f"{statistics.mean(t for _, t in theirs):.5f} vs "
              f"{statistics.mean(m for _, m in mine):.5f}; quantize_methods no worse on "
              f"{sum(m <= t for (t, _), (m, _) in zip(theirs, mine, strict=True))}/{count} "
              "calls")
        emit("")
        grids = {method: buffer_grids(p) for method, p in alone.items()}
        shared = buffer_grids(ours["decode"])
        for fqn in sorted(shared):
            emit(f"- {fqn}: per-method prefill {grids['prefill'][fqn]}, decode "
                  f"{grids['decode'][fqn]}; quantize_methods (both) {shared[fqn]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
