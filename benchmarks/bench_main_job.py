"""The whole main job's time, this checkout against an earlier commit (before quantize_program).

``python -m benchmarks.bench_main_job [--commit 3c827cc | --baseline DIR] [--rounds N]``: the
baseline is DIR, a checkout of the commit to compare with, or else that commit's tree
extracted with ``git archive`` into a temporary folder (default: 3c827cc, the main job that
re-exported the converted module before lowering it). Each round runs the main job's flow
once in the baseline and once here, interleaved, each in a fresh interpreter started in its
tree: the flow's own time (``run_model`` on the built-in decoder, imports excluded), the time
from its quantization with the passes to the program it delegates (from its stage log), and
the process's wall time. Medians over the rounds, and the ratios
of this checkout's to the baseline's, same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in the tree under test (its own ``passes``): the flow on the built-in decoder, timed.
DRIVER = r"""
import json, re, sys, time
from passes.flow.cli import _quiet_import_noise
_quiet_import_noise()
from passes.flow import model_spec, run_model
from passes.flow.examples import AnnotateEveryOpQuantizer, decoder_job, xnnpack_quantizer
quantizer = {"xnnpack": xnnpack_quantizer, "every-op": AnnotateEveryOpQuantizer}[sys.argv[1]]
stages = {}
def log(line):
    found = re.match(r"\[(.*)\] done in ([0-9.]+) s$", line)
    if found:
        stages[found.group(1)] = stages.get(found.group(1), 0.0) + float(found.group(2))
spec = model_spec(decoder_job(n_layers=2, steps=8), "decoder_job", 8)
start = time.perf_counter()
result = run_model(spec, quantizer_factory=quantizer, log=log)
seconds = time.perf_counter() - start
print(json.dumps({"flow": seconds, "ok": result.ok, "stages": stages}))
"""

# Stages from the quantization with the passes on (what quantize_program and the dropped
# re-export changed); the flow without the passes and the decodes before it are the same.
AFTER_QUANTIZATION = ("quantize with the passes", "re-export the quantized program",
                      "functionalize again")


def run_once(tree: Path, quantizer: str) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", DRIVER, quantizer], cwd=tree,
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if not measured["ok"]:
        raise RuntimeError(f"the flow failed a check in {tree}")
    measured["wall"] = wall
    measured["quantize+lift"] = sum(measured["stages"].get(s, 0.0) for s in AFTER_QUANTIZATION)
    return measured


def quantization_stage(rounds: int, quantizer_name: str) -> str:
    """In this process, interleaved: the main job's quantization with the passes as it was
    (prepare/calibrate/reset/convert, UnfreezeMutableBuffer, re-export, functionalize again)
    and as it is (quantize_program); CPU seconds (less sensitive to a busy machine than wall),
    and both results checked to decode alike first."""
    import copy

    import torch
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from pass_manager import PassManager
    from pass_manager.validation import call_inputs, copy_program, first_difference, run_program
    from passes import (
        InplaceToFunctional,
        MarkMutableBuffers,
        SkipAnnotateDataMovementOps,
        UnfreezeMutableBuffer,
        reset_mutable_buffers,
    )
    from passes.flow.examples import AnnotateEveryOpQuantizer, decoder_job, xnnpack_quantizer
    from passes.flow.factory import export_program
    from passes.quantization import PassQuantizer, quantize_program

    quantizer = {"xnnpack": xnnpack_quantizer, "every-op": AnnotateEveryOpQuantizer}[
        quantizer_name]
    model, example, steps = decoder_job(n_layers=2, steps=8)
    functionalize = PassManager([MarkMutableBuffers(), InplaceToFunctional()])
    with torch.no_grad():
        functional = functionalize.run(torch.export.export(copy.deepcopy(model), example)).program

    def before() -> torch.export.ExportedProgram:
        # The steps quantize_program runs, up to UnfreezeMutableBuffer; then the re-export.
        prepared = prepare_pt2e(copy_program(functional).module(), PassQuantizer(
            quantizer(), transform=[MarkMutableBuffers(), InplaceToFunctional()],
            after_annotate=[SkipAnnotateDataMovementOps()]))
        with torch.no_grad():
            for args, kwargs in copy_program(call_inputs(steps)):
                prepared(*args, **kwargs)
        reset_mutable_buffers(prepared)
        converted = PassManager([UnfreezeMutableBuffer()]).run(convert_pt2e(prepared)).program
        reexported = export_program(converted, example, {}, mode="strict").program
        return functionalize.run(reexported).program

    def after() -> torch.export.ExportedProgram:
        return quantize_program(copy_program(functional), quantizer(), steps)

    # The model's own state: export may lift constants of the converted module into buffers.
    names = {name for name, _ in model.named_buffers()}

    def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: b.detach().clone() for n, b in module.named_buffers() if n in names}

    if first_difference(run_program(before(), steps, state=state),
                        run_program(after(), steps, state=state)):
        raise RuntimeError("the two quantization paths decode differently")
    samples: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(rounds):
        for label, path in (("before", before), ("after", after)):
            start = time.process_time()
            path()
            samples[label].append(time.process_time() - start)
    old, new = (statistics.median(samples[k]) for k in ("before", "after"))
    return "\n".join([
        "", f"Quantization with the passes alone, same process, interleaved ({quantizer_name}, "
        f"CPU s, median of {rounds}): before (convert, re-export, functionalize again) "
        f"{old:.2f} s, now (quantize_program) {new:.2f} s, now / before {new / old:.2f}",
    ])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with")
    parser.add_argument("--commit", default="3c827cc",
                        help="without --baseline: the commit to extract and compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantizer", choices=("xnnpack", "every-op"), default="xnnpack")
    parser.add_argument("--stage-rounds", type=int, default=5,
                        help="rounds of the in-process quantization-stage comparison")
    args = parser.parse_args(argv)
    stage = quantization_stage(args.stage_rounds, args.quantizer)
    print(stage, flush=True)
    if args.baseline is not None:
        return _compare(args, args.baseline) + "\n" + stage
    with tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.commit],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        return _compare(args, Path(folder)) + "\n" + stage


def _compare(args: argparse.Namespace, baseline: Path) -> str:
    samples: dict[str, dict[str, list[float]]] = {"baseline": {}, "this": {}}
    for round_ in range(args.rounds):
        for label, tree in (("baseline", baseline), ("this", ROOT)):
            measured = run_once(tree, args.quantizer)
            for key in ("flow", "quantize+lift", "wall"):
                samples[label].setdefault(key, []).append(measured[key])
            print(f"round {round_ + 1} {label}: flow {measured['flow']:.2f} s, "
                  f"quantize-with-passes..functionalize {measured['quantize+lift']:.2f} s, "
                  f"wall {measured['wall']:.2f} s", flush=True)
    lines = ["## The main job's time, this checkout against an earlier one (same run)", "",
             f"Built-in decoder (2 layers, 8 steps), {args.quantizer} quantizer; `flow` = "
             "run_model, imports excluded; `quantize+lift` = the stages from quantizing with "
             "the passes to the program delegation takes (before: quantize, re-export, "
             "functionalize again; now: quantize_program); `wall` = the process.", "",
             f"| measure (median of {args.rounds}) | baseline s | this s | this / baseline |",
             "|---|---:|---:|---:|"]
    for key in ("flow", "quantize+lift", "wall"):
        base = statistics.median(samples["baseline"][key])
        this = statistics.median(samples["this"][key])
        lines.append(f"| {key} | {base:.2f} | {this:.2f} | {this / base:.2f} |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
