"""Differential fuzzing of MarkMutableBuffers + InplaceToFunctional against eager PyTorch.

Generates small programs over a few buffers and inputs that mix in-place ops, views
(taken before and after writes) and reads; exports each, runs the two passes on both
program forms and compares 4 successive calls with the eager module (outputs, buffers and
mutated inputs, exactly). Prints how many programs were checked, transformed, rejected
(by reason) and mismatched; the exit status is non-zero on any mismatch or crash.

    python -m benchmarks.fuzz_functionalize --programs 2000 --seed 0

The generator is shared with the property-based test
(tests/passes/test_functionalize_differential.py), which drives it from hypothesis.
"""

from __future__ import annotations

import argparse
import collections
import copy
import random
import sys
import time
import warnings
from typing import Any, Protocol

import torch

from pass_manager import PassFailedError, PassManager, first_difference, run_program
from passes import InplaceToFunctional, MarkMutableBuffers, UnsupportedMutationError

__all__ = ["Chooser", "FuzzModule", "RandomChooser", "check_program", "generate_program", "main"]

BUFFERS = {"b0": (4, 6), "b1": (6,), "b2": (2, 3, 4), "h": (6,)}
DTYPES = {"h": torch.float16}  # in-place updates cast their result back to the buffer's dtype
INPUTS = {"x": (4, 6), "y": (6,)}
WRITES = ("add_", "mul_", "sub_", "copy_", "fill_", "clamp_", "zero_", "setitem", "add_out",
          "index_copy_", "masked_fill_")


class Chooser(Protocol):
    def choice(self, options: list | tuple) -> Any: ...

    def integer(self, low: int, high: int) -> int: ...


class RandomChooser:
    """Choices from a seeded ``random.Random``."""

    def __init__(self, seed: int):
        self._random = random.Random(seed)

    def choice(self, options):
        return self._random.choice(list(options))

    def integer(self, low: int, high: int) -> int:
        return self._random.randint(low, high)


def apply_view(t: torch.Tensor, view: tuple) -> torch.Tensor:
    kind, *args = view
    if kind == "slice":
        dim, start, end, step = args
        return t[(slice(None),) * dim + (slice(start, end, step),)]
    if kind == "select":
        return t.select(*args)
    if kind == "narrow":
        return t.narrow(*args)
    if kind == "transpose":
        return t.transpose(*args)
    if kind == "t":
        return t.t()
    if kind == "permute":
        return t.permute(*args)
    if kind == "unsqueeze":
        return t.unsqueeze(*args)
    if kind == "diagonal":
        return t.diagonal(*args)
    if kind == "flatten":
        return t.view(-1)
    if kind == "split":
        size, dim, index = args
        return t.split(size, dim)[index]
    if kind == "unbind":
        dim, index = args
        return t.unbind(dim)[index]
    if kind == "detach":
        return t.detach()
    raise ValueError(kind)


def _random_view(ch: Chooser, t: torch.Tensor) -> tuple | None:
    nd = t.dim()
    options = ["detach", "unsqueeze"]
    if nd >= 1 and t.numel() > 0:
        options += ["slice", "select", "narrow", "split", "unbind"]
    if nd >= 2:
        options += ["transpose", "permute", "diagonal"]
    if nd == 2:
        options.append("t")
    if t.is_contiguous() and nd != 1:
        options.append("flatten")
    kind = ch.choice(options)
    dim = ch.integer(0, max(nd - 1, 0))
    size = t.shape[dim] if nd else 1
    if kind == "slice":
        start = ch.integer(0, size - 1)
        return kind, dim, start, ch.integer(start + 1, size), ch.choice([1, 1, 2])
    if kind == "select":
        return kind, dim, ch.integer(0, size - 1)
    if kind == "narrow":
        start = ch.integer(0, size - 1)
        return kind, dim, start, ch.integer(1, size - start)
    if kind == "split":
        split = ch.integer(1, size)
        return kind, split, dim, ch.integer(0, (size - 1) // split)
    if kind == "unbind":
        return kind, dim, ch.integer(0, size - 1)
    if kind == "transpose":
        return kind, dim, ch.integer(0, nd - 1)
    if kind == "permute":
        return kind, ch.choice([tuple(reversed(range(nd))), (*range(1, nd), 0)])
    if kind == "unsqueeze":
        return kind, ch.integer(0, nd)
    if kind == "diagonal":
        return kind, ch.integer(-1, 1)
    return (kind,)


def generate_program(ch: Chooser, max_steps: int = 8) -> list[tuple]:
    """A list of steps: ("view", handle, base, views), ("write", handle, op, rhs),
    ("read", handle), ("temp", handle, base)."""
    shapes = {name: torch.empty(shape, device="meta", dtype=DTYPES.get(name, torch.float32))
              for name, shape in {**BUFFERS, **INPUTS}.items()}
    steps: list[tuple] = []
    for i in range(ch.integer(1, max_steps)):
        kind = ch.choice(["view", "view", "write", "write", "write", "read", "temp"])
        handle = f"h{i}"
        base = ch.choice(sorted(shapes))
        if kind == "temp":
            steps.append(("temp", handle, base))
            shapes[handle] = torch.empty_like(shapes[base])
        elif kind == "view":
            views, t = [], shapes[base]
            for _ in range(ch.integer(1, 3)):
                view = _random_view(ch, t)
                views.append(view)
                t = apply_view(t, view)
            steps.append(("view", handle, base, tuple(views)))
            shapes[handle] = t
        elif kind == "read":
            steps.append(("read", base))
        else:
            op = ch.choice(WRITES)
            same_shape = [n for n in sorted(shapes) if shapes[n].shape == shapes[base].shape
                          and shapes[n].dtype == shapes[base].dtype]
            kinds = ["scalar", "xsum"] + ["handle"] * bool(same_shape)
            kinds += ["xslice"] * (0 < shapes[base].numel() <= 24)
            rhs = ch.choice(kinds)
            rhs = ("handle", ch.choice(same_shape)) if rhs == "handle" else (rhs,)
            steps.append(("write", base, op, rhs))
    return steps


class FuzzModule(torch.nn.Module):
    """Interprets a generated program; export traces straight through the interpretation."""

    def __init__(self, steps: list[tuple], seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        for name, shape in BUFFERS.items():
            self.register_buffer(
                name, torch.randn(shape, generator=generator).to(DTYPES.get(name, torch.float32)))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.steps = steps

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        env = {name: getattr(self, name) for name in BUFFERS}
        env.update(x=x, y=y)
        outputs = []
        for step in self.steps:
            if step[0] == "temp":
                env[step[1]] = env[step[2]] * 1.5
            elif step[0] == "view":
                t = env[step[2]]
                for view in step[3]:
                    t = apply_view(t, view)
                env[step[1]] = t
            elif step[0] == "read":
                outputs.append(env[step[1]] * 1)
            else:
                _write(env[step[1]], step[2], step[3], env, x)
        self.count.add_(1)
        return (*outputs, self.b0 * 1, self.count * 1)


def _write(target: torch.Tensor, op: str, rhs: tuple, env: dict, x: torch.Tensor) -> None:
    if rhs[0] == "scalar":
        value = 0.5
    elif rhs[0] == "xsum":
        value = x.sum() * 0.1
    elif rhs[0] == "xslice":
        value = x.flatten()[: target.numel()].view(target.shape)
    else:
        value = env[rhs[1]]
    if op == "add_":
        target.add_(value)
    elif op == "mul_":
        target.mul_(value)
    elif op == "sub_":
        target.sub_(value)
    elif op == "copy_":
        target.copy_(value if isinstance(value, torch.Tensor) else torch.tensor(value))
    elif op == "fill_":
        target.fill_(value if not isinstance(value, torch.Tensor) or value.dim() == 0 else 2.0)
    elif op == "clamp_":
        target.clamp_(-1.0, 1.0)
    elif op == "zero_":
        target.zero_()
    elif op == "setitem" and target.dim() >= 1:
        target[torch.tensor([0])] = value if not isinstance(value, torch.Tensor) else value.sum()
    elif op == "add_out":
        torch.add(target, 1.0, out=target) if not isinstance(value, torch.Tensor) else torch.add(
            value * 2, target, out=target)
    elif op == "index_copy_" and target.dim() >= 1:
        source = torch.full_like(target.narrow(0, 0, 1), 3.0)
        target.index_copy_(0, torch.tensor([target.shape[0] - 1]), source)
    elif op == "masked_fill_":
        target.masked_fill_(target > 0, -0.25)
    else:
        target.neg_()


def _calls(seed: int, n: int = 4) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed + 1000)
    return [tuple(torch.randn(s, generator=generator) for s in INPUTS.values()) for _ in range(n)]


def check_program(steps: list[tuple], seed: int = 0) -> str:
    """Outcome of one program: "transformed", "unchanged", "rejected: <kind>",
    "invalid: <why>" (eager or export refuses it), "mismatch: ..." or "crash: ..."."""
    calls = _calls(seed)
    module = FuzzModule(steps, seed)
    try:
        expected = run_program(module, calls)
    except RuntimeError as e:
        return f"invalid: eager {str(e).splitlines()[0][:60]}"
    try:
        ep = torch.export.export(copy.deepcopy(module), copy.deepcopy(calls[0]))
    except Exception as e:  # noqa: BLE001 - export refusing a program is not under test
        return f"invalid: export {type(e).__name__}"
    outcome = "unchanged"
    for program in (ep, ep.module()):
        try:
            result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
        except PassFailedError as e:
            cause = e.__cause__
            if isinstance(cause, UnsupportedMutationError):
                return f"rejected: {cause.kind}"
            return f"crash: {type(cause).__name__}: {cause}"
        except Exception as e:  # noqa: BLE001 - any other escape is a crash to report
            return f"crash: {type(e).__name__}: {e}"
        difference = first_difference(expected, run_program(result.program, calls))
        if difference:
            return f"mismatch: {type(program).__name__}: {difference}"
        if result.report.records[-1].modified:
            outcome = "transformed"
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=8)
    args = parser.parse_args(argv)
    # Deep-copying thousands of exported programs repeats torch's own LeafSpec deprecation
    # warning; it says nothing about the programs checked.
    warnings.filterwarnings("ignore", category=FutureWarning)
    counts: collections.Counter = collections.Counter()
    failures = []
    start = time.perf_counter()
    for i in range(args.programs):
        seed = args.seed + i
        steps = generate_program(RandomChooser(seed), args.max_steps)
        outcome = check_program(steps, seed)
        counts[outcome.split(":")[0] if not outcome.startswith(("rejected", "invalid"))
               else outcome] += 1
        if outcome.startswith(("mismatch", "crash")):
            failures.append((seed, outcome, steps))
    elapsed = time.perf_counter() - start
    print(f"checked {args.programs} programs in {elapsed:.0f} s")
    for key in ("transformed", "unchanged"):
        print(f"  {key:<28} {counts.pop(key, 0)}")
    for key in ("mismatch", "crash"):
        print(f"  {key:<28} {counts.pop(key, 0)}")
    for key in sorted(counts):
        print(f"  {key:<28} {counts[key]}")
    for seed, outcome, steps in failures[:10]:
        print(f"\nseed {seed}: {outcome}\n  steps: {steps}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
