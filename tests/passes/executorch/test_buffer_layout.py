"""State that is not contiguous runs on ExecuTorch's runtime as in Python: a transposed
buffer (not persistent, as InputsToBuffers makes them: ExecuTorch's ``to_edge`` failed on
it, ``Missing input spec for lifted tensor cache.``) and a channels_last one (the runtime's
``index_put`` failed on its dim order, ``0x12``) are lowered contiguous; a buffer read by
``as_strided``, whose value would change with its layout, is refused, typed."""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, InputsToBuffers, MarkMutableBuffers
from passes.executorch import (
    NonContiguousStateError,
    decode_on_runtime,
    run_methods_on_runtime,
)

TRANSPOSED = torch.arange(12.0).view(3, 4).t()  # size (4, 3), stride (1, 4)
CHANNELS_LAST = torch.arange(24.0).view(2, 3, 2, 2).contiguous(
    memory_format=torch.channels_last)


class Cache(torch.nn.Module):
    def __init__(self, initial: torch.Tensor, persistent: bool):
        super().__init__()
        self.register_buffer("cache", initial.clone(), persistent=persistent)  # keeps strides

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        return self.cache * 1, self.cache.sum(0)


class CarriedCache(torch.nn.Module):
    def forward(self, x, pos, cache):
        cache.index_copy_(0, pos, x)
        return cache * 1, cache.sum(0)


def _steps(shape) -> list[tuple]:
    torch.manual_seed(0)
    return [(torch.randn(1, *shape[1:]), torch.tensor([i % shape[0]])) for i in range(3)]


def _assert_decodes_as_eager(program, eager_calls, steps):
    decoded = decode_on_runtime(program, None, steps)
    for step, (expected, actual) in enumerate(zip(eager_calls, decoded.outputs, strict=True)):
        for e, a in zip(expected, actual, strict=True):
            assert torch.equal(e, a), f"step {step}: off by {(e - a).abs().max()}"
    assert any("lowered contiguous" in note for note in decoded.notes)


@pytest.mark.parametrize("initial, persistent", [(TRANSPOSED, False), (CHANNELS_LAST, True)],
                         ids=["transposed", "channels_last"])
def test_a_registered_buffer_not_contiguous_decodes_as_in_python(initial, persistent):
    module = Cache(initial, persistent)
    assert module.cache.stride() == initial.stride()
    steps = _steps(initial.shape)
    eager = copy.deepcopy(module)
    expected = [eager(*step) for step in steps]  # the cache's value after each call, too
    program = torch.export.export(copy.deepcopy(module), steps[0])
    _assert_decodes_as_eager(program, expected, steps)


@pytest.mark.parametrize("initial_values", [None, {"cache": TRANSPOSED.contiguous()}],
                         ids=["example", "contiguous_initial_value"])
def test_state_made_resident_from_a_transposed_example_decodes_as_in_python(initial_values):
    # A contiguous initial value under the example's traced strides failed on the runtime
    # too (0x12: kernels given mixed dim orders).
    steps = _steps(TRANSPOSED.shape)
    program = torch.export.export(CarriedCache(), (*steps[0], TRANSPOSED.clone()))
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    result = PassManager([InputsToBuffers(initial_values=initial_values)]).run(functional)
    resident = result.program
    # Lowered by hand, it fails in to_edge: the pass says so and what to do.
    assert any("keeps the strides (1, 4)" in note and "contiguous example" in note
               for note in result.report.records[0].notes)
    cache = TRANSPOSED.clone()
    expected = [CarriedCache()(*step, cache) for step in steps]
    _assert_decodes_as_eager(resident, expected, steps)


class Peek(Cache):
    def forward(self, scale):
        return self.cache * scale


def test_methods_sharing_a_transposed_buffer_share_it_on_the_runtime():
    steps = _steps(TRANSPOSED.shape)
    module = Cache(TRANSPOSED, persistent=False)
    programs = {
        "forward": torch.export.export(copy.deepcopy(module), steps[0]),
        "peek": torch.export.export(Peek(TRANSPOSED, persistent=False), (torch.tensor(2.0),)),
    }
    calls = [("forward", step, {}) for step in steps] + [("peek", (torch.tensor(2.0),), {})]
    eager = copy.deepcopy(module)
    expected = [eager(*step) for step in steps] + [(Peek.forward(eager, torch.tensor(2.0)),)]
    ran = run_methods_on_runtime(programs, calls)
    for call, (e, a) in enumerate(zip(expected, ran.outputs, strict=True)):
        for e_value, a_value in zip(e, a, strict=True):
            assert torch.equal(e_value, a_value), f"calls[{call}]"


class ReadByStrides(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", TRANSPOSED.clone())

    def forward(self, x):
        self.cache.add_(x)
        return torch.as_strided(self.cache, (12,), (1,)) * 1


def test_a_buffer_read_by_its_strides_is_refused_naming_it_and_the_fix():
    # ExecuTorch alone lowers it contiguous, and the runtime returns other values.
    module = ReadByStrides()
    with pytest.raises(NonContiguousStateError) as caught:
        decode_on_runtime(module, (torch.ones(4, 3),), [(torch.ones(4, 3),)])
    error = caught.value
    assert (error.buffer, error.size, error.stride) == ("cache", (4, 3), (1, 4))
    assert "as_strided" in str(error) and ".contiguous()" in str(error)


class ConvertingCopy(torch.nn.Module):
    """A buffer written whole from a float value of another dtype (a broadcast row, or not)."""

    def __init__(self, dtype: torch.dtype, broadcast: bool):
        super().__init__()
        self.broadcast = broadcast
        self.register_buffer("state", torch.zeros(2, 3, dtype=dtype))

    def forward(self, x):
        self.state.copy_((x[0] if self.broadcast else x) * 1.5)
        return self.state * 1


def test_a_buffer_copied_from_another_dtype_keeps_its_dtype_on_the_runtime():
    # torch's functionalization made the float source itself the buffer's new value: the
    # runtime failed to write it back (dtype={Float, Int}, in the log only), the state never
    # changed, and every call returned float32 4.5 where eager returns int32 4.
    dtype = torch.int8
    model = ConvertingCopy(dtype, broadcast=True)  # a dtype and a shape to convert
    eager = copy.deepcopy(model)
    steps = [(torch.arange(6.0).view(2, 3) + 0.3 * i,) for i in range(3)]
    decoded = decode_on_runtime(torch.export.export(model, steps[0]), None, steps)
    for out, step in zip(decoded.outputs, steps, strict=True):
        expected = eager(*step)
        assert out[0].dtype == dtype
        assert torch.equal(out[0], expected)
