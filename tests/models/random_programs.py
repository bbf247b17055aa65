"""Random small stateful programs, and their differential check against eager PyTorch.

The fuzzer's generator, shared by the property-based test
(tests/passes/_functionalization/test_functionalize_differential.py, which drives it from
hypothesis) and ``python -m benchmarks.fuzz_functionalize`` (thousands of seeded programs).

:func:`generate_program` draws a program over a few buffers, a frozen parameter and inputs
that mixes in-place ops, views (taken before and after writes) and reads;
:class:`FuzzModule` interprets it (export traces straight through the interpretation).
:func:`check_program` exports one, runs MarkMutableBuffers + InplaceToFunctional on both
program forms and compares 4 successive calls with the eager module (outputs, buffers, the
parameter and mutated inputs, exactly); :func:`check_against_torch` also runs
``run_decompositions({})`` on the same exported program.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Protocol

import torch

from pass_manager import PassFailedError, PassManager, first_difference, run_program
from passes import InplaceToFunctional, MarkMutableBuffers, UnsupportedMutationError

__all__ = ["ALL_WRITES", "Chooser", "FuzzModule", "RandomChooser", "apply_view",
           "check_against_torch", "check_program", "generate_program", "program_state"]

BUFFERS = {"b0": (4, 6), "b1": (6,), "b2": (2, 3, 4), "h": (6,), "m": (6,)}
# in-place updates cast their result back to the buffer's dtype; "m" takes bitwise ops
DTYPES = {"h": torch.float16, "m": torch.int64}
INPUTS = {"x": (4, 6), "y": (6,)}
PARAMETERS = {"p": (6,)}  # frozen (requires_grad=False): torch functionalizes its writes
WRITES = ("add_", "mul_", "sub_", "copy_", "fill_", "clamp_", "zero_", "setitem", "add_out",
          "index_copy_", "masked_fill_", "pow_", "addcmul_", "lerp_", "scatter_",
          "scatter_add_", "index_add_", "copy_cast", "copy_broadcast", "custom_scale_",
          "nograd_add_")
OPERAND_WRITES = ("masked_scatter_", "index_put_acc", "put_acc", "addmm_", "scatter_reduce_")
"""Writes reading their right-hand side as an operand of an op that is not elementwise: given
the written tensor itself or a view of it, eager's result depends on the kernel's order or
eager raises. Drawn only when asked for (``generate_program(..., writes=ALL_WRITES)``), so
the programs of earlier seeds stay as they were."""
ALL_WRITES = WRITES + OPERAND_WRITES
INT_WRITES = ("ior", "iand", "ixor", "ilshift", "add_", "mul_", "copy_", "fill_", "zero_")


@torch.library.custom_op("mbp_fuzz::scale_", mutates_args=("t",))
def _custom_scale_(t: torch.Tensor, factor: float) -> None:
    """A custom in-place op with no registered functional variant (auto_functionalized)."""
    t.mul_(factor)


@_custom_scale_.register_fake
def _(t, factor):
    return None


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
    if kind == "movedim":
        return t.movedim(*args)
    if kind == "swapaxes":
        return t.swapaxes(*args)
    if kind == "chunk":
        chunks, dim, index = args
        return t.chunk(chunks, dim)[index]
    if kind == "as_strided":  # addressed in the root's storage (every root holds >= 6)
        return t.as_strided(*args)
    if kind == "einsum":  # a view of its one operand though its schema declares no alias
        return torch.einsum(*args, t)
    raise ValueError(kind)


def _random_view(ch: Chooser, t: torch.Tensor) -> tuple | None:
    nd = t.dim()
    options = ["detach", "unsqueeze"]
    if nd >= 1 and t.numel() > 0:
        options += ["slice", "select", "narrow", "split", "unbind"]
    if nd >= 1 and t.numel() > 0:
        options += ["chunk"]
    if nd >= 2:
        options += ["transpose", "permute", "diagonal", "movedim", "swapaxes"]
    options.append("as_strided")
    if 1 <= nd <= 3:
        options.append("einsum")
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
    if kind == "chunk":
        chunks = ch.integer(1, max(size, 1))
        return kind, chunks, dim, ch.integer(0, len(torch.empty(size).chunk(chunks)) - 1)
    if kind in ("movedim", "swapaxes"):
        return kind, dim, ch.integer(0, nd - 1)
    if kind == "as_strided":
        return kind, *ch.choice([((2, 2), (1, 1), 0), ((3,), (2,), 1), ((2,), (1,), 4)])
    if kind == "einsum":  # the operand itself, reversed or rotated
        dims = "abc"[:nd]
        return kind, f"{dims}->" + ch.choice([dims, dims[::-1], dims[1:] + dims[:1]])
    return (kind,)


def generate_program(ch: Chooser, max_steps: int = 8,
                     writes: tuple[str, ...] = WRITES) -> list[tuple]:
    """A list of steps: ("view", handle, base, views), ("write", handle, op, rhs),
    ("read", handle), ("temp", handle, base); float writes drawn from ``writes``."""
    shapes = {name: torch.empty(shape, device="meta", dtype=DTYPES.get(name, torch.float32))
              for name, shape in {**BUFFERS, **PARAMETERS, **INPUTS}.items()}
    steps: list[tuple] = []
    for i in range(ch.integer(1, max_steps)):
        kind = ch.choice(["view", "view", "write", "write", "write", "read", "temp",
                          "return_view"])
        handle = f"h{i}"
        base = ch.choice(sorted(shapes))
        if kind == "temp":
            steps.append(("temp", handle, base))
            shapes[handle] = torch.empty_like(shapes[base])
        elif kind == "view":
            views, t = [], shapes[base]
            for _ in range(ch.integer(1, 4)):
                view = _random_view(ch, t)
                views.append(view)
                t = apply_view(t, view)
            steps.append(("view", handle, base, tuple(views)))
            shapes[handle] = t
        elif kind == "read":
            steps.append(("read", base))
        elif kind == "return_view":  # returned as is: an output aliasing state
            steps.append(("return_view", base))
        else:
            op = ch.choice(INT_WRITES if shapes[base].dtype == torch.int64 else writes)
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
        for name, shape in PARAMETERS.items():
            setattr(self, name, torch.nn.Parameter(torch.randn(shape, generator=generator),
                                                   requires_grad=False))
        self.steps = steps

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        env = {name: getattr(self, name) for name in (*BUFFERS, *PARAMETERS)}
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
            elif step[0] == "return_view":
                outputs.append(env[step[1]])
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
    if target.dtype == torch.int64:
        _int_write(target, op, value)
        return
    tensor = value if isinstance(value, torch.Tensor) else torch.full_like(target, value)
    if op == "pow_":
        target.pow_(2) if not isinstance(value, torch.Tensor) else target.pow_(
            torch.full_like(target, 2.0))
    elif op == "addcmul_":
        target.addcmul_(tensor, tensor, value=0.5)
    elif op == "lerp_":
        target.lerp_(tensor.to(target.dtype).expand_as(target), 0.3)
    elif op in ("scatter_", "scatter_add_", "index_add_") and target.dim() >= 1:
        row = target.narrow(0, 0, 1)
        source = torch.full_like(row, 1.5)
        if op == "index_add_":
            target.index_add_(0, torch.tensor([target.shape[0] - 1]), source)
        else:
            getattr(target, op)(0, torch.zeros(row.shape, dtype=torch.int64), source)
    elif op == "copy_cast":  # float64 source: copy_ converts
        target.copy_(tensor.to(torch.float64))
    elif op == "copy_broadcast" and target.dim() >= 1:  # one row broadcast over the target
        target.copy_(x.flatten()[: target.shape[-1]])
    elif op == "masked_scatter_":
        target.masked_scatter_(target > 0, tensor.to(target.dtype).expand_as(target))
    elif op == "index_put_acc" and target.dim() >= 1:  # a duplicate and a negative index
        target.index_put_((torch.tensor([0, -1, 0]),),
                          tensor.to(target.dtype).expand_as(target).narrow(0, 0, 1),
                          accumulate=True)
    elif op == "put_acc" and target.numel() > 0:
        target.put_(torch.tensor([0, -1, 0]),
                    tensor.to(target.dtype).reshape(-1).narrow(0, 0, 1).expand(3),
                    accumulate=True)
    elif op == "addmm_" and target.dim() == 2:
        mixing = torch.linspace(-1, 1, target.shape[1] ** 2, dtype=target.dtype)  # not diagonal:
        target.addmm_(tensor.to(target.dtype).expand_as(target),  # each column reads them all
                      mixing.view(target.shape[1], target.shape[1]))
    elif op == "scatter_reduce_" and target.dim() >= 1:
        row = tensor.to(target.dtype).expand_as(target).narrow(0, 0, 1)
        target.scatter_reduce_(0, torch.zeros(row.shape, dtype=torch.int64), row, "amax",
                               include_self=False)
    elif op == "custom_scale_":
        torch.ops.mbp_fuzz.scale_(target, 1.5)
    elif op == "nograd_add_":
        with torch.no_grad():
            target.add_(value)
    elif op == "add_":
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


def _int_write(target: torch.Tensor, op: str, value: Any) -> None:
    """Bitwise in-place operators (the __i*__ overloads) and a few others on int64 state."""
    if isinstance(value, torch.Tensor):
        value = (value * 10).to(torch.int64).expand_as(target)
    else:
        value = 3
    if op == "ior":
        target |= value
    elif op == "iand":
        target &= value
    elif op == "ixor":
        target ^= value
    elif op == "ilshift":
        target <<= 1
    elif op == "add_":
        target.add_(value)
    elif op == "mul_":
        target.mul_(value)
    elif op == "copy_":
        target.copy_(value if isinstance(value, torch.Tensor) else torch.tensor(value))
    elif op == "fill_":
        target.fill_(7)
    else:
        target.zero_()


def program_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers and the parameters: both are state the programs write."""
    state = {name: t.detach().clone() for name, t in module.named_buffers()}
    state.update({name: t.detach().clone() for name, t in module.named_parameters()})
    return state


def _calls(seed: int, n: int = 4) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed + 1000)
    return [tuple(torch.randn(s, generator=generator) for s in INPUTS.values()) for _ in range(n)]


def check_program(steps: list[tuple], seed: int = 0) -> str:
    """Outcome of one program: "transformed", "unchanged", "rejected: <kind>",
    "invalid: <why>" (eager or export refuses it), "mismatch: ..." or "crash: ..."."""
    return check_against_torch(steps, seed, torch_too=False)[0]


def check_against_torch(steps: list[tuple], seed: int = 0,
                        torch_too: bool = True) -> tuple[str, str | None]:
    """The outcome of the passes (see check_program) and of ``run_decompositions({})`` on
    the same exported program: "ok", "mismatch: ..." or "crash: ..." (None when the
    program is invalid or ``torch_too`` is False)."""
    calls = _calls(seed)
    module = FuzzModule(steps, seed)
    try:
        expected = run_program(module, calls, state=program_state)
    except RuntimeError as e:
        invalid = f"invalid: eager {str(e).splitlines()[0][:60]}"
        return _runs_where_eager_raises(steps, seed, calls, e) or invalid, None
    try:
        ep = torch.export.export(copy.deepcopy(module), copy.deepcopy(calls[0]))
    except Exception as e:  # noqa: BLE001 - export refusing a program is not under test
        return f"invalid: export {type(e).__name__}", None
    reference = _torch_outcome(copy.deepcopy(ep), expected, calls) if torch_too else None
    outcome = "unchanged"
    for program in (ep, ep.module()):
        try:
            result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
        except PassFailedError as e:
            cause = e.__cause__
            if isinstance(cause, UnsupportedMutationError):
                return f"rejected: {cause.kind}", reference
            return f"crash: {type(cause).__name__}: {cause}", reference
        except Exception as e:  # noqa: BLE001 - any other escape is a crash to report
            return f"crash: {type(e).__name__}: {e}", reference
        difference = first_difference(
            expected, run_program(result.program, calls, state=program_state))
        if difference:
            return f"mismatch: {type(program).__name__}: {difference}", reference
        if result.report.records[-1].modified:
            outcome = "transformed"
    return outcome, reference


def _runs_where_eager_raises(steps: list[tuple], seed: int, calls: list,
                             error: RuntimeError) -> str | None:
    """A mismatch when export keeps a program eager refuses (fake tensors check less than
    eager kernels: ``b.index_copy_(0, i, b)``) and the passes turn it into one that runs."""
    try:
        ep = torch.export.export(FuzzModule(steps, seed), copy.deepcopy(calls[0]))
    except Exception:  # noqa: BLE001 - export refusing it too: nothing to check
        return None
    for program in (ep, ep.module()):
        try:
            result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program)
            run_program(result.program, calls, state=program_state)
        except Exception:  # noqa: BLE001 - refused, or failing when called: as eager
            continue
        return (f"mismatch: {type(program).__name__}: eager raises "
                f"{str(error).splitlines()[0][:60]!r}, the functional program runs")
    return None


def _torch_outcome(ep: torch.export.ExportedProgram, expected: Any, calls: list) -> str:
    try:
        decomposed = ep.run_decompositions({})
        actual = run_program(decomposed, calls, state=program_state)
    except Exception as e:  # noqa: BLE001 - torch's own failures are counted
        return f"crash: {type(e).__name__}"
    difference = first_difference(expected, actual)
    return f"mismatch: {difference}" if difference else "ok"
