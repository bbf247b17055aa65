"""Where CoreMLQuantizer's time goes, and what four of its patterns cost instead.

``quantize_program`` with ExecuTorch's ``CoreMLQuantizer`` (coremltools 9.0) on
``TinyAttention`` (tests/models/coreml_cases.py), split into its steps: annotate (each
``annotate`` builds all 405 pattern graphs, a strict ``torch.export`` each: every
convolution, pool and op-activation pair, whatever the model), then prepare, calibration
and convert (the rest of ``quantize_program``). Same run: the same quantizer annotating
with the four patterns the model holds (``PatternSubsetQuantizer``, what the suite uses),
and whether both give the same quantized program (graph text and outputs over 6 calls).
Wall seconds, one run each (the full one takes minutes on a shared machine).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from executorch.backends.apple.coreml.quantizer import _coreml_quantizer_utils as patterns

from pass_manager.program import program_text
from pass_manager.validation import first_difference, run_program
from passes.quantization import quantize_program
from tests.models.coreml_cases import TinyAttention, attention_inputs, coreml_quantizer

__all__ = ["main"]


def _measure(pattern_names):
    """(seconds in annotate, seconds in total, pattern graphs exported, program)."""
    quantizer = coreml_quantizer(pattern_names)
    calls = attention_inputs()
    with torch.no_grad():
        program = torch.export.export(TinyAttention(), calls[0])
    exported = [0]
    annotate_seconds = [0.0]
    build = patterns._get_aten_graph_module
    annotate = quantizer.annotate

    def counted(*args, **kwargs):
        exported[0] += 1
        return build(*args, **kwargs)

    def timed(model):
        start = time.perf_counter()
        try:
            return annotate(model)
        finally:
            annotate_seconds[0] += time.perf_counter() - start

    patterns._get_aten_graph_module = counted
    quantizer.annotate = timed
    try:
        start = time.perf_counter()
        quantized = quantize_program(copy.deepcopy(program), quantizer, calls[:3])
        total = time.perf_counter() - start
    finally:
        patterns._get_aten_graph_module = build
    return annotate_seconds[0], total, exported[0], quantized


def main(argv: list[str] | None = None) -> str:
    """Print the table as it is measured; return it as Markdown (``python -m benchmarks``)."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    lines = [
        "## CoreMLQuantizer: where quantize_program's time goes (same run)", "",
        "TinyAttention (4 linear layers, 2 caches); wall seconds, one run each.", "",
        "| quantizer | pattern graphs exported | annotate s | rest (prepare, calibrate, "
        "convert) s | total s |",
        "|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    results = {}
    for label, names in (("CoreMLQuantizer, 4 patterns (the suite's)", "subset"),
                         ("CoreMLQuantizer, all patterns", None)):
        annotate_s, total, exported, program = _measure(
            None if names is None else ("linear", "add", "mul", "matmul"))
        results[label] = program
        row = (f"| {label} | {exported} | {annotate_s:.1f} | {total - annotate_s:.1f} "
               f"| {total:.1f} |")
        lines.append(row)
        print(row, flush=True)
    subset, full = results.values()
    calls = attention_inputs()
    same_text = program_text(subset) == program_text(full)
    difference = first_difference(run_program(full, calls), run_program(subset, calls), 0, 0)
    text = "identical" if same_text else "DIFFERS"
    values = "bit for bit equal" if not difference else f"differ: {difference}"
    verdict = (f"Both quantized programs: graph text {text}; outputs and caches over "
               f"{len(calls)} calls {values}.")
    lines += ["", verdict]
    print(verdict, flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
