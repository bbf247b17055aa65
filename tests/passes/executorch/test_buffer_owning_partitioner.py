"""BufferOwningPartitioner: ExecuTorch's own lowering, made correct where it is not alone.

Each case goes through ExecuTorch's ``to_edge_transform_and_lower`` twice: with the
partitioner alone (the failure ExecuTorch 1.5.1 has today is asserted, so the case is
known to be a real one) and wrapped. The wrapped program is run with
``lowered.exported_program().module()`` (ExecuTorch's demo backend runs its delegates in
Python) for 4 calls and compared with an eager deep copy: outputs and every buffer,
wherever it lives (top level or the delegate that owns it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from executorch.exir import to_edge, to_edge_transform_and_lower
from executorch.exir.backend.backend_api import to_backend
from torch._export.verifier import SpecViolationError

from pass_manager import assert_same_behaviour, run_program
from passes.delegation import BufferConsumptionError
from passes.executorch import BufferOwningPartitioner, executorch_state
from passes.executorch.partitioner import separate_new_buffer_values
from passes.flow.examples import decode_inputs, kv_decoder
from tests.models.executorch_cases import (
    CALLS,
    DEMO_BACKEND,
    OpPartitioner,
    ReturnsBuffer,
    SharedReader,
    TwoWriters,
    everything,
    vector_inputs,
)

CACHES = ["layers.0.attn.k_cache", "layers.0.attn.v_cache"]
# ExecuTorch's Edge decompositions (e.g. of the attention's softmax) round a little
# differently from eager, far below any real difference.
ATOL = 1e-5


def _decoder():
    model, _ = kv_decoder(1)
    return model, decode_inputs(model.cfg, CALLS, start=2)


def _vector(cls):
    return lambda: (cls(), vector_inputs())


# name -> (model and inputs, partitioner, what ExecuTorch alone does, owner of each buffer)
CASES = {
    "user_output": (_vector(ReturnsBuffer), everything,
                    (AssertionError, "currently not supported"), {"acc": DEMO_BACKEND}),
    "cache_update_only": (_decoder, lambda: OpPartitioner({"index_put": "update"}),
                          (RuntimeError, "Tried to erase Node"), dict.fromkeys(CACHES, "update")),
    "two_partitions_mutate": (_vector(TwoWriters), lambda: OpPartitioner({"add": "a", "mul": "b"}),
                              (SpecViolationError, "does not point to a buffer"), {}),
    "read_in_two_mutated_in_one": (_vector(SharedReader),
                                   lambda: OpPartitioner({"mul": "a", "add": "b"}), "wrong", {}),
    "whole_kv_cache": (_decoder, everything, "correct", dict.fromkeys(CACHES, DEMO_BACKEND)),
}
KEPT_REASONS = {
    "two_partitions_mutate": "it is mutated in 2 partitions (a, b)",
    "read_in_two_mutated_in_one": "it is read outside the partition that mutates it, by "
                                  "partition 'a'",
}


def _lower(model, inputs, partitioner):
    ep = torch.export.export(copy.deepcopy(model), inputs[0])
    return to_edge_transform_and_lower(ep, partitioner=[partitioner]).exported_program()


def owners(lowered) -> dict[str, str]:
    """FQN -> tag of the delegate owning it (its sub-program reads and writes it back)."""
    found = {}
    for node in lowered.graph.nodes:
        if node.op == "get_attr" and node.target.startswith("lowered_module"):
            module = getattr(lowered.graph_module, node.target)
            sig = module.original_module.graph_signature
            consumed = set(sig.inputs_to_buffers.values())
            assert consumed >= set(sig.buffers_to_mutate.values())
            tag = module.backend_id if module.backend_id != DEMO_BACKEND else None
            for fqn in sig.buffers_to_mutate.values():
                found[fqn] = tag or _partition_tag(module)
    assert set(found).isdisjoint(lowered.graph_signature.buffers_to_mutate.values())
    return found


def _partition_tag(module) -> str:
    # The demo backend keeps no tag; the partition name is the one the test's partitioner used.
    tags = {n.meta.get("delegation_tag") for n in module.original_module.graph.nodes} - {None}
    return tags.pop() if len(tags) == 1 else DEMO_BACKEND


@pytest.mark.parametrize("case", sorted(CASES))
def test_executorch_alone(case):
    make, partitioner, failure, _ = CASES[case]
    model, inputs = make()
    if isinstance(failure, tuple):
        error, message = failure
        with pytest.raises(error, match=message):
            _lower(model, inputs, partitioner())
        return
    lowered = _lower(model, inputs, partitioner())
    actual = run_program(lowered, inputs, state=executorch_state).outputs
    expected = run_program(model, inputs).outputs
    worst = max(float((a[0] - b[0]).abs().max()) for a, b in zip(actual, expected, strict=True))
    assert worst <= ATOL if failure == "correct" else worst > 0.1


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrapped_lowering_is_correct(case):
    make, partitioner, _, expected_owners = CASES[case]
    model, inputs = make()
    wrapper = BufferOwningPartitioner(partitioner())
    lowered = _lower(model, inputs, wrapper)
    assert_same_behaviour(model, lowered, inputs, atol=ATOL, state=executorch_state)
    found = owners(lowered)
    assert set(found) == set(expected_owners)
    if case == "cache_update_only":
        assert found == expected_owners
        assert all("returns its new value" in note for note in wrapper.notes)
    assert len(wrapper.notes) == len(wrapper.ownership) == max(1, len(expected_owners))
    if case in KEPT_REASONS:
        (verdict,) = wrapper.ownership
        assert verdict.reason == KEPT_REASONS[case]
        assert wrapper.notes == [f"kept 'acc' at the top level: {KEPT_REASONS[case]}"]


@pytest.mark.parametrize("case", sorted(KEPT_REASONS))
def test_strict_names_buffer_and_partitions(case):
    make, partitioner, _, _ = CASES[case]
    model, inputs = make()
    edge = to_edge(torch.export.export(copy.deepcopy(model), inputs[0])).exported_program()
    tags_before = {n.name: n.meta.get("delegation_tag") for n in edge.graph.nodes}
    with pytest.raises(BufferConsumptionError) as info:
        BufferOwningPartitioner(partitioner(), strict=True).partition(edge)
    assert info.value.buffer == "acc"
    assert info.value.partitions == ["a", "b"]
    assert info.value.pass_name == "BufferOwningPartitioner"
    assert "'a'" in str(info.value) and info.value.reason == KEPT_REASONS[case]
    assert {n.name: n.meta.get("delegation_tag") for n in edge.graph.nodes} == tags_before


def test_new_value_uses_read_a_copy():
    """The pre-decomposition rewrite: same behaviour, the user output a distinct node."""
    model, inputs = ReturnsBuffer(), vector_inputs()
    ep = torch.export.export(copy.deepcopy(model), inputs[0])
    rewritten = separate_new_buffer_values(ep)
    returned = rewritten.graph.output_node().args[0]
    assert len(returned) == 2 and returned[0] is not returned[1]
    # The mutation output is a value of its own (InplaceToFunctional's aten.copy).
    assert returned[0].target is torch.ops.aten.copy.default
    assert_same_behaviour(model, rewritten, inputs)
    assert len(ep.graph.output_node().args[0]) == 1  # the input program is left as it was


def test_to_backend_without_the_rewrite_keeps_the_buffer_correct():
    """Called through to_backend (no pre-decomposition hook), a buffer whose new value is
    returned cannot be owned: it stays at the top level, with the reason, and is correct."""
    model, inputs = ReturnsBuffer(), vector_inputs()
    edge = to_edge(torch.export.export(copy.deepcopy(model), inputs[0]))
    wrapper = BufferOwningPartitioner(everything())
    lowered = to_backend(edge.exported_program(), wrapper)
    (verdict,) = wrapper.ownership
    assert verdict.owner_tag is None and "also used outside partition" in verdict.reason
    assert owners(lowered) == {}
    assert_same_behaviour(model, lowered, inputs, atol=ATOL, state=executorch_state)


def test_own_buffers_false_keeps_every_buffer_at_the_top_level():
    make, partitioner, _, _ = CASES["whole_kv_cache"]
    model, inputs = make()
    wrapper = BufferOwningPartitioner(partitioner(), own_buffers=False)
    lowered = _lower(model, inputs, wrapper)
    assert owners(lowered) == {}
    assert all("gives its delegates no mutable buffers" in note for note in wrapper.notes)
    assert_same_behaviour(model, lowered, inputs, atol=ATOL, state=executorch_state)


@pytest.mark.parametrize("given", ["class", "string", "none"])
def test_a_partitioner_that_is_not_an_instance_is_refused_at_construction(given):
    """``BufferOwningPartitioner(XnnpackPartitioner)`` used to be accepted and fail later
    inside ExecuTorch; it is refused at once, naming the argument and the fix."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from passes.executorch import ExecuTorchInputError

    argument = {"class": XnnpackPartitioner, "string": "xnnpack", "none": None}[given]
    with pytest.raises(ExecuTorchInputError) as info:
        BufferOwningPartitioner(argument)
    assert info.value.argument == "partitioner"
    assert info.value.helper == "BufferOwningPartitioner"
    hint = "pass an instance: XnnpackPartitioner()" if given == "class" else "Partitioner instance"
    assert hint in str(info.value)


class ScalarState(torch.nn.Module):
    """A 0-d state value (a running mean of a projection, itself a 0-d value computed in
    the partition) scaling the output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.zeros(()))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        self.s.copy_(self.s * 0.5 + y.mean())
        return y * self.s, self.s * 1


class ScalarCounter(torch.nn.Module):
    """A 0-d counter scaling a projection, in the partition of its linear."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.n.add_(1.0)
        return self.lin(x) * self.n, self.n + 0


class ScalarInput(torch.nn.Module):
    """A 0-d keyword input (Hugging Face style ``scale=torch.tensor(0.2)``) and a 0-d value
    computed outside the linear's partition (``hidden.abs().sum()``), beside 2-d state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(1, 8))
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, hidden, scale):
        y = self.lin(hidden) * scale * hidden.abs().sum()
        self.acc.mul_(0.5).add_(y)
        return y + self.acc, self.acc * 1


def _scalar_case(name):
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "input":
        return ScalarInput(), [((), {"hidden": torch.randn(1, 8, generator=generator),
                                     "scale": torch.tensor(0.2 + 0.1 * step)})
                               for step in range(CALLS)]
    model = {"state": ScalarState, "counter": ScalarCounter}[name]()
    return model, [(torch.randn(2, 4, generator=generator),) for _ in range(CALLS)]


# The 0-d value each case quantizes (a placeholder, or a value computed outside the partition).
SCALAR_VALUES = {"state": {"b_s", "aten_mean_default"}, "counter": {"b_n"},
                 "input": {"scale", "aten_sum_dim_int_list"}}


@pytest.mark.parametrize("case", sorted(SCALAR_VALUES))
def test_a_quantized_zero_d_value_entering_xnnpack_is_quantized_outside_and_runs_like_python(
        case):
    """XNNPACK alone crashes inside its ChannelsLastTaggedReshapePass when a delegate
    quantizes a 0-d value it receives (an untyped ``Exception`` around ``IndexError: invalid
    index of a 0-dim tensor``): 0-d state, a 0-d user input, a 0-d value computed
    elsewhere. Wrapped, exactly those quantize nodes run at the top level (a note names
    each), the linear stays in XNNPACK, and ExecuTorch's runtime equals the quantized
    program bit for bit over 4 calls, outputs and state (each model returns its state)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from passes.executorch import decode_on_runtime
    from passes.flow.examples import xnnpack_quantizer
    from passes.quantization import quantize_program

    model, steps = _scalar_case(case)
    args, kwargs = steps[0] if isinstance(steps[0][-1], dict) else (steps[0], {})
    with torch.no_grad():
        quantized = quantize_program(torch.export.export(model.eval(), args, kwargs),
                                     xnnpack_quantizer(), steps)
        with pytest.raises(Exception, match="ChannelsLastTaggedReshapePass") as info:
            to_edge_transform_and_lower(copy.deepcopy(quantized),
                                        partitioner=[XnnpackPartitioner()])
        assert "invalid index of a 0-dim tensor" in str(info.value.__cause__)
        run = decode_on_runtime(copy.deepcopy(quantized), None, steps,
                                partitioner=XnnpackPartitioner())
    kept = {note.split("quantizing the 0-d ")[1].split(")")[0]
            for note in run.notes if "quantizing the 0-d" in note}
    assert kept == SCALAR_VALUES[case], run.notes
    assert run.delegates >= 1
    expected = run_program(copy.deepcopy(quantized), steps).outputs
    for step, (got, want) in enumerate(zip(run.trace.outputs, expected, strict=True)):
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (step, index, float((a - b).abs().max()))


class Accumulator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(2, 8))
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        self.acc.add_(y)
        return y + self.acc


def test_an_unfolded_weight_quantize_in_xnnpack_is_a_typed_error():
    """``quantize_program(..., fold=False)`` (``convert_pt2e(fold_quantize=False)``) leaves
    the linear's weight as parameter -> quantize -> dequantize: XNNPACK alone lowers it and
    its runtime computes wrong values (asserted: off by more than 1 on outputs of about 4);
    wrapped, a typed error names the quantize node, the weight and the fix."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from passes.executorch import UnfoldedQuantizeError, decode_on_runtime
    from passes.flow.examples import xnnpack_quantizer
    from passes.quantization import quantize_program

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    steps = [(torch.randn(2, 8, generator=generator),) for _ in range(CALLS)]
    with torch.no_grad():
        unfolded = quantize_program(torch.export.export(Accumulator().eval(), steps[0]),
                                    xnnpack_quantizer(), steps, fold=False)
        alone = to_edge_transform_and_lower(copy.deepcopy(unfolded),
                                            partitioner=[XnnpackPartitioner()])
        wrong = decode_on_runtime(alone, None, steps).outputs
        expected = run_program(copy.deepcopy(unfolded), steps).outputs
        assert max(float((a[0] - b[0]).abs().max())
                   for a, b in zip(wrong, expected, strict=True)) > 1
        with pytest.raises(UnfoldedQuantizeError) as info:
            to_edge_transform_and_lower(copy.deepcopy(unfolded), partitioner=[
                BufferOwningPartitioner(XnnpackPartitioner())])
    assert info.value.constant == "lin.weight"
    assert info.value.node.startswith("quantized_decomposed_quantize_per_tensor")
    assert "fold_quantize=True" in str(info.value)


class RunningTotal(torch.nn.Module):
    """A running total of its input (``linear=False``: the input plus one beside it) or of
    a linear layer's output (``linear=True``), returned with the output; ``beside``: a
    total of the input, returned with a linear layer's output and a softmax of the input,
    which XNNPACK computes in float in the partition it puts the transpose of the linear's
    weight in."""

    def __init__(self, linear: bool, beside: bool = False) -> None:
        super().__init__()
        self.beside = beside
        generator = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(4, 4) if linear else None
        if linear:
            with torch.no_grad():
                self.lin.weight.copy_(torch.randn(4, 4, generator=generator) / 2)
        self.register_buffer("total", torch.zeros(1, 4))

    def forward(self, x):
        if self.beside:
            self.total.add_(x)
            return self.lin(x), x.softmax(-1), self.total.clone()
        self.total.add_(self.lin(x) if self.lin is not None else x)
        return x + 1, self.total.clone()


@pytest.mark.parametrize(("linear", "beside"), [(False, False), (True, False), (True, True)],
                         ids=["add", "linear", "linear-beside-softmax"])
def test_uint8_grids_stay_out_of_xnnpack_and_run_like_python(linear, beside):
    """QnnQuantizer's uint8 grids through XNNPACK: ExecuTorch 1.5.1's XNNPACK serializes
    every per-tensor quantized value as int8, so ``x + 1`` on positive ``x`` (zero point 0)
    read uint8 bytes as int8 and was silently off by 1.0 on the runtime (and the total by
    more), and a linear (XNNPACK refuses its GEMM, then fails to load the transpose of its
    weight it kept, alone or in a partition with a float softmax) made the method fail to
    load (``RuntimeError ... error: 0x1``). Wrapped, those partitions, and that transpose,
    run on portable kernels (a note names each) and the runtime equals the quantized
    program bit for bit over 4 calls, outputs and the state the model returns."""
    from passes.executorch import decode_on_runtime
    from passes.quantization import quantize_program
    from tests.models.qnn import qnn_quantizer

    generator = torch.Generator().manual_seed(1)
    steps = [(torch.rand(1, 4, generator=generator) * 4,) for _ in range(CALLS)]
    with torch.no_grad():
        quantized = quantize_program(torch.export.export(RunningTotal(linear, beside),
                                                         steps[0]), qnn_quantizer(), steps)
    expected = run_program(copy.deepcopy(quantized), steps).outputs
    run = decode_on_runtime(copy.deepcopy(quantized), None, steps)
    for step, (got, want) in enumerate(zip(run.outputs, expected, strict=True)):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (step, float((a - b).abs().max()))
    assert any("uint8 grid" in note for note in run.notes), run.notes
    if beside:
        assert any("dequantized constants alone" in note for note in run.notes), run.notes


@pytest.mark.parametrize("quant_dtype", ["use_16a8w", "use_16a16w"])
def test_16_bit_grids_stay_out_of_xnnpack_and_run_like_python(quant_dtype):
    """QnnQuantizer's 16-bit activations (int32 storage over [0, 65535], a zero point near
    32768) through XNNPACK: ExecuTorch 1.5.1's XNNPACK partitioner takes them, and its
    serializer then refuses the int32 grid (``ValueError: Invalid quantization scale or zero
    point ... Found invalid zeropoint``), so nothing lowered. Wrapped, those partitions run
    on portable kernels (a note names each) and the runtime equals the quantized program bit
    for bit over 4 calls, outputs and the state the model returns."""
    from passes.executorch import decode_on_runtime
    from passes.quantization import quantize_program
    from tests.models.qnn import qnn_quantizer

    generator = torch.Generator().manual_seed(1)
    steps = [(torch.rand(1, 4, generator=generator) * 4,) for _ in range(CALLS)]
    with torch.no_grad():
        quantized = quantize_program(torch.export.export(RunningTotal(True), steps[0]),
                                     qnn_quantizer(quant_dtype, per_channel=True), steps)
    expected = run_program(copy.deepcopy(quantized), steps).outputs
    run = decode_on_runtime(copy.deepcopy(quantized), None, steps)
    for step, (got, want) in enumerate(zip(run.outputs, expected, strict=True)):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (step, float((a - b).abs().max()))
    assert any("torch.int32 (not int8) grid" in note for note in run.notes), run.notes


class SplitsItsCache(torch.nn.Module):
    """A cache written, halved and split in two halves, each summed."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x.unsqueeze(0))
        self.cache.mul_(0.5)
        first, second = self.cache.split(2)
        return first.sum(0) + second.sum(0)


_UPDATE = {"index_put": "update", "mul": "update", "split_with_sizes_copy": "update"}
_RECEIVES_LIST = (ValueError, "Trying to flatten user inputs")


@pytest.mark.parametrize(("tags", "alone"), [
    ({**_UPDATE, "getitem": "reader", "sum": "reader", "add": "reader"}, _RECEIVES_LIST),
    ({"getitem": "reader", "sum": "reader", "add": "reader"}, _RECEIVES_LIST),
    ({**_UPDATE, "getitem": "reader", "sum": "update", "add": "reader"},
     (AssertionError, "found dependency cycles")),
], ids=["split-in-another-partition", "split-at-top-level", "getitems-make-a-cycle"])
def test_getitems_go_with_their_split(tags, alone):
    """A partitioner tagging a ``split`` and its ``getitem`` nodes apart: ExecuTorch alone
    hands the delegate holding the ``getitem`` nodes the list, which fails when the program
    runs (``Trying to flatten user inputs``), or finds a dependency cycle through them; so
    did the wrapper on main. Wrapped, each ``getitem`` goes with its split (a note says so)
    and the lowered program runs like eager over 4 calls, outputs and state."""
    steps = [(torch.randn(3, generator=torch.Generator().manual_seed(i)), torch.tensor([i % 4]))
             for i in range(CALLS)]
    with torch.no_grad():
        ep = torch.export.export(SplitsItsCache(), steps[0])
    with pytest.raises(alone[0], match=alone[1]):
        edge = to_edge_transform_and_lower(copy.deepcopy(ep), partitioner=[OpPartitioner(tags)])
        edge.exported_program().module()(*steps[0])
    wrapper = BufferOwningPartitioner(OpPartitioner(tags))
    edge = to_edge_transform_and_lower(copy.deepcopy(ep), partitioner=[wrapper])
    assert any(note.startswith("moved getitem") for note in wrapper.notes), wrapper.notes
    assert_same_behaviour(SplitsItsCache(), edge.exported_program(), steps,
                          state=executorch_state)
    edge.to_executorch()


class ReadsInput(torch.nn.Module):
    """A stateful model whose argument is named ``input``, as ``nn.Linear.forward`` names
    its own: Python reserves the name, so a copied graph calls it ``input_1``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("acc", torch.ones(4))

    def forward(self, input):
        self.acc.add_(self.lin(input))
        return self.acc * 2


def test_an_input_named_input_lowers_wrapped():
    """The wrapper rewrote a copy of the program whose graph had renamed ``input`` to
    ``input_1``: lowering failed with ``SpecViolationError: Input spec name input does not
    match node name input_1``. Copies keep node names now; the lowered program equals eager
    over 4 calls, outputs and state (the delegate owns ``acc``; XNNPACK's wrapper, which
    copies the program alike, failed the same)."""
    inputs = [(torch.randn(4, generator=torch.Generator().manual_seed(i)),) for i in range(4)]
    with torch.no_grad():
        lowered = _lower(ReadsInput(), inputs, BufferOwningPartitioner(everything()))
    assert_same_behaviour(ReadsInput(), lowered, inputs, atol=ATOL, state=executorch_state)



class WritesThrice(torch.nn.Module):
    """``acc`` updated by three ops: add, mul (two partitions of a first partitioner), cos."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        self.acc.add_(x)
        self.acc.mul_(2)
        self.acc.cos_()
        return self.acc.sin()


@pytest.mark.parametrize(("model", "later_tags", "expected"), [
    (TwoWriters, {"sin": "c"},
     "its new value getitem_1 is an output of an earlier delegate (lowered_module_1 on "
     "DemoBackend via executorch_call_delegate) that did not take the buffer"),
    (WritesThrice, {"cos": "c"},
     "part of its update is computed outside partitions (executorch_call_delegate, "
     "executorch_call_delegate_1, getitem (an output of lowered_module_0 on DemoBackend via "
     "executorch_call_delegate), getitem_1 (an output of lowered_module_1 on"),
], ids=["value-from-earlier-delegate", "update-through-earlier-delegates"])
def test_later_wrapper_names_the_earlier_delegate(model, later_tags, expected):
    """Two wrapped partitioners in one lowering: the first keeps ``acc`` at the top level
    (two of its partitions mutate it), so part or all of its update is a result of the
    first one's delegates. The second wrapper sees those ``executorch_call_delegate`` calls
    untagged and said the value "is computed outside any partition" (or listed bare
    ``getitem`` nodes); its note now names the earlier delegates. The lowered program runs
    like eager over 4 calls, outputs and state."""
    inputs = vector_inputs()
    ep = torch.export.export(model(), inputs[0])
    first = BufferOwningPartitioner(OpPartitioner({"add": "a", "mul": "b"}))
    second = BufferOwningPartitioner(OpPartitioner(later_tags))
    edge = to_edge_transform_and_lower(ep, partitioner=[first, second])
    [note] = second.notes
    assert "outside any partition" not in note
    assert expected in note, note
    assert_same_behaviour(model(), edge.exported_program(), inputs, state=executorch_state)
