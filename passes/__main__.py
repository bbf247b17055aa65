"""Command line: ``python -m passes run [package.module:factory] [options]``.

The factory returns ``(module, example_inputs)`` or ``(module, example_inputs, steps)``
where ``steps`` holds one argument tuple per decode call (default: the example inputs,
repeated). Without a factory the built-in seeded KV-cache decoder is used.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from pass_manager import PassManagerError, parse_pipeline

DEFAULT_MODEL = "passes.examples:decoder_job"


class ModelError(Exception):
    """The MODEL argument does not name a usable factory; the message is one line for the user."""


def load_model(spec: str, steps: int) -> tuple[torch.nn.Module, tuple, list[tuple]]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelError(f"MODEL must look like package.module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ModelError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise ModelError(f"{module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ModelError(f"{spec} is a {type(factory).__name__}, not a factory function")
    try:
        made = factory()
    except Exception as e:
        raise ModelError(f"{spec}() failed: {type(e).__name__}: {e}") from e
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ModelError(
            f"{spec}() must return (module, example_inputs) or (module, example_inputs, steps), "
            f"got {type(made).__name__}"
        )
    model, example = made[0], made[1]
    if not isinstance(model, torch.nn.Module) or not isinstance(example, tuple):
        raise ModelError(f"{spec}() must return an nn.Module and a tuple of example inputs")
    per_step = list(made[2]) if len(made) == 3 else [example] * steps
    return model.eval(), example, [tuple(s) for s in per_step[:steps]]


def _check_exportable(model: torch.nn.Module, example: tuple, spec: str) -> None:
    import copy

    # A failing export prints its partial graph to stderr and logs warnings; the one-line
    # error below says what the user needs, so both are held back.
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            torch.export.export(copy.deepcopy(model), copy.deepcopy(example))
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(f"{spec} is not exportable: {type(e).__name__}: {first_line}") from e
    finally:
        logging.disable(logging.NOTSET)


def _print_section(title: str, body: str) -> None:
    print(f"\n== {title}\n{body}", flush=True)


def _quiet_import_noise() -> None:
    # torchao logs a warning per optional CUDA kernel library it cannot load on a CPU-only
    # machine, and torch warns about its own deprecated internals (pytree registrations,
    # LeafSpec checks when a program is deep-copied): noise in a report.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _quantizer_factory(name: str) -> Any:
    from .examples import AnnotateEveryOpQuantizer, xnnpack_quantizer

    # every-op: the QNN-style quantizer that annotates data movement too.
    return AnnotateEveryOpQuantizer if name == "every-op" else xnnpack_quantizer


def run(args: argparse.Namespace) -> int:
    spec = args.model or DEFAULT_MODEL
    # Before the model's module is imported: it may import torchao (the default does).
    _quiet_import_noise()
    try:
        pipeline = parse_pipeline(args.pipeline) if args.pipeline else None
    except PassManagerError as e:
        print(f"error: --pipeline: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        model, example, steps = load_model(spec, args.steps)
        _check_exportable(model, example, spec)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .flow import run_flow

    print(
        f"model: {spec} ({sum(p.numel() for p in model.parameters())} parameters), "
        f"{len(steps)} decode steps",
        flush=True,
    )
    result = run_flow(
        model,
        example,
        steps,
        quantize=not args.skip_quantization,
        delegate=not args.skip_delegation,
        quantizer_factory=_quantizer_factory(args.quantizer),
        log=lambda line: print(line, flush=True),
        pipeline=pipeline,
    )
    _print_section("pass plan", result.plan)
    _print_section("passes", result.pass_table())
    if result.delegate_summary:
        _print_section("delegates", "\n".join(result.delegate_summary))
    _print_section("decode", result.decode_table())
    _print_section(
        "checks",
        "\n".join(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in result.checks),
    )
    if args.dot:
        Path(args.dot).write_text(result.dot)
        print(f"wrote the pass DAG to {args.dot}")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
        print(f"wrote the report to {args.json}")
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m passes", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the mutable-buffer flow on a model")
    run_parser.add_argument("model", nargs="?", default="", help="package.module:factory")
    run_parser.add_argument("--steps", type=int, default=8, help="decode calls (default 8)")
    run_parser.add_argument(
        "--quantizer",
        choices=("xnnpack", "every-op"),
        default="xnnpack",
        help="torchao's XNNPACK-style quantizer, or one that annotates every op (QNN style)",
    )
    run_parser.add_argument(
        "--pipeline",
        metavar="TEXT",
        help="run this pipeline instead of the functionalization stage, e.g. "
        "'MarkMutableBuffers,InplaceToFunctional' (registered pass names, options in {})",
    )
    run_parser.add_argument("--skip-quantization", action="store_true")
    run_parser.add_argument("--skip-delegation", action="store_true")
    run_parser.add_argument("--dot", metavar="FILE", help="write the pass DAG as Graphviz DOT")
    run_parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
