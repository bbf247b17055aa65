"""Run every benchmark under benchmarks/ and write benchmarks/results.md.

The file's ``## History`` section (earlier runs, kept with the commit they measured) is
carried over from the previous file; everything above it is this run's.

Each ``benchmarks/bench_*.py`` module exposes ``main(argv=None) -> str`` that prints its
tables and returns them as Markdown. ``python -m benchmarks [--quick] [names...]``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def benchmark_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))


HISTORY = "## History"


def _history(results: Path) -> str:
    """The history section of an earlier results file (kept across runs), or ""."""
    if not results.exists():
        return ""
    text = results.read_text()
    start = text.find("\n" + HISTORY + "\n")
    return text[start + 1:] if start >= 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmark modules to run (default: all)")
    parser.add_argument("--output", type=Path, default=HERE / "results.md")
    args = parser.parse_args(argv)
    names = args.names or benchmark_modules()
    sections = [
        "# Benchmark results",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}. "
        "Every ratio compares timings taken in the same run; timings are min/median/max "
        "over repeated runs.",
    ]
    for name in names:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        start = time.perf_counter()
        sections += ["", module.main([]), "", f"_{name} took {time.perf_counter() - start:.1f} s_"]
    history = _history(args.output)
    args.output.write_text("\n".join(sections) + "\n" + (f"\n{history}" if history else ""))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
