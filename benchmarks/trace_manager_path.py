"""The path one program takes through the pass manager's modules (issue 32's measure).

Traces ``PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep)`` on the built-in
1-layer decoder with ``sys.setprofile`` and counts, over Python frames whose code lives in
``pass_manager/``:

* modules: the pass-manager modules the run executes code of;
* calls: calls of pass-manager functions (from anywhere: the manager, the passes, torch);
* moves: changes of the pass-manager module in control (the innermost pass-manager frame),
  on a call or a return; a *return* is a move to a module the run had already left;
* ``program_form`` calls: how often the program's form is decided.

A warm-up run (imports, caches) comes first on its own export; the traced run gets a fresh
one. Run it on two trees to compare them:
``PYTHONPATH=TREE python -m benchmarks.trace_manager_path``.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import torch

import pass_manager
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.flow.examples import kv_decoder

__all__ = ["main", "trace"]

ROOT = str(Path(pass_manager.__file__).resolve().parent) + "/"


def _module(filename: str) -> str | None:
    if not filename.startswith(ROOT):
        return None
    return "pass_manager/" + filename[len(ROOT):]


def _innermost(frame: Any) -> str | None:
    while frame is not None:
        module = _module(frame.f_code.co_filename)
        if module is not None:
            return module
        frame = frame.f_back
    return None


def trace(run: Any) -> dict[str, Any]:
    """Run ``run()`` under the profiler; the counts described in the module docstring."""
    calls: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    path: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        module = _module(frame.f_code.co_filename)
        if module is None:
            return
        if event == "call":
            calls[module] += 1
            functions[frame.f_code.co_name] += 1
            here = module
        else:
            here = _innermost(frame.f_back)
        if here is not None and (not path or path[-1] != here):
            path.append(here)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    seen: set[str] = set()
    returns = 0
    for module in path:
        returns += module in seen
        seen.add(module)
    return {
        "modules": len(calls),
        "calls": sum(calls.values()),
        "moves": max(len(path) - 1, 0),
        "returns": returns,
        "program_form calls": functions["program_form"],
        "per module": dict(calls.most_common()),
    }


def _program() -> torch.export.ExportedProgram:
    model, example = kv_decoder()
    return torch.export.export(model, example)


def main(argv: list[str] | None = None) -> str:
    pipeline = pass_manager.PassManager([MarkMutableBuffers(), InplaceToFunctional()])
    pipeline.run(_program())
    program = _program()
    counts = trace(lambda: pipeline.run(program))
    lines = [f"{key}: {value}" for key, value in counts.items() if key != "per module"]
    lines += [f"  {module}: {n}" for module, n in counts["per module"].items()]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
