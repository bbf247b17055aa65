"""The Hugging Face exporter's flow: state bytes, and stage times next to HF's own path.

A tiny random Llama and Qwen3 (2 layers, ``tests.models.hf_exporter``), prompt of 4 tokens,
``StaticCache`` of 16 positions, XNNPACK quantizer (``passes.examples.xnnpack_quantizer``)
on both paths, everything in one run:

* **HF's own path**: ``ExecutorchExporter().export_for_generation(model, inputs,
  ExecutorchConfig(backend="xnnpack", quantizer=PT2EQuantizer(quantizer)), generation_config)``
  end to end (a ``.pte`` per method). Its stages are timed from inside: ``torch.export.export``
  calls (the export of each method, then the re-export of the quantized GraphModule),
  ``PT2EQuantizer.quantize`` (prepare, calibrate on the export's own inputs, convert), and
  ExecuTorch's lowering (``to_edge_transform_and_lower`` + ``to_executorch``); the rest is
  HF's capture (a ``generate`` call) and program fixes.
* **This library's path**: the same exporter stopped before lowering (HF's export of both
  methods, no quantizer), MarkMutableBuffers + InplaceToFunctional, InputsToBuffers (one
  resident cache for both methods), ``quantize_methods`` calibrated along a prefill and 7
  decodes over that one cache (no re-export), ``QuantizeMutableBuffers`` on the decode alone
  (the prefill's caches cannot be stored as integers today: its write is ``zeros`` +
  ``index_copy``), and ``lower_methods_to_pte`` (one ``.pte``, XNNPACK, shared caches).

An untimed export of each model runs first (first-use costs of TorchDynamo and HF's
patches); ExecuTorch's first lowering falls on this library's path (it runs first).
Times are process CPU seconds of one run each (the stages take seconds; a loaded machine
moves wall time more than CPU time). State bytes are read from the programs, planned
mutable-buffer bytes from each ``.pte``'s execution plan.

    python -m benchmarks.bench_hf_exporter [--architectures llama qwen3]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, InputsToBuffers, MarkMutableBuffers, QuantizeMutableBuffers
from passes.examples import xnnpack_quantizer
from passes.quantization import quantize_methods
from tests.models import hf_exporter

__all__ = ["main"]

NEW_TOKENS = 8


def _cpu(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.process_time()
    result = call()
    return result, time.process_time() - start


def _state_bytes(program: torch.export.ExportedProgram) -> int:
    """The bytes of the keys and values caches (not the int64 position counters)."""
    found = {**program.state_dict, **program.constants}
    return sum(t.numel() * t.element_size() for name, t in found.items()
               if name.startswith("cache.") and not name.endswith("cumulative_length"))


def _input_cache_bytes(kwargs: dict) -> int:
    return sum(t.numel() * t.element_size()
               for t in torch.utils._pytree.tree_leaves(kwargs.get("cache"))
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _planned_bytes(pte: bytes) -> dict[str, int]:
    from passes.executorch.plan import planned_state

    plan = planned_state(pte)
    return {"state": plan.state_bytes, "shared": plan.shared_bytes}


def hf_own_path(architecture: str) -> dict[str, float]:
    """HF's exporter with PT2EQuantizer and its own lowering, its stages timed inside."""
    from transformers.exporters import ExecutorchConfig, ExecutorchExporter, exporter_executorch
    from transformers.exporters.quantizers.quantizer_pt2e import PT2EQuantizer

    seconds = {"export": 0.0, "re-export": 0.0, "PT2E quantize": 0.0, "lowering": 0.0}
    exports: list[float] = []
    real_export, real_quantize = torch.export.export, PT2EQuantizer.quantize
    real_lower = exporter_executorch.to_edge_transform_and_lower

    def export(*args, **kwargs):
        program, spent = _cpu(lambda: real_export(*args, **kwargs))
        exports.append(spent)
        return program

    def quantize(self, *args, **kwargs):
        # The export before a quantize is the method's; the one after it, the re-export.
        seconds["export"] += sum(exports)
        exports.clear()
        result, spent = _cpu(lambda: real_quantize(self, *args, **kwargs))
        seconds["PT2E quantize"] += spent
        return result

    def lower(*args, **kwargs):
        seconds["re-export"] += sum(exports)
        exports.clear()
        edge, spent = _cpu(lambda: real_lower(*args, **kwargs))
        seconds["lowering"] += spent
        real_to_executorch = edge.to_executorch

        def to_executorch(*a, **k):
            result, more = _cpu(lambda: real_to_executorch(*a, **k))
            seconds["lowering"] += more
            return result
        edge.to_executorch = to_executorch
        return edge

    model = hf_exporter.tiny_model(architecture)
    inputs = hf_exporter.prompt_inputs()
    config = ExecutorchConfig(backend="xnnpack", quantizer=PT2EQuantizer(xnnpack_quantizer()))
    torch.export.export, PT2EQuantizer.quantize = export, quantize
    exporter_executorch.to_edge_transform_and_lower = lower
    try:
        exported, total = _cpu(lambda: ExecutorchExporter().export_for_generation(
            model, copy.deepcopy(inputs), config,
            generation_config=hf_exporter.generation_config()))
    finally:
        torch.export.export, PT2EQuantizer.quantize = real_export, real_quantize
        exporter_executorch.to_edge_transform_and_lower = real_lower
    seconds["capture and fixes"] = total - sum(seconds.values())
    seconds["total"] = total
    seconds["planned state bytes"] = sum(
        _planned_bytes(bytes(c.program.buffer))["state"] for c in exported.components.values())
    return seconds


def our_path(architecture: str) -> tuple[dict[str, float], list[str]]:
    """HF's export before lowering, then this library's passes, quantize_methods, lowering."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from passes.executorch.methods import lower_methods_to_pte

    seconds: dict[str, float] = {}
    notes: list[str] = []
    hf_exporter._export.cache_clear()
    hf, seconds["HF export, no quantizer"] = _cpu(lambda: hf_exporter.export(architecture))
    tokens = hf_exporter.eager_generate(hf, NEW_TOKENS)
    options = hf_exporter.resident_cache_options(hf)

    def functional():
        return {name: PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            getattr(hf, name)).program for name in ("prefill", "decode")}
    programs, seconds["functionalize"] = _cpu(functional)

    # Without InputsToBuffers: the caches are inputs (the caller holds them) and nothing
    # is shared between the methods.
    calls = [("prefill", (), hf.prefill_kwargs), ("decode", (), hf.decode_kwargs)]
    inert = quantize_methods(copy.deepcopy(programs), xnnpack_quantizer(), calls)
    stored = PassManager([QuantizeMutableBuffers()]).run(inert["decode"])
    seconds["without: state bytes in decode's inputs"] = _input_cache_bytes(hf.decode_kwargs)
    seconds["without: resident state bytes after QuantizeMutableBuffers"] = _state_bytes(
        stored.program)
    notes.append(f"without InputsToBuffers: quantize_methods shared buffers: "
                 f"{', '.join(inert.shared_buffers) or 'none'}")
    record = stored.report.records[0]
    notes.append(f"without InputsToBuffers: QuantizeMutableBuffers on the quantized decode: "
                 f"modified {record.modified}, {len(record.notes)} notes"
                 + (f" ({record.notes[0]})" if record.notes else ""))

    def resident():
        return {name: PassManager([InputsToBuffers(**options[name])]).run(program).program
                for name, program in programs.items()}
    programs, seconds["InputsToBuffers"] = _cpu(resident)
    calls = [("prefill", (), {k: v for k, v in hf.prefill_kwargs.items() if k != "cache"})]
    position = hf.prefill_kwargs["input_ids"].shape[-1]
    for step, token in enumerate(tokens[:-1].tolist()):
        kwargs = hf_exporter.decode_kwargs(hf.decode_kwargs, token, position + step, None)
        del kwargs["cache"]
        calls.append(("decode", (), kwargs))
    quantized, seconds["quantize_methods"] = _cpu(
        lambda: quantize_methods(programs, xnnpack_quantizer(), calls))
    decode, seconds["QuantizeMutableBuffers (decode)"] = _cpu(
        lambda: PassManager([QuantizeMutableBuffers()]).run(copy.deepcopy(quantized["decode"])))
    seconds["with: decode cache bytes before QuantizeMutableBuffers"] = _state_bytes(
        quantized["decode"])
    seconds["with: decode cache bytes after QuantizeMutableBuffers"] = _state_bytes(
        decode.program)
    seconds["with: prefill cache bytes after QuantizeMutableBuffers"] = _state_bytes(
        PassManager([QuantizeMutableBuffers()]).run(copy.deepcopy(quantized["prefill"])).program)
    (pte, _, _), seconds["lowering (one .pte)"] = _cpu(
        lambda: lower_methods_to_pte(dict(quantized), XnnpackPartitioner()))
    seconds["planned state bytes"] = _planned_bytes(pte)["state"]
    seconds["total"] = sum(v for k, v in seconds.items()
                           if k in ("HF export, no quantizer", "functionalize", "InputsToBuffers",
                                    "quantize_methods", "lowering (one .pte)"))
    return seconds, notes


def main(argv: list[str] | None = None) -> str:
    """Print the tables and return them as Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architectures", nargs="*", default=list(hf_exporter.ARCHITECTURES))
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    lines = ["## Hugging Face exporter flow", "",
             "Tiny random Llama and Qwen3 (2 layers, hidden 16, one KV head of 8, StaticCache "
             "of 16 positions, prompt 4), XNNPACK quantizer on both paths; CPU seconds of one "
             "run each, both paths in this run. HF's own path: `export_for_generation` with "
             "`PT2EQuantizer` and its own lowering (one .pte per method; state stays inputs). "
             "Ours: the exporter stopped before lowering, then MarkMutableBuffers + "
             "InplaceToFunctional, InputsToBuffers, `quantize_methods` along a prefill and 7 "
             "decodes, `lower_methods_to_pte` (one .pte, shared resident caches)."]

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
    for architecture in options.architectures:
        # One untimed export first: TorchDynamo's and HF's first-use costs land on neither path.
        hf_exporter.export(architecture)
        ours, notes = our_path(architecture)
        hf_seconds = hf_own_path(architecture)
        emit("")
        emit(f"### {architecture}")
        emit("")
        emit("| HF's own path | CPU s | this library's path | CPU s |")
        emit("|---|---|---|---|")
        left = ["capture and fixes", "export", "PT2E quantize", "re-export", "lowering", "total"]
        right = ["HF export, no quantizer", "functionalize", "InputsToBuffers",
                 "quantize_methods", "lowering (one .pte)", "total"]
        for a, b in zip(left, right, strict=True):
            emit(f"| {a} | {hf_seconds[a]:.2f} | {b} | {ours[b]:.2f} |")
        emit(f"| | | total / HF's total | {ours['total'] / hf_seconds['total']:.2f}x |")
        emit("")
        emit("| state | bytes |")
        emit("|---|---|")
        planned = hf_seconds["planned state bytes"]
        emit(f"| HF's .pte files: planned mutable buffers | {planned:,.0f} "
             "(the caller holds the caches) |")
        for key in ("without: state bytes in decode's inputs",
                    "without: resident state bytes after QuantizeMutableBuffers",
                    "with: decode cache bytes before QuantizeMutableBuffers",
                    "with: decode cache bytes after QuantizeMutableBuffers",
                    "with: prefill cache bytes after QuantizeMutableBuffers",
                    "planned state bytes"):
            label = key if key != "planned state bytes" else (
                "ours: one .pte's planned mutable buffers (fp32 caches + int64 counters)")
            emit(f"| {label} | {ours[key]:,.0f} |")
        spent = ours["QuantizeMutableBuffers (decode)"]
        emit(f"| QuantizeMutableBuffers (decode) CPU s | {spent:.2f} |")
        for note in notes:
            emit(f"- {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
