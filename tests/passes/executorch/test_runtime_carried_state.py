"""State a program carries through its inputs, on ExecuTorch's runtime.

transformers' own exporter passes the KV caches as inputs the program writes in place
(``USER_INPUT_MUTATION``). ExecuTorch 1.5.1's runtime returns such an input's new value as
an extra output, ahead of the outputs, and leaves the tensor it was given as it was; Python
eager writes the caller's tensor, so the next call given the same tensor sees the new cache.
``decode_on_runtime`` and ``run_methods_on_runtime`` thread the returned value into the next
call that passes the same tensor: runtime and eager agree over several calls, on outputs and
on the carried state. Before, every call got the cache the caller first passed (stale from
the second call on) and the outputs held the cache ahead of the program's own.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers
from passes.executorch import ExecuTorchInputError, decode_on_runtime, run_methods_on_runtime

DIM, SLOTS, CALLS = 8, 6, 4


class CacheAsInput(torch.nn.Module):
    """A one-layer cache written in place through a keyword input, as HF's exporter does:
    ``cache[pos] = x @ w`` then attention-like reads of the whole cache."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x, *, pos, cache):
        cache.index_copy_(0, pos, self.w(x))
        return self.out(torch.tanh(cache).sum(0, keepdim=True) + x[-1:])


class CacheAsPositionalInput(CacheAsInput):
    """The same cache, passed positionally (the form the runtime helpers always took)."""

    def forward(self, x, pos, cache):
        return super().forward(x, pos=pos, cache=cache)


def _steps(cache: torch.Tensor) -> list:
    """HF's form: (args, kwargs) per call, every call given the same cache tensor."""
    torch.manual_seed(1)
    return [((torch.randn(1, DIM),), {"pos": torch.tensor([i]), "cache": cache})
            for i in range(CALLS)]


def _eager(model: torch.nn.Module, steps: list) -> tuple[list, list]:
    """Python eager over the calls, on its own copy of the steps (one shared cache)."""
    steps = copy.deepcopy(steps)  # deepcopy keeps the one cache shared between the calls
    outputs, caches = [], []
    with torch.no_grad():
        for args, kwargs in steps:
            outputs.append(model(*args, **kwargs))
            caches.append((kwargs["cache"] if "cache" in kwargs else args[-1]).clone())
    return outputs, caches


@pytest.fixture(scope="module")
def exported():
    model = CacheAsInput()
    example = _steps(torch.zeros(SLOTS, DIM))[0]
    ep = torch.export.export(copy.deepcopy(model), example[0], example[1])
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
        copy.deepcopy(ep)).program
    return model, {"export": ep, "functional": functional}


@pytest.mark.parametrize("form", ["export", "functional"])
def test_a_cache_written_in_place_is_carried_from_call_to_call(exported, form):
    model, programs = exported
    program = programs[form]
    if form == "functional":
        kinds = [s.kind.name for s in program.graph_signature.output_specs]
        assert kinds == ["USER_INPUT_MUTATION", "USER_OUTPUT"]
    cache = torch.zeros(SLOTS, DIM)
    steps = _steps(cache)
    expected, caches = _eager(model, steps)
    decoded = decode_on_runtime(program, None, steps)
    assert len(decoded.outputs) == CALLS
    for call in range(CALLS):
        (output,) = decoded.outputs[call]
        torch.testing.assert_close(output, expected[call], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decoded.carried[call]["cache"], caches[call],
                                   atol=1e-5, rtol=1e-5)
    assert decoded.outputs is decoded.trace.outputs and not decoded.notes
    assert torch.equal(cache, torch.zeros(SLOTS, DIM)), "the caller's cache is not written"
    # The cache did change from call to call: a stale cache would give other outputs.
    assert not torch.allclose(caches[1], caches[CALLS - 1])


def test_positional_steps_are_not_fed_a_stale_cache():
    """The positional form ran before too, but every call got the cache first passed: the
    runtime's outputs went stale from the second call on with nothing raised."""
    model, cache = CacheAsPositionalInput(), torch.zeros(SLOTS, DIM)
    steps = [(*args, kwargs["pos"], kwargs["cache"]) for args, kwargs in _steps(cache)]
    ep = torch.export.export(copy.deepcopy(model), steps[0])
    expected, caches = _eager(model, [(step, {}) for step in steps])
    decoded = decode_on_runtime(ep, None, steps)
    for call in range(CALLS):
        # The program's output is the last one (ahead of it, before, the stale cache).
        torch.testing.assert_close(decoded.outputs[call][-1], expected[call], atol=1e-5,
                                   rtol=1e-5)
    assert all(len(outputs) == 1 for outputs in decoded.outputs)
    for call in range(CALLS):
        torch.testing.assert_close(decoded.carried[call]["cache"], caches[call],
                                   atol=1e-5, rtol=1e-5)


def test_a_new_cache_tensor_at_a_later_step_starts_from_its_value_and_is_noted(exported):
    model, programs = exported
    steps = _steps(torch.zeros(SLOTS, DIM))
    steps[2][1]["cache"] = torch.zeros(SLOTS, DIM)  # eager, too, starts this call afresh
    steps[3][1]["cache"] = steps[2][1]["cache"]
    expected, _ = _eager(model, steps)
    decoded = decode_on_runtime(programs["functional"], None, steps)
    for call in range(CALLS):
        torch.testing.assert_close(decoded.outputs[call][0], expected[call], atol=1e-5,
                                   rtol=1e-5)
    (note,) = decoded.notes
    assert note.startswith("steps[2] gives 'cache' a new tensor, not the one steps[1] wrote")


def test_the_flat_positional_form_is_the_runtimes_own(exported):
    model, programs = exported
    cache = torch.zeros(SLOTS, DIM)
    steps = _steps(cache)
    flat = [(args[0], kwargs["pos"], kwargs["cache"]) for args, kwargs in steps]
    expected, _ = _eager(model, steps)
    decoded = decode_on_runtime(programs["functional"], None, flat)
    for call in range(CALLS):
        torch.testing.assert_close(decoded.outputs[call][0], expected[call], atol=1e-5,
                                   rtol=1e-5)


def test_prefill_and_decodes_carry_one_cache_as_methods(exported):
    model, _ = exported
    cache = torch.zeros(SLOTS, DIM)
    torch.manual_seed(2)
    prompt = ((torch.randn(3, DIM),), {"pos": torch.arange(3), "cache": cache})
    decodes = [((torch.randn(1, DIM),), {"pos": torch.tensor([3 + i]), "cache": cache})
               for i in range(CALLS - 1)]
    programs = {
        name: PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(
            torch.export.export(copy.deepcopy(model), example[0], example[1])).program
        for name, example in (("prefill", prompt), ("decode", decodes[0]))
    }
    calls = [("prefill", *prompt), *(("decode", *step) for step in decodes)]
    expected, caches = _eager(model, [prompt, *decodes])
    run = run_methods_on_runtime(programs, calls)
    assert run.methods == ["prefill", *["decode"] * (CALLS - 1)]
    for call in range(CALLS):
        (output,) = run.outputs[call]
        torch.testing.assert_close(output, expected[call], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run.carried[call]["cache"], caches[call], atol=1e-5,
                                   rtol=1e-5)


def test_steps_that_do_not_fit_are_refused_naming_step_and_input_before_lowering(
        exported, monkeypatch):
    def no_lowering(*args, **kwargs):
        raise AssertionError("steps are checked before the program is lowered")

    monkeypatch.setattr("passes.executorch.edge_ops.to_edge_transform_and_lower", no_lowering)
    program = exported[1]["functional"]
    good = _steps(torch.zeros(SLOTS, DIM))

    def refused(step, match):
        with pytest.raises(ExecuTorchInputError, match=match) as info:
            decode_on_runtime(program, None, [*good[:2], step])
        assert info.value.argument == "steps[2]" and info.value.helper == "decode_on_runtime"
        return info.value

    (x,), kwargs = good[0]
    refused(((x,), {"pos": kwargs["pos"]}), "'cache' are missing")
    refused(((x,), {**kwargs, "mask": x}), "no keyword argument.*'mask'")
    refused(((x, x), kwargs), "2 positional arguments, the program takes 1")
    refused(((x,), {**kwargs, "pos": kwargs["pos"].int()}), "input 'pos' is int32, the "
            "program was exported for int64")
    refused(((x,), {**kwargs, "cache": torch.zeros(SLOTS + 1, DIM)}),
            r"'cache' has shape \[7, 8\], the program was exported for \[6, 8\]")
    refused((x, kwargs["pos"]), r"or its 3 input\(s\) flat: x, pos, cache")


def test_a_dynamic_size_out_of_its_range_is_refused_before_lowering(monkeypatch):
    monkeypatch.setattr("passes.executorch.edge_ops.to_edge_transform_and_lower", None)
    model, cache = CacheAsInput(), torch.zeros(SLOTS, DIM)
    tokens = torch.export.Dim("tokens", min=1, max=4)
    example = ((torch.randn(2, DIM),), {"pos": torch.arange(2), "cache": cache})
    ep = torch.export.export(model, example[0], example[1], dynamic_shapes={
        "x": {0: tokens}, "pos": {0: tokens}, "cache": None})
    step = ((torch.randn(5, DIM),), {"pos": torch.arange(5), "cache": cache})
    with pytest.raises(ExecuTorchInputError, match=r"'x' has shape \[5, 8\], the program "
                       r"was exported for \[s\w+, 8\].*<= 4") as info:
        decode_on_runtime(ep, None, [example, step])
    assert info.value.argument == "steps[1]"


def test_a_pte_alone_says_which_inputs_it_writes_by_its_plan(exported):
    """A ``.pte`` has no graph signature: the written input is the output that is the
    input's own value; threading from the bytes matches eager too."""
    from executorch.exir import to_edge_transform_and_lower

    model, programs = exported
    with torch.no_grad():
        pte = to_edge_transform_and_lower(copy.deepcopy(programs["functional"])
                                          ).to_executorch().buffer
    cache = torch.zeros(SLOTS, DIM)
    steps = _steps(cache)
    expected, caches = _eager(model, steps)
    flat = [(args[0], kwargs["pos"], kwargs["cache"]) for args, kwargs in steps]
    decoded = decode_on_runtime(pte, None, flat)
    for call in range(CALLS):
        (output,) = decoded.outputs[call]
        torch.testing.assert_close(output, expected[call], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decoded.carried[call]["input #2"], caches[call],
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ExecuTorchInputError, match=r"a \.pte program takes its inputs flat"):
        decode_on_runtime(pte, None, steps)
