"""Several methods of one model sharing its state: a prefill and a one-token decode.

* :func:`prefill_decode`: the main job's decoder exported twice, prefill ``x[1, 4, dim]`` at
  positions 0-3 and decode ``x[1, 1, dim]``, with the calls a deployment runs (prefill, then
  decodes from position 4).
* :class:`PerMethodState`: the decoder plus a buffer only the prefill writes and one only
  the decode writes, beside the caches both share.
* :class:`Accumulator`: a running total with a non-zero initial value, written by one
  method and only read by another.
* :class:`ReadOnlyState`: a float total, an int64 count and a bool mask one method writes
  and another only reads (the total through a quantized ``mul``, the mask through
  ``.float()``).
* :class:`ResetTotal`: a total one method accumulates and another resets with ``fill_``
  (off the grid, or to zero).
* :class:`PerChannelState`: a cache one method writes with values of a per-channel int8
  grid, and another method only reads (or resets with ``zero_``).
* :func:`hf_llama_prefill_decode`: a tiny random Hugging Face Llama (static cache) exported
  strict as prefill (4 tokens) and decode.
* :func:`quantized_prefill_decode`: the methods quantized together (``quantize_methods``,
  one grid per shared cache) with integer-stored caches.
* :func:`eager_outputs` / :func:`run_sharing_state`: the references, the eager module called
  in the same order, and Python programs of the methods sharing one set of buffer tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.export import ExportedProgram

from passes._methods.in_turn import run_methods
from passes.flow.examples import decode_inputs, kv_decoder, xnnpack_quantizer
from passes.quantization import quantize_methods
from tests.models.quantized_state import PerChannelCache

PROMPT = 4
DECODES = 3


@dataclass
class MethodsCase:
    model: nn.Module
    programs: dict[str, ExportedProgram]
    calls: list[tuple[str, tuple, dict]]


def _prompt(dim: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, PROMPT, dim, generator=generator), torch.arange(PROMPT)


def _export_methods(model: nn.Module, examples: Mapping[str, tuple], kwargs=None,
                    strict: bool = False) -> dict[str, ExportedProgram]:
    kwargs = kwargs or {}
    with torch.no_grad():
        return {name: torch.export.export(copy.deepcopy(model), args, kwargs.get(name),
                                          strict=strict)
                for name, args in examples.items()}


def prefill_decode(model: nn.Module | None = None, decodes: int = DECODES) -> MethodsCase:
    """The decoder (or ``model``, taking the decoder's inputs) as prefill + decode."""
    if model is None:
        model = kv_decoder(1)[0]
    dim = 32 if not hasattr(model, "cfg") else model.cfg.dim
    prompt = _prompt(dim)
    steps = decode_inputs(kv_decoder(1)[0].cfg, decodes, seed=2, start=PROMPT)
    programs = _export_methods(model, {"prefill": prompt, "decode": steps[0]})
    calls = [("prefill", prompt, {})] + [("decode", args, {}) for args in steps]
    return MethodsCase(model, programs, calls)


class PerMethodState(nn.Module):
    """The decoder; a prompt of several tokens also counts them in ``prompt_tokens`` (only
    the prefill writes it), a one-token call counts itself in ``steps`` (only the decode)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = kv_decoder(1)[0]
        self.cfg = self.decoder.cfg
        self.register_buffer("prompt_tokens", torch.zeros(1))
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 1:
            self.prompt_tokens.add_(x.shape[1])
            count = self.prompt_tokens
        else:
            self.steps.add_(1)
            count = self.steps
        return self.decoder(x, input_pos) + count


class Accumulator(nn.Module):
    """A running total starting at 3: calls wider than two columns add to it, narrower ones
    only read it (a method that reads state another method writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.full((1,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 2:
            self.total.add_(x.sum())
        return x * self.total


def accumulator_methods() -> MethodsCase:
    """:class:`Accumulator` as a narrow method (reads) and a wide one (writes), called
    narrow first (it reads the initial value), then alternating."""
    model = Accumulator()
    generator = torch.Generator().manual_seed(0)
    narrow = (torch.randn(1, 2, generator=generator),)
    wide = (torch.randn(1, 4, generator=generator),)
    programs = _export_methods(model, {"narrow": narrow, "wide": wide})
    calls = [("narrow", narrow, {}), ("wide", wide, {}), ("narrow", narrow, {}),
             ("wide", wide, {}), ("narrow", narrow, {})]
    return MethodsCase(model, programs, calls)


def _seeded_linear() -> nn.Linear:
    """A 4 -> 4 linear layer with weights drawn from seed 0 (the same in every instance)."""
    linear = nn.Linear(4, 4)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        linear.weight.copy_(torch.randn(4, 4, generator=generator))
        linear.bias.copy_(torch.randn(4, generator=generator))
    return linear


class ReadOnlyState(nn.Module):
    """Calls of several rows update a running total (``add_`` of a linear layer's output,
    quantized), count the rows (int64) and mark the features ever positive (bool); a
    one-row call only reads all three."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = _seeded_linear()
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(4, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            y = self.linear(x)
            self.total.add_(y.sum(0))
            self.count.add_(x.shape[0])
            self.seen.logical_or_((y > 0).any(0))
            return y
        return x * self.total + self.count + self.seen.float()


def read_only_state_methods() -> MethodsCase:
    """:class:`ReadOnlyState` as a ``read`` method (one row) and a ``write`` one (three
    rows), called read first (the initial state), then alternating."""
    model = ReadOnlyState()
    generator = torch.Generator().manual_seed(1)
    read = (torch.randn(1, 4, generator=generator),)
    write = (torch.randn(3, 4, generator=generator),)
    programs = _export_methods(model, {"read": read, "write": write})
    calls = [("read", read, {}), ("write", write, {}), ("read", read, {}),
             ("write", (write[0] * 0.5,), {}), ("read", read, {})]
    return MethodsCase(model, programs, calls)


class ResetTotal(nn.Module):
    """A running total of a linear layer's outputs: a call of several rows adds to it, a
    one-row call resets it to ``fill`` (``fill_``) and reads it: a method writing state
    another method accumulates, with a value that is no quantized output."""

    def __init__(self, fill: float = 0.3) -> None:
        super().__init__()
        self.fill = fill
        self.linear = _seeded_linear()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if x.shape[0] == 1:
            self.total.fill_(self.fill)
            return y + self.total
        self.total.copy_(self.total + y.sum(0))
        return y * self.total


def reset_total_methods(fill: float = 0.3) -> MethodsCase:
    """:class:`ResetTotal` as an ``add`` method (three rows) and a ``reset`` one (one row,
    resetting to ``fill``), called add, reset, add, add, reset, add."""
    model = ResetTotal(fill)
    generator = torch.Generator().manual_seed(0)
    reset = (torch.randn(1, 4, generator=generator),)
    add = (torch.randn(3, 4, generator=generator),)
    programs = _export_methods(model, {"reset": reset, "add": add})
    calls = [("add", add, {}), ("reset", reset, {}), ("add", add, {}), ("add", add, {}),
             ("reset", reset, {}), ("add", add, {})]
    return MethodsCase(model, programs, calls)


class PerChannelState(PerChannelCache):
    """:class:`~tests.models.quantized_state.PerChannelCache`: a one-token call writes
    values of a per-channel int8 grid into the cache; a two-token call only reads it, or
    with ``reset`` zeroes it."""

    def __init__(self, reset: bool = False) -> None:
        super().__init__()
        self.reset = reset

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.shape[1] == 1:
            return super().forward(x, pos)
        if self.reset:
            self.cache.zero_()
            return (x * 2,)
        return ((self.cache.sum(1, keepdim=True) * x).sum(-1),)


def per_channel_methods(reset: bool = False) -> MethodsCase:
    """:class:`PerChannelState` as a ``write`` method (one token) and a ``read`` one (or
    ``reset``: two tokens), called write, other, write, write, other."""
    model = PerChannelState(reset)
    generator = torch.Generator().manual_seed(4)
    writes = [(torch.randn(2, 1, 4, generator=generator), torch.tensor([i])) for i in range(3)]
    other = (torch.randn(2, 2, 4, generator=generator), torch.tensor([0]))
    name = "reset" if reset else "read"
    programs = _export_methods(model, {"write": writes[0], name: other})
    calls = [("write", writes[0], {}), (name, other, {}), ("write", writes[1], {}),
             ("write", writes[2], {}), (name, other, {})]
    return MethodsCase(model, programs, calls)


def hf_llama_prefill_decode(decodes: int = DECODES) -> MethodsCase:
    """A tiny Hugging Face Llama with HF's static cache as the main job's v3 factory gives
    it (:func:`tests.models.hf.llama_prefill_and_decode_methods`), each method exported
    strict, as HF's ExecuTorch recipe does, by the main job's ``export_methods``."""
    from passes.flow.factory import export_methods, methods_spec
    from tests.models.hf import llama_prefill_and_decode_methods

    made = llama_prefill_and_decode_methods(prefill=PROMPT, decodes=decodes)
    spec = methods_spec(made, "llama_prefill_and_decode_methods", len(made["steps"]))
    programs = {method: exported.program for method, exported in export_methods(spec).items()}
    return MethodsCase(spec.module, programs, spec.steps)


def quantized_prefill_decode() -> MethodsCase:
    """:func:`prefill_decode` quantized with ``quantize_methods`` (XNNPACK quantizer,
    calibrated along the deployment's calls over one state, one grid per shared cache)
    and its caches stored as int8 (``quantize_state=True``)."""
    case = prefill_decode()
    case.programs = dict(quantize_methods(case.programs, xnnpack_quantizer(), case.calls,
                                          quantize_state=True))
    return case


def eager_outputs(model: nn.Module, calls) -> list[torch.Tensor]:
    """A private copy of ``model`` called in the order of ``calls``."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        return [model(*args, **kwargs) for _, args, kwargs in calls]


def run_sharing_state(programs: Mapping[str, ExportedProgram], calls) -> list[list]:
    """The outputs of each call, the methods (a private copy) sharing their top-level
    buffers by name as the ``.pte``'s shared arena does; a delegate's state stays its own."""
    return run_methods(programs, calls, share_by_name=True).outputs


def worst(expected, got) -> list[float]:
    """The largest difference per call between two lists of per-call outputs."""
    found = []
    for want, have in zip(expected, got, strict=True):
        want = want if isinstance(want, (list, tuple)) else [want]
        found.append(max(float((a - b).abs().max()) for a, b in zip(want, have, strict=True)))
    return found
