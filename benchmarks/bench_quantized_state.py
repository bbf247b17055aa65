"""QuantizeMutableBuffers: state bytes, decode-step time and pass cost, same run.

Each model goes through torchao's pt2e flow with the passes (PassQuantizer +
SkipAnnotateDataMovementOps, calibration, reset, convert, UnfreezeMutableBuffer); the
converted GraphModule is the fp32-stored quantized program, and a copy of it after
QuantizeMutableBuffers the integer-stored one. Per model:

* state bytes: every mutable buffer's bytes before and after (measured on the programs);
* decode-step time: CPU time of one decode call, fp32-stored vs integer-stored, the two
  interleaved step by step (each decode from a fresh copy, reads dequantize the integer
  caches: that costs something), median over all steps of all repeats and their ratio;
* pass cost: ``QuantizeMutableBuffers().call`` (bare) and under ``PassManager``, on the
  GraphModule and on the re-exported functional ExportedProgram (CPU ms, min of runs).

Models: the main job's decoder (2 layers, as ``python -m passes run`` builds it), the same
decoder with a long cache (4 layers, dim 256, 2,048 positions: 16 MiB of fp32 cache), the
Llama-shaped graph (``tests.models.llama_shaped``) and a tiny Hugging Face Llama with a
static cache. ``--executorch`` also lowers the main job's decoder both ways, reads the
planned mutable-buffer bytes from each ``.pte``'s execution plan (and the long-cache
decoder likewise), timing their decode steps on the runtime. The growth table runs the
pass on the decoder at 4 and 64 layers against the node counts.

    python -m benchmarks.bench_quantized_state [--repeat 5] [--steps 8] [--executorch]
        [--only decoder]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pass_manager import PassManager, graph_module_of
from pass_manager.benchmarking import Timings, time_call
from pass_manager.validation import call_inputs
from passes import QuantizeMutableBuffers
from passes._analysis.quantized_state import state_storage
from passes.flow.examples import decode_inputs, kv_decoder

__all__ = ["MODELS", "main"]

GROWTH_LAYERS = (4, 64)


def _decoder(**config: Any) -> Callable[[int], tuple]:
    def build(steps: int) -> tuple:
        model, example = kv_decoder(**config)
        return model, example, decode_inputs(model.cfg, steps, seed=3), {}

    return build


def _llama_shaped(steps: int) -> tuple:
    from tests.models.llama_shaped import llama_job

    model, example, calls = llama_job(2, steps=steps)
    return model, example, calls, {"strict": True}


def _hf_llama(steps: int) -> tuple:
    from tests.models.hf import decode_steps, llama_module

    calls = decode_steps(steps)
    return llama_module(), (), calls, {"strict": True, "kwargs": calls[0][1]}


MODELS: dict[str, tuple[Callable[[int], tuple], str]] = {
    "decoder": (_decoder(n_layers=2), "xnnpack"),
    "decoder, 2,048 positions": (_decoder(n_layers=4, dim=256, max_seq=2048), "xnnpack"),
    "Llama-shaped": (_llama_shaped, "xnnpack"),
    # min/max observers: XNNPACK's histogram observers take 30 s to convert even this one.
    "HF Llama, static cache": (_hf_llama, "every_op"),
}


def _quantized(name: str, steps: int) -> tuple[Any, tuple, list, dict]:
    from tests.models.quantized_state import quantize

    build, quantizer = MODELS[name]
    model, example, calls, options = build(steps)
    gm = quantize(model, example, calls[:4], quantizer, kwargs=options.get("kwargs"),
                  strict=options.get("strict", False))
    return gm, example, calls, options


def _bytes(program: Any) -> int:
    return sum(s.nbytes for s in state_storage(program).values())


def decode_step_times(programs: dict[str, Any], calls: list, repeat: int) -> dict[str, Timings]:
    """CPU time per decode step of each program, interleaved step by step."""
    timings = {name: Timings(name) for name in programs}
    for _ in range(repeat):
        running = {name: copy.deepcopy(p) for name, p in programs.items()}
        gc.collect()
        with torch.no_grad():
            for args, kwargs in call_inputs(calls):
                for name, module in running.items():
                    start = time.process_time()
                    module(*args, **kwargs)
                    timings[name].samples.append(time.process_time() - start)
    return timings


def pass_costs(program: Any, repeat: int) -> tuple[Timings, Timings]:
    """Min-of-runs CPU time of the bare pass and of the pass under a PassManager."""
    bare, managed = Timings("bare"), Timings("managed")

    def run_bare(p: Any) -> None:
        QuantizeMutableBuffers().call(p)
        graph_module_of(p).recompile()

    def run_managed(p: Any) -> None:
        PassManager([QuantizeMutableBuffers()]).run(p)

    for _ in range(repeat):
        for timings, run in ((bare, run_bare), (managed, run_managed)):
            gc.collect()
            timings.samples += time_call(timings.name, run, lambda: copy.deepcopy(program), 1,
                                         clock=time.process_time).samples
    return bare, managed


def measure(name: str, repeat: int, steps: int) -> dict[str, Any]:
    from tests.models.quantized_state import in_form

    gm, example, calls, options = _quantized(name, steps)
    stored = copy.deepcopy(gm)
    PassManager([QuantizeMutableBuffers()]).run(stored)
    times = decode_step_times({"fp32": gm, "int": stored}, calls, repeat)
    ep = in_form(copy.deepcopy(gm), example, "exported_program", kwargs=options.get("kwargs"))
    gm_bare, gm_managed = pass_costs(gm, repeat)
    ep_bare, ep_managed = pass_costs(ep, repeat)
    return {
        "model": name, "nodes": len(gm.graph.nodes),
        "bytes_before": _bytes(gm), "bytes_after": _bytes(stored),
        "fp32_ms": times["fp32"].median * 1e3, "int_ms": times["int"].median * 1e3,
        "gm_bare_ms": gm_bare.min * 1e3, "gm_managed_ms": gm_managed.min * 1e3,
        "ep_bare_ms": ep_bare.min * 1e3, "ep_managed_ms": ep_managed.min * 1e3,
    }


def measure_executorch(steps: int) -> list[str]:
    """Both decoders lowered both ways: planned mutable-buffer bytes, decode-step time."""
    from executorch.extension.pybindings import portable_lib

    from passes.executorch.plan import planned_memory
    from passes.executorch.runtime import lower_to_pte
    from tests.models.quantized_state import in_form

    lines = ["", "### On ExecuTorch's runtime (XNNPACK, BufferOwningPartitioner)", "",
             "Decode step: wall ms, median over the steps, both loaded programs interleaved.", "",
             "| model | state | planned mutable-buffer bytes | planned arena bytes | .pte bytes "
             "| decode step | int / fp32 |", "|---|---|---:|---:|---:|---:|---:|"]
    for name in ("decoder", "decoder, 2,048 positions"):
        gm, example, calls, _ = _quantized(name, steps)
        ep = in_form(gm, example, "exported_program")
        stored = copy.deepcopy(ep)
        PassManager([QuantizeMutableBuffers()]).run(stored)
        lowered = {label: lower_to_pte(program, example)[0]
                   for label, program in (("fp32", ep), ("int", stored))}
        modules = {label: portable_lib._load_for_executorch_from_buffer(pte)
                   for label, pte in lowered.items()}
        samples: dict[str, list[float]] = {label: [] for label in modules}
        for args, _ in call_inputs(calls):  # interleaved, step by step
            for label, module in modules.items():
                start = time.perf_counter()
                module.forward([a.clone() for a in args])
                samples[label].append(time.perf_counter() - start)
        step_ms = {label: statistics.median(s) * 1e3 for label, s in samples.items()}
        for label, pte in lowered.items():
            plan = planned_memory(pte)
            ratio = f"{step_ms['int'] / step_ms['fp32']:.3f}x" if label == "int" else ""
            lines.append(f"| {name} | {label} | {plan.mutable_buffer_bytes:,} "
                         f"| {sum(plan.arena_bytes):,} | {len(pte):,} | {step_ms[label]:.2f} "
                         f"| {ratio} |")
            print(lines[-1], flush=True)
    return lines


def measure_growth(repeat: int) -> list[str]:
    """Bare and managed pass cost at 4 and 64 layers against the programs' node counts."""
    from tests.models.quantized_state import quantize

    nodes, cost = {}, {}
    for layers in GROWTH_LAYERS:
        model, example = kv_decoder(layers)
        calls = decode_inputs(model.cfg, 2, seed=3)
        gm = quantize(model, example, calls, "every_op")
        nodes[layers] = len(gm.graph.nodes)
        bare, managed = pass_costs(gm, repeat)
        cost["bare", layers], cost["managed", layers] = bare.min, managed.min
    small, big = GROWTH_LAYERS
    ratio = nodes[big] / nodes[small]
    lines = ["", f"### Growth from {small} to {big} layers (CPU ms, min of {repeat} runs)", "",
             "The converted decoder (every-op quantizer). Target: cost ratio <= 1.2x node "
             "ratio.", "",
             f"| mode | nodes ({small} -> {big}) | node ratio | {small} layers | {big} layers "
             "| cost ratio | cost ratio / node ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in ("bare", "managed"):
        a, z = cost[mode, small], cost[mode, big]
        lines.append(f"| {mode} | {nodes[small]} -> {nodes[big]} | x{ratio:.2f} "
                     f"| {a * 1e3:.1f} | {z * 1e3:.1f} | x{z / a:.2f} | {z / a / ratio:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> str:
    """Print the tables as they are measured; return them as Markdown (``python -m benchmarks``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    parser.add_argument("--executorch", action="store_true")
    args = parser.parse_args(argv)
    lines = [
        "## QuantizeMutableBuffers: integer state (same run)", "",
        f"Decode step: CPU ms, median of {args.steps} steps x {args.repeat} interleaved "
        "decodes. Pass: CPU ms, min of runs; bare = `.call()` + recompile, managed = "
        "`PassManager([p]).run()`; GM = the converted GraphModule, EP = it re-exported and "
        "functionalized.", "",
        "| model | nodes | state bytes fp32 -> int | ÷ | decode step fp32 | int | int / fp32 "
        "| pass GM bare / managed | pass EP bare / managed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name in args.only or MODELS:
        r = measure(name, args.repeat, args.steps)
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['bytes_before']:,} -> {r['bytes_after']:,} "
            f"| {r['bytes_before'] / r['bytes_after']:.2f} | {r['fp32_ms']:.3f} "
            f"| {r['int_ms']:.3f} | {r['int_ms'] / r['fp32_ms']:.3f}x "
            f"| {r['gm_bare_ms']:.1f} / {r['gm_managed_ms']:.1f} "
            f"| {r['ep_bare_ms']:.1f} / {r['ep_managed_ms']:.1f} |")
        print(lines[-1], flush=True)
    if args.executorch:
        lines += measure_executorch(args.steps)
    if not args.only:
        growth = measure_growth(args.repeat)
        print("\n".join(growth), flush=True)
        lines += growth
    return "\n".join(lines)


if __name__ == "__main__":
    main()
