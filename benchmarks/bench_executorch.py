"""ExecuTorch alone vs ExecuTorch + BufferOwningPartitioner, side by side.

For each buffer-ownership case (``tests.models.executorch_cases``): what
``to_edge_transform_and_lower`` gives with the partitioner alone and wrapped (the error,
or the max abs output difference from eager on each of 4 calls of
``lowered.exported_program().module()``), which buffers the delegates own, the whole-buffer
copies the ``to_executorch()`` program makes per call (in delegates and at the top level,
write-backs included), and the lowering cost of both, measured in the same run. The last
row lowers the main job's 2-layer decoder with XNNPACK (what
``python -m passes run --runtime executorch`` uses).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["main"]

TITLE = "## ExecuTorch: alone vs with BufferOwningPartitioner"


def _lower(model: torch.nn.Module, example: tuple, partitioner: Any) -> Any:
    """The EdgeProgramManager ``to_edge_transform_and_lower`` gives."""
    from executorch.exir import to_edge_transform_and_lower

    if isinstance(model, torch.export.ExportedProgram):
        ep = copy.deepcopy(model)
    else:
        ep = torch.export.export(copy.deepcopy(model), example)
    return to_edge_transform_and_lower(ep, partitioner=[partitioner])


def _outcome(model: torch.nn.Module, inputs: list[tuple], partitioner: Any
             ) -> tuple[str, Any, str]:
    """(what happened, the lowered program or None, its whole-buffer copies per call)."""
    from pass_manager import run_program
    from tests.models.executorch_cases import whole_buffer_copies

    try:
        manager = _lower(model, inputs[0], partitioner)
    except Exception as e:  # noqa: BLE001 - what ExecuTorch raises is the measurement
        first = str(e).strip().splitlines()[0][:70].replace("|", "/")
        return f"{type(e).__name__}: {first}", None, "-"
    lowered = manager.exported_program()
    got = run_program(lowered, inputs).outputs
    want = run_program(model, inputs).outputs
    diffs = [
        max(float((a - b).abs().max()) for a, b in zip(g, w, strict=True))
        for g, w in zip(got, want, strict=True)
    ]
    verdict = "correct" if max(diffs) <= 1e-5 else "WRONG"
    with torch.no_grad():  # to_executorch writes buffers back in place
        copies = whole_buffer_copies(manager.to_executorch(), model)
    where = ", ".join(f"{place} {n}" for place, n in sorted(copies.items()))
    counted = f"{sum(copies.values())} ({where})" if copies else "0"
    text = f"{verdict}, max diff per call " + " ".join(f"{d:.2g}" for d in diffs)
    return text, lowered, counted


def _owned(lowered: Any) -> str:
    if lowered is None:
        return "-"
    owned = []
    for node in lowered.graph.nodes:
        if node.op == "get_attr" and node.target.startswith("lowered_module"):
            sig = getattr(lowered.graph_module, node.target).original_module.graph_signature
            owned += sig.buffers_to_mutate.values()
    return ", ".join(sorted(owned)) or "none (all at the top level)"


def _median_ms(fn: Callable[[], Any], repeat: int) -> float | None:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - a lowering that fails has no cost to report
            return None
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _cost(alone_ms: float | None, wrapped_ms: float | None) -> str:
    ratio = f"{wrapped_ms / alone_ms:.2f}" if alone_ms and wrapped_ms else "-"
    show = lambda ms: "fails" if ms is None else f"{ms:.0f}"  # noqa: E731
    return f"{show(alone_ms)} | {show(wrapped_ms)} | {ratio}"


def _row(title: str, model: Any, inputs: list[tuple], make: Callable[[], Any],
         repeat: int) -> str:
    from passes.executorch import BufferOwningPartitioner

    alone, _, copies_alone = _outcome(model, inputs, make())
    wrapped, lowered, copies_wrapped = _outcome(model, inputs, BufferOwningPartitioner(make()))
    cost = _cost(
        _median_ms(lambda: _lower(model, inputs[0], make()), repeat),
        _median_ms(lambda: _lower(model, inputs[0], BufferOwningPartitioner(make())), repeat),
    )
    return (f"| {title} | {alone} | {wrapped} | {_owned(lowered)} | {copies_alone} "
            f"| {copies_wrapped} | {cost} |")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from passes import executorch as et

    if not et.available():
        text = f"{TITLE}\n\nnot measured: the executorch extra is not installed ({et.INSTALL_HINT})"
        print(text)
        return text
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from pass_manager import PassManager
    from passes import InplaceToFunctional, MarkMutableBuffers
    from passes.flow.examples import decoder_job
    from tests.models.executorch_cases import CASES

    lines = [
        TITLE,
        "",
        "Outcome of `to_edge_transform_and_lower` (ExecuTorch 1.5.1) and of 4 calls of the "
        "lowered program vs eager; whole-buffer copies per call of its `to_executorch()` "
        "program (in delegates, at the top level with its write-backs); lowering median ms "
        f"over {args.repeat} runs, same run for both.",
        "",
        "| case | ExecuTorch alone | + BufferOwningPartitioner | owned by delegates "
        "| copies/call alone | copies/call wrapped "
        "| lower ms alone | lower ms wrapped | wrapped/alone |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, case in CASES.items():
        model, inputs = case.make()
        lines.append(_row(f"{name}: {case.description}", model, inputs, case.partitioner,
                          args.repeat))
        print(lines[-1], flush=True)
    model, example, steps = decoder_job(n_layers=2, steps=4)
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        torch.export.export(copy.deepcopy(model), example)).program
    with torch.no_grad():
        lines.append(_row("main job decoder (2 layers), XnnpackPartitioner", functional, steps,
                          XnnpackPartitioner, args.repeat))
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
