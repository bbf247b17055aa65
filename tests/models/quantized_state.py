"""Models whose state holds quantized values, and the flow that quantizes them, for the
QuantizeMutableBuffers tests and benchmark.

* :func:`quantized_decoder`: the main job's decoder (``index_copy`` or ``index_put`` cache
  writes) through torchao's pt2e flow with the passes (prepare with PassQuantizer +
  SkipAnnotateDataMovementOps, calibrate, reset, convert, UnfreezeMutableBuffer), as the
  GraphModule torchao returns; :func:`in_form` re-exports and functionalizes it.
* Modules quantized by hand (``quantized_decomposed`` ops with fixed qparams in
  ``forward``), one per way of writing a cache: their exported program is a quantized
  program like a converted one, small enough to show every write form.
* :class:`CacheAndAccumulator`: a cache beside an fp32 accumulator, which must stay float.
* :func:`bit_identical`: the comparison the tests make, outputs and state bit for bit.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from pass_manager import PassManager
from pass_manager.validation import Trace, run_program
from passes import (
    InplaceToFunctional,
    MarkMutableBuffers,
    SkipAnnotateDataMovementOps,
    UnfreezeMutableBuffer,
    mutable_buffers,
    reset_mutable_buffers,
)
from passes._analysis.grids import same_bits
from passes.flow.examples import (
    AnnotateEveryOpQuantizer,
    decode_inputs,
    kv_decoder,
    xnnpack_quantizer,
)
from passes.quantization import PassQuantizer

from .hf import seeded as _seeded

QD = torch.ops.quantized_decomposed
GRID = (0.05, 3, -128, 127, torch.int8)
OTHER_GRID = (0.04, 0, -128, 127, torch.int8)
QUANTIZERS = {"xnnpack": xnnpack_quantizer, "every_op": AnnotateEveryOpQuantizer}
FORMS = ("graph_module", "functional_graph_module", "exported_program")
# Modules quantized by hand also come as export gives them: in-place writes in the program.
HAND_FORMS = (*FORMS, "in_place_exported_program")
STEPS = 8


def on_grid(x: torch.Tensor, grid: tuple = GRID) -> torch.Tensor:
    return QD.dequantize_per_tensor(QD.quantize_per_tensor(x, *grid), *grid)


# -- the pt2e flow ------------------------------------------------------------------------
def quantize(model: nn.Module, example: tuple, calls: list, quantizer: str,
             functional: bool = False, kwargs: dict | None = None,
             strict: bool = False) -> torch.fx.GraphModule:
    """The converted, unfrozen GraphModule of ``model`` (``functional``: prepared from the
    functionalized program, so its state is written back by trailing ``copy_``; ``strict``:
    exported strict, as Hugging Face's recipe exports)."""
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(model), example, kwargs, strict=strict)
    if functional:
        ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    passes = PassQuantizer(QUANTIZERS[quantizer](), transform=[MarkMutableBuffers()],
                           after_annotate=[SkipAnnotateDataMovementOps()])
    prepared = prepare_pt2e(ep.module(), passes)
    with torch.no_grad():
        for args, call_kwargs in _calls(calls):
            prepared(*args, **call_kwargs)
    reset_mutable_buffers(prepared)
    converted = convert_pt2e(prepared)
    return PassManager([UnfreezeMutableBuffer()]).run(converted).program


def _calls(calls: list) -> list[tuple[tuple, dict]]:
    return [c if len(c) == 2 and isinstance(c[1], dict) else (c, {}) for c in calls]


@functools.cache
def _decoder(cache_update: str, quantizer: str, functional: bool, n_layers: int):
    model, example = kv_decoder(n_layers, cache_update=cache_update)
    calls = decode_inputs(model.cfg, STEPS, seed=3)
    return quantize(model, example, calls[:4], quantizer, functional), example, calls


def quantized_decoder(cache_update: str = "index_copy", quantizer: str = "xnnpack",
                      functional: bool = False, n_layers: int = 1):
    """``(converted GraphModule, example inputs, decode calls)``, a fresh copy each time."""
    gm, example, calls = _decoder(cache_update, quantizer, functional, n_layers)
    return copy.deepcopy(gm), example, calls


def in_form(program: torch.fx.GraphModule, example: tuple, form: str,
            kwargs: dict | None = None):
    """A quantized GraphModule as ``form``: itself, or re-exported and functionalized
    (``exported_program``; ``functional_graph_module`` is that program's module)."""
    if form == "graph_module":
        return program
    ep = torch.export.export(program, example, kwargs)
    ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    return ep if form == "exported_program" else ep.module()


def exported(model: nn.Module, example: tuple, form: str):
    """A module quantized by hand, exported and marked, as ``form``."""
    ep = torch.export.export(copy.deepcopy(model), example)
    if form == "graph_module":
        return PassManager([MarkMutableBuffers()]).run(ep.module()).program
    if form == "in_place_exported_program":
        return PassManager([MarkMutableBuffers()]).run(ep).program
    ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    return ep if form == "exported_program" else ep.module()


# -- comparing programs -------------------------------------------------------------------
def dequantized_state(program) -> callable:
    """A state reader giving each mutable buffer's value as the program computes with it:
    a buffer stored as integers, dequantized on its grid."""
    grids = {fqn: info.grid for fqn, info in mutable_buffers(program).items()}

    def read(module: nn.Module) -> dict[str, torch.Tensor]:
        state = {}
        for name, tensor in module.named_buffers(remove_duplicate=False):
            if name in grids:
                grid = grids[name]
                state[name] = grid.dequantize(tensor) if grid is not None else tensor.clone()
        return state

    return read


def bit_identical(reference, program, calls: list) -> tuple[Trace, Trace]:
    """Run both ``len(calls)`` times; assert every output and every dequantized buffer equal
    bit for bit after every call. Returns both traces."""
    expected = run_program(reference, calls, state=dequantized_state(reference))
    actual = run_program(program, calls, state=dequantized_state(program))
    assert expected.buffers[0], "no mutable buffer to compare"
    for call, (want, got) in enumerate(zip(expected.outputs, actual.outputs, strict=True)):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert same_bits(a, b), f"call {call}: output {i} differs"
        for name, value in expected.buffers[call].items():
            assert same_bits(value, actual.buffers[call][name]), f"call {call}: {name} differs"
    return expected, actual


# -- modules quantized by hand --------------------------------------------------------------
class GridCache(nn.Module):
    """A cache ``[2, 8, 4]`` written once per call with values of one int8 grid, in one of
    the write forms; ``forward(x [2, 1, 4], pos [1])`` reads all of it.

    ``write``: ``index_copy`` (``index_copy_(1, pos, v)``), ``index_put``
    (``cache[:, pos] = v``), ``slice`` (``cache[:, 2:3].copy_(v)``), ``select``
    (``cache[:, 5] = v[:, 0]``), ``shift`` (``cache.copy_(cat([cache[:, 1:], v], 1))``, a
    sliding window: the new value is the cache's own contents and the write), ``where``
    (``cache.copy_(where(row == pos, v.expand_as(cache), cache))``: each element chosen from
    the written value or the cache) or ``where_broadcast`` (the same with ``v`` broadcast).
    """

    def __init__(self, write: str = "index_copy", initial: torch.Tensor | None = None):
        super().__init__()
        self.write = write
        self.proj = _seeded(lambda: nn.Linear(4, 4))
        self.register_buffer("cache", torch.zeros(2, 8, 4) if initial is None else initial)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        v = on_grid(self.proj(x))
        if self.write == "index_copy":
            self.cache.index_copy_(1, pos, v)
        elif self.write == "index_put":
            self.cache[:, pos] = v
        elif self.write == "slice":
            self.cache[:, 2:3].copy_(v)
        elif self.write == "select":
            self.cache[:, 5] = v[:, 0]
        elif self.write.startswith("where"):
            row = (torch.arange(self.cache.shape[1]) == pos).view(1, -1, 1)
            new = v.expand_as(self.cache) if self.write == "where" else v
            self.cache.copy_(torch.where(row, new, self.cache))
        else:
            self.cache.copy_(torch.cat([self.cache[:, 1:], v], dim=1))
        scores = (self.cache * x).sum(-1)
        return scores.softmax(-1), self.cache.transpose(1, 2).sum(-1)


def grid_inputs(steps: int = STEPS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 1, 4, generator=generator), torch.tensor([i % 8]))
            for i in range(steps)]


def on_grid_initial(offset: float = 0.0) -> torch.Tensor:
    """A non-zero initial cache on the grid of :class:`GridCache` (``offset``: off it)."""
    generator = torch.Generator().manual_seed(7)
    return on_grid(torch.randn(2, 8, 4, generator=generator)) + offset


class ReadBeforeWrite(GridCache):
    """The cache re-quantized onto its grid before this call's write, that copy read after
    it: the integers read must be the ones before the write."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        before = QD.quantize_per_tensor(self.cache, *GRID)
        self.cache.index_copy_(1, pos, on_grid(self.proj(x)))
        old = QD.dequantize_per_tensor(before, *GRID)
        return (old * x).sum(-1), (self.cache * x).sum(-1)


class SharedStorage(GridCache):
    """The cache registered under a second name too (one tensor, two buffers): storing
    integers under one name would leave the other float."""

    def __init__(self):
        super().__init__("index_copy")
        self.register_buffer("alias", self.cache)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.cache.index_copy_(1, pos, on_grid(self.proj(x)))
        return ((self.alias * x).sum(-1),)


class TwoGrids(GridCache):
    """Two writes of one cache with different scales: not one grid, stays float."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.cache.index_copy_(1, pos, on_grid(self.proj(x)))
        self.cache[:, 0] = on_grid(x, OTHER_GRID)[:, 0]
        return ((self.cache * x).sum(-1),)


class EmptyPartOnAnotherGrid(GridCache):
    """Hugging Face's rotary embedding with every dim rotated: ``cat([k_rot, k_pass])``
    joins the written value with an empty ``k_pass`` sliced from a value on another grid
    (``grid``). Nothing of it lands in the cache: on an int8 grid the cache is stored as
    integers; on another integer dtype (uint8) concatenating its integers would promote
    the rest, so it stays float."""

    def __init__(self, grid: tuple = OTHER_GRID):
        super().__init__("index_copy")
        self.grid = grid

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rotated = on_grid(self.proj(x))
        passed = on_grid(x, self.grid)[..., 4:]  # all 4 dims rotated: nothing passes
        self.cache.index_copy_(1, pos, torch.cat([rotated, passed], dim=-1))
        return ((self.cache * x).sum(-1),)


class ComputedAfterDequantize(GridCache):
    """A write of a value computed from a dequantized one: off the grid, stays float."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.cache.index_copy_(1, pos, on_grid(self.proj(x)) * 0.5)
        return ((self.cache * x).sum(-1),)


class PerChannelCache(nn.Module):
    """Values quantized per channel along their last dim (4 channels), written with
    ``index_copy_`` along positions: the channel axis survives. ``split=True`` writes them
    as two halves cut along the channel axis and joined again, where it does not;
    ``fresh=True`` writes them into a fresh cache of zeros (a prefill), stored whole."""

    def __init__(self, split: bool = False, fresh: bool = False):
        super().__init__()
        self.split, self.fresh = split, fresh
        self.proj = _seeded(lambda: nn.Linear(4, 4))
        self.register_buffer("scales", torch.tensor([0.02, 0.05, 0.1, 0.03]))
        self.register_buffer("zero_points", torch.tensor([0, 3, -2, 1]))
        self.register_buffer("cache", torch.zeros(2, 8, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grid = (self.scales, self.zero_points, 2, -128, 127, torch.int8)
        v = QD.dequantize_per_channel(QD.quantize_per_channel(self.proj(x), *grid), *grid)
        if self.split:
            v = torch.cat([v[..., :2], v[..., 2:]], dim=-1)
        if self.fresh:
            self.cache.copy_(torch.zeros_like(self.cache).index_copy(1, pos, v))
        else:
            self.cache.index_copy_(1, pos, v)
        return ((self.cache * x).sum(-1).softmax(-1),)


class MaskedRead(GridCache):
    """The cache read through a mask that zeroes the rows not written yet, the result
    quantized onto the cache's grid again (as XNNPACKQuantizer annotates such a ``where``):
    that read takes the integers, the zeros among them the grid's zero point."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.cache.index_copy_(1, pos, on_grid(self.proj(x)))
        written = (torch.arange(self.cache.shape[1]) <= pos).view(1, -1, 1)
        seen = on_grid(torch.where(written, self.cache, torch.zeros_like(self.cache)))
        return ((seen * x).sum(-1).softmax(-1),)


class MalformedGrid(GridCache):
    """A dequantize whose quant_min exceeds its quant_max feeds the cache write."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bad = (0.05, 0, 127, -128, torch.int8)
        v = QD.dequantize_per_tensor(QD.quantize_per_tensor(self.proj(x), *bad), *bad)
        self.cache.index_copy_(1, pos, v)
        return ((self.cache * x).sum(-1),)


class CacheAndAccumulator(nn.Module):
    """A KV-style cache beside a running sum ``acc <- acc / 2 + y``: after pt2e the cache
    holds quantized values, the accumulator the result of a float ``add``."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = _seeded(lambda: nn.Linear(dim, dim))
        self.out = _seeded(lambda: nn.Linear(dim, dim))
        self.register_buffer("cache", torch.zeros(1, 8, dim))
        self.register_buffer("acc", torch.zeros(1, dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        self.cache.index_copy_(1, pos, y.unsqueeze(1))
        out = self.out(y + self.acc) + (self.cache.sum(1) * 0.1)
        self.acc.add_(y - 0.5 * self.acc)
        return out


def accumulator_inputs(steps: int = STEPS, dim: int = 8) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(1, dim, generator=generator), torch.tensor([i]))
            for i in range(steps)]


# -- state the caller carries ------------------------------------------------------------------
class CarriedCache(nn.Module):
    """A cache ``[2, 8, 4]`` passed in by the caller and written in place, as transformers'
    exporter passes its KV caches: ``forward(x [2, 1, 4], pos [1], cache)`` writes the
    projection of ``x`` at ``pos`` (``index_copy`` or ``index_put``) and reads all of it."""

    def __init__(self, write: str = "index_copy"):
        super().__init__()
        self.write = write
        self.proj = _seeded(lambda: nn.Linear(4, 4))
        self.out = _seeded(lambda: nn.Linear(4, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        v = self.proj(x)
        if self.write == "index_copy":
            cache.index_copy_(1, pos, v)
        else:
            cache[:, pos] = v
        return self.out((cache * x).sum(1))


class CarriedGridCache(nn.Module):
    """:class:`CarriedCache` quantized by hand (values of ``GRID`` written with
    ``index_copy_``), to see carried state in every form export gives, in-place writes
    included."""

    def __init__(self):
        super().__init__()
        self.proj = _seeded(lambda: nn.Linear(4, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, pos, on_grid(self.proj(x)))
        return (cache * x).sum(-1).softmax(-1)


def carried_cache() -> torch.Tensor:
    """A fresh (zero) cache for :class:`CarriedCache`."""
    return torch.zeros(2, 8, 4)


@functools.cache
def _carried(write: str) -> tuple:
    from passes.quantization import quantize_program

    calls = grid_inputs()
    with torch.no_grad():
        ep = torch.export.export(CarriedCache(write), (*calls[0], carried_cache()))
    ep = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(ep).program
    calibration_cache = carried_cache()  # the calibration's own state, threaded along it
    quantized = quantize_program(ep, xnnpack_quantizer(), [
        (*args, calibration_cache) for args in calls[:4]])
    return quantized, calls


def quantized_carried(write: str = "index_copy", form: str = "exported_program"):
    """``(program, calls)``: :class:`CarriedCache` exported, functionalized (its cache a
    ``USER_INPUT_MUTATION`` output) and quantized by ``quantize_program`` with the XNNPACK
    quantizer, as ``form`` (``graph_module``: its ``.module()``); ``calls`` are
    ``(x, pos)`` pairs, the caller adds its cache."""
    quantized, calls = _carried(write)
    program = copy.deepcopy(quantized)
    return (program if form == "exported_program" else program.module()), calls
