"""Pass cost against node count, bare and through the PassManager, next to ``run_decompositions``.

Programs: the built-in KV decoder at several depths (default 1, 4, 16, 32, 64 layers), its
32-layer ``dim=64`` variant, a decoder holding 256 MiB of KV cache (16 layers, dim 512, 4,096
positions), the Llama-shaped decoder of :mod:`tests.models.llama_shaped` (RoPE, GQA, static
cache by ``index_copy_``; 2 and 16 layers) and, when ``transformers`` is installed, a tiny
random Hugging Face Llama with a static cache exported as HF exports for ExecuTorch.

Per program and pass (MarkMutableBuffers, InplaceToFunctional, to_delegate,
ConsumeBufferMutationsInDelegate): the bare cost (``p.call(program)`` plus the
``recompile()`` the program then needs), the managed cost (``PassManager([p]).run``), their
ratio, µs per node, the cost in recompiles (time / one ``recompile()`` of the pass's output)
and, for the decoder with 256 MiB of state, the peak extra memory (peak RSS above the RSS
before the run, reset through ``/proc/self/clear_refs``, in a child process). Then the
functionalization pipeline (``PassManager([Mark, InplaceToFunctional])``) and the whole
pipeline against ``ep.run_decompositions({})``.

Times are CPU time of this process (``time.process_time``), min / median of ``--repeat``
runs, each on a fresh deep copy (copying is not timed): on a shared machine wall-clock time
also counts other processes' work. Ratios compare minima from the same run.

    python -m benchmarks.bench_pass_cost [--layers 1 4 16 32 64] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pass_manager import PassManager, function_pass, graph_module_of
from pass_manager.benchmarking import Timings
from passes import (
    ConsumeBufferMutationsInDelegate,
    InplaceToFunctional,
    MarkMutableBuffers,
)
from passes.conditions import Functional
from passes.delegation import AllNodePartitioner, to_delegate
from passes.flow.examples import kv_decoder
from tests.models.llama_shaped import export_llama, llama_inputs, llama_shaped

__all__ = ["main", "measure"]

PLOT = Path(__file__).resolve().parent / "pass_cost.png"
# Peak memory is measured (in a child process) only where the state is big enough to matter.
PEAK_MIN_BUFFER_BYTES = 2**24
PASSES = ("MarkMutableBuffers", "InplaceToFunctional", "to_delegate",
          "ConsumeBufferMutationsInDelegate")
FUNCTIONALIZE, PIPELINE, DECOMP = ("functionalize (PassManager)", "whole pipeline (PassManager)",
                                   "run_decompositions({})")


@dataclass
class Cost(Timings):
    """CPU-time samples of one measured thing (see ``_timed``), shown as "min (median)" ms."""

    name: str = ""

    def cell(self) -> str:
        return f"{self.min * 1e3:.1f} ({self.median * 1e3:.1f})"


@dataclass
class Row:
    """Everything measured on one program."""

    label: str
    layers: int | None
    nodes: int
    buffer_bytes: int
    bare: dict[str, Cost] = field(default_factory=dict)
    managed: dict[str, Cost] = field(default_factory=dict)
    recompile: dict[str, Cost] = field(default_factory=dict)
    peak: dict[str, float | None] = field(default_factory=dict)


def _timed(fn: Callable[[Any], Any], make_input: Callable[[], Any], repeat: int) -> Cost:
    cost = Cost()
    for _ in range(repeat):
        argument = make_input()
        gc.collect()
        start = time.process_time()
        fn(argument)
        cost.samples.append(time.process_time() - start)
    return cost


def _rss_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _peak_extra(fn: Callable[[Any], Any], make_input: Callable[[], Any]) -> float | None:
    """Bytes of peak RSS above the RSS before ``fn`` ran (Linux; None elsewhere)."""
    argument = make_input()
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    except OSError:
        return None
    before = _rss_kib("VmRSS")
    fn(argument)
    peak = _rss_kib("VmHWM")
    return None if before is None or peak is None else max(peak - before, 0) * 1024.0


def _peaks(ep: Any) -> dict[str, float | None]:
    """Peak extra memory of each managed pass and pipeline, run one after another on ``ep``
    and its results, as they run in a pipeline (called in a child process)."""
    peaks: dict[str, float | None] = {}
    inputs = {
        "MarkMutableBuffers": lambda: copy.deepcopy(ep),
        "InplaceToFunctional": lambda: MarkMutableBuffers().call(copy.deepcopy(ep)).program,
        "to_delegate": lambda: _functionalize(copy.deepcopy(ep)),
        "ConsumeBufferMutationsInDelegate": lambda: _lower(_functionalize(copy.deepcopy(ep))),
    }
    for name in PASSES:
        peaks[name] = _peak_extra(lambda p, n=name: PassManager([_new_pass(n)]).run(p),
                                  inputs[name])
    peaks[FUNCTIONALIZE] = _peak_extra(_functionalize, lambda: copy.deepcopy(ep))
    peaks[PIPELINE] = _peak_extra(_pipeline, lambda: copy.deepcopy(ep))
    return peaks


def _measure_peaks(label: str) -> dict[str, float | None]:
    """Run :func:`_peaks` in a fresh process whose allocator returns freed blocks to the
    system (glibc's mmap threshold pinned low), so that peak RSS is not hidden by memory the
    allocator kept from earlier work."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_pass_cost", "--peaks-of", label],
        env=env, capture_output=True, text=True, check=False,
        cwd=Path(__file__).resolve().parent.parent)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {}
    return json.loads(lines[-1])


def _lower(program: Any) -> Any:
    return to_delegate(program, AllNodePartitioner())


def _new_pass(name: str) -> Any:
    if name == "to_delegate":
        return function_pass(_lower, requires={Functional}, name="to_delegate")
    return {"MarkMutableBuffers": MarkMutableBuffers, "InplaceToFunctional": InplaceToFunctional,
            "ConsumeBufferMutationsInDelegate": ConsumeBufferMutationsInDelegate}[name]()


def _bare(name: str) -> Callable[[Any], Any]:
    """The pass alone, plus the recompile its output needs to run (as the manager does)."""

    def run(program: Any) -> Any:
        if name == "to_delegate":
            return _lower(program)  # builds a new, compiled ExportedProgram
        result = _new_pass(name).call(program)
        if name != "MarkMutableBuffers":  # marking changes node meta only
            graph_module_of(result.program).recompile()
        return result.program

    return run


def _functionalize(program: Any) -> Any:
    return PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program


def _pipeline(program: Any) -> Any:
    names = ("MarkMutableBuffers", "InplaceToFunctional", "to_delegate",
             "ConsumeBufferMutationsInDelegate")
    return PassManager([_new_pass(n) for n in names]).run(program).program


def measure(label: str, ep: Any, repeat: int, layers: int | None = None) -> Row:
    """Measure every pass and pipeline on ``ep``; ``ep`` itself is never modified."""
    state = {**ep.state_dict, **ep.constants}
    row = Row(label, layers, len(ep.graph.nodes),
              sum(t.nbytes for k, t in state.items() if k in ep.graph_signature.buffers))

    def fresh() -> Any:
        return copy.deepcopy(ep)

    functional = _functionalize(copy.deepcopy(ep))
    lowered = _lower(copy.deepcopy(functional))
    inputs = {
        "MarkMutableBuffers": fresh,
        "InplaceToFunctional": lambda: MarkMutableBuffers().call(fresh()).program,
        "to_delegate": lambda: copy.deepcopy(functional),
        "ConsumeBufferMutationsInDelegate": lambda: copy.deepcopy(lowered),
    }
    for name in PASSES:
        make = inputs[name]
        row.bare[name] = _timed(_bare(name), make, repeat)
        row.managed[name] = _timed(lambda p, n=name: PassManager([_new_pass(n)]).run(p), make,
                                   repeat)
        output = _bare(name)(make())
        row.recompile[name] = _timed(lambda p: graph_module_of(p).recompile(),
                                     lambda o=output: o, repeat)
    row.managed[FUNCTIONALIZE] = _timed(_functionalize, fresh, repeat)
    row.recompile[FUNCTIONALIZE] = row.recompile["InplaceToFunctional"]
    row.managed[PIPELINE] = _timed(_pipeline, fresh, repeat)
    row.recompile[PIPELINE] = row.recompile["ConsumeBufferMutationsInDelegate"]
    row.managed[DECOMP] = _timed(lambda p: p.run_decompositions({}), fresh, repeat)
    return row


def _hf_llama(n_layers: int) -> Any:
    """A tiny random HF Llama with a static cache, exported as HF exports for ExecuTorch."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import convert_and_export_with_cache

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=n_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": 32})
    return convert_and_export_with_cache(model)  # strict, under torch.no_grad()


def _programs(args: argparse.Namespace):
    for n_layers in args.layers:
        yield f"decoder, {n_layers} layers", n_layers, lambda n=n_layers: _export(*kv_decoder(n))
    if args.quick:
        return
    yield "decoder, 32 layers, dim 64", None, lambda: _export(*kv_decoder(32, dim=64))
    yield ("decoder, 256 MiB of cache (16 layers, dim 512, 4096 positions)", None,
           lambda: _export(*kv_decoder(16, dim=512, max_seq=4096)))
    for n_layers in (2, 16):
        yield (f"Llama-shaped, {n_layers} layers", None, lambda n=n_layers: export_llama(
            llama_shaped(n), llama_inputs(llama_shaped(n).cfg, 1)[0]))
    if importlib.util.find_spec("transformers") is not None:
        for n_layers in (2, 16):
            yield f"HF Llama (tiny, static cache), {n_layers} layers", None, (
                lambda n=n_layers: _hf_llama(n))


def _export(model: torch.nn.Module, inputs: tuple) -> Any:
    return torch.export.export(model, inputs)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def _tables(rows: list[Row], repeat: int) -> list[str]:
    lines = [
        (f"## Functionalization against run_decompositions({{}}) (CPU ms: min (median) of "
        f"{repeat} runs)"),
        "",
        ("`functionalize` = `PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run`; "
        "recompiles = its time / one `recompile()` of its output; decomp / recompile = the "
        "speed-up a functionalization costing one recompile and nothing else would reach; "
        "peak = peak RSS above the "
        "RSS before the run, as a share of the program's buffer bytes (measured in a child process "
        "for programs with at least 16 MiB of buffers)."),
        "",
        ("| program | nodes | buffers MiB | run_decompositions | functionalize | decomp / "
        "functionalize | µs/node | recompile | recompiles | decomp / recompile | "
        "peak MiB (% of buffers) | whole pipeline | decomp / pipeline |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f, d, p = r.managed[FUNCTIONALIZE], r.managed[DECOMP], r.managed[PIPELINE]
        recompile = r.recompile[FUNCTIONALIZE].min
        lines.append(
            f"| {r.label} | {r.nodes} | {r.buffer_bytes / 2**20:.3g} | {d.cell()} | {f.cell()} "
            f"| {d.min / f.min:.1f}x | {f.min / r.nodes * 1e6:.1f} | {recompile * 1e3:.1f} "
            f"| {f.min / recompile:.2f} | {d.min / recompile:.1f}x | {_peak(r, FUNCTIONALIZE)} "
            f"| {p.cell()} | {d.min / p.min:.1f}x |")
    lines += [
        "", f"## Each pass, bare and through the manager (CPU ms: min (median) of {repeat} runs)",
        "",
        ("bare = `p.call(program)` + the `recompile()` its output needs (to_delegate: the "
        "function); managed = `PassManager([p]).run(program)`; recompiles = time / one "
        "`recompile()` of the pass's output."),
        "",
        ("| program | pass | bare | managed | managed / bare | µs/node (managed) | recompile "
        "| bare in recompiles | managed in recompiles | peak MiB (% of buffers) |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for name in PASSES:
            b, m, rc = r.bare[name], r.managed[name], r.recompile[name].min
            lines.append(
                f"| {r.label} | {name} | {b.cell()} | {m.cell()} | {_ratio(m.min, b.min)} "
                f"| {m.min / r.nodes * 1e6:.1f} | {rc * 1e3:.1f} | {b.min / rc:.2f} "
                f"| {m.min / rc:.2f} | {_peak(r, name)} |")
    lines += _growth(rows)
    return lines


def _peak(row: Row, name: str) -> str:
    peak = row.peak.get(name)
    if peak is None:
        return "-"
    return f"{peak / 2**20:.1f} ({100 * peak / row.buffer_bytes:.1f}%)"


def _growth(rows: list[Row]) -> list[str]:
    by_layers = {r.layers: r for r in rows if r.layers is not None}
    if len(by_layers) < 2:
        return []
    # The yardstick is 4 -> 64 layers; other depths fall back to the extremes.
    small = by_layers[4] if 4 in by_layers and max(by_layers) > 4 else by_layers[min(by_layers)]
    big = by_layers[max(by_layers)]
    node_ratio = big.nodes / small.nodes
    lines = [
        "", (f"## Growth from {small.layers} to {big.layers} layers (nodes x{node_ratio:.2f}; "
        f"linear within 1.2x means cost ratio <= x{1.2 * node_ratio:.2f})"), "",
        "| measured | cost ratio | cost ratio / node ratio |", "|---|---:|---:|",
    ]
    measured = [(f"{n} (bare)", small.bare[n], big.bare[n]) for n in PASSES]
    measured += [(f"{n} (managed)", small.managed[n], big.managed[n]) for n in PASSES]
    measured += [(n, small.managed[n], big.managed[n]) for n in (FUNCTIONALIZE, PIPELINE, DECOMP)]
    measured += [("recompile of the functional program", small.recompile[FUNCTIONALIZE],
                  big.recompile[FUNCTIONALIZE])]
    for name, a, b in measured:
        lines.append(f"| {name} | x{b.min / a.min:.2f} | {b.min / a.min / node_ratio:.2f} |")
    return lines


def _plot(rows: list[Row]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib is not installed: `make bench` installs the bench extra; no plot)"
    family = sorted((r for r in rows if r.layers is not None), key=lambda r: r.nodes)
    nodes = [r.nodes for r in family]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, name in zip(colors, PASSES, strict=False):  # more colours than passes
        ax.plot(nodes, [r.managed[name].min * 1e3 for r in family], "o-", color=color,
                label=f"{name} (managed)")
        ax.plot(nodes, [r.bare[name].min * 1e3 for r in family], "s--", color=color,
                alpha=0.7, label=f"{name} (bare)")
    ax.plot(nodes, [r.managed[DECOMP].min * 1e3 for r in family], "^-", color="grey",
            label=DECOMP)
    ax.plot(nodes, [r.recompile[FUNCTIONALIZE].min * 1e3 for r in family], "k:", linewidth=2,
            label="floor: one recompile() of the functional program")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nodes in the exported decoder (" + ", ".join(
        str(r.layers) for r in family) + " layers)")
    ax.set_ylabel("CPU time, min of runs (ms)")
    ax.set_title("Pass cost vs node count: managed (solid) and bare (dashed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return f"![pass cost against node count]({PLOT.name})"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="only the decoder depths, no variants or Llama-shaped graphs")
    parser.add_argument("--peaks-of", help=argparse.SUPPRESS)  # the child of _measure_peaks
    args = parser.parse_args(argv)
    if args.peaks_of is not None:
        build = next(b for label, _, b in _programs(args) if label == args.peaks_of)
        print(json.dumps(_peaks(build())))
        return ""
    rows = []
    for label, layers, build in _programs(args):
        print(f"  measuring {label} ...", flush=True)
        row = measure(label, build(), args.repeat, layers)
        if row.buffer_bytes >= PEAK_MIN_BUFFER_BYTES:
            row.peak = _measure_peaks(label)
        rows.append(row)
    text = "\n".join([*_tables(rows, args.repeat), "", _plot(rows)])
    print(text)
    return text


if __name__ == "__main__":
    main()
