"""FakeValues: the fake value a pass gives a new node is the one FakeTensorMode computes.

Checked on the ops rewrites emit, with contiguous, non-contiguous (transposed) and
broadcast inputs, for the first evaluation of an op and for the cached repeats of it.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph, GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from passes._analysis.fake_values import FakeValues

aten = torch.ops.aten


class Ops(torch.nn.Module):
    """Values of several layouts for new nodes to read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 4, 8, 6))

    def forward(self, k, pos, row, x):
        kt = k.transpose(1, 2)  # (2, 4, 3, 6) with the strides of a (2, 3, 4, 6) tensor
        return kt, pos, row, x


def _program():
    args = (torch.randn(2, 3, 4, 6), torch.tensor([3, 5, 1]), torch.randn(6), torch.randn(6, 8))
    return torch.export.export(Ops(), args), args


def _metadata(val):
    return (tuple(val.shape), tuple(val.stride()), val.dtype, val.device)


def _expected(mode, target, args, kwargs):
    """What a FakeTensorMode dispatch of the op gives on the same fake inputs."""
    fake_args = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
    with mode:
        return target(*fake_args[0], **fake_args[1])


def _new_node(graph, output, target, *args, **kwargs):
    with graph.inserting_before(output):
        return graph.call_function(target, args, kwargs)


def test_new_nodes_get_the_fake_values_of_a_dispatch_also_when_cached():
    ep, _ = _program()
    graph = ep.graph
    cache, _k, pos, row, x = (n for n in graph.nodes if n.op == "placeholder")
    kt = next(n for n in graph.nodes if n.op == "call_function")
    output = next(n for n in graph.nodes if n.op == "output")
    fake = FakeValues(graph, tensor_meta=True)
    assert fake.mode is cache.meta["val"].fake_mode
    assert not kt.meta["val"].is_contiguous()
    cases = [
        (aten.index_copy.default, (cache, 2, pos, kt), {}),  # non-contiguous source
        (aten.add.Tensor, (cache, row), {}),  # broadcast
        (aten.mul.Tensor, (kt, row), {}),  # non-contiguous, broadcast
        (aten.clone.default, (kt,), {}),  # keeps the transposed layout
        (aten.clone.default, (kt,), {"memory_format": torch.contiguous_format}),
        (aten._to_copy.default, (x,), {"dtype": torch.float16}),
        (aten.t.default, (x,), {}),  # a view: never cached
    ]
    for _ in range(2):  # the second round is served from the cache
        for target, args, kwargs in cases:
            node = _new_node(graph, output, target, *args, **kwargs)
            fake.infer(node)
            val, expected = node.meta["val"], _expected(fake.mode, target, args, kwargs)
            assert _metadata(val) == _metadata(expected), (target, kwargs)
            assert node.meta["tensor_meta"].stride == tuple(expected.stride())
    # Each cached value is a fresh fake tensor: new nodes never seem to share storage.
    adds = [n for n in graph.nodes if n.target is aten.add.Tensor]
    assert len(adds) == 2
    first, second = (n.meta["val"].untyped_storage() for n in adds)
    assert first._cdata != second._cdata


def test_tuple_results_and_the_mode_found_past_inputs_without_fake_values():
    gm = make_fx(lambda x, y: torch.ops.aten.var_mean.correction(x + y, [0]),
                 tracing_mode="fake")(torch.randn(3, 5), torch.randn(5))
    graph = gm.graph
    first, second = (n for n in graph.nodes if n.op == "placeholder")
    del first.meta["val"]  # the mode is read from the next input that has one
    fake = FakeValues(graph, tensor_meta=True)
    assert fake.mode is second.meta["val"].fake_mode
    output = next(n for n in graph.nodes if n.op == "output")
    add = next(n for n in graph.nodes if n.target is aten.add.Tensor)
    for _ in range(2):
        node = _new_node(graph, output, aten.var_mean.correction, add, [0])
        fake.infer(node)
        item = _new_node(graph, output, operator.getitem, node, 1)
        fake.infer(item)
        assert [_metadata(v) for v in node.meta["val"]] == [((5,), (1,), torch.float32,
                                                             torch.device("cpu"))] * 2
        assert _metadata(item.meta["val"]) == ((5,), (1,), torch.float32, torch.device("cpu"))


def test_no_fake_values_no_inference():
    graph = Graph()
    x = graph.placeholder("x")
    node = graph.call_function(aten.add.Tensor, (x, x))
    graph.output(node)
    GraphModule(torch.nn.Module(), graph)
    fake = FakeValues(graph, tensor_meta=True)
    assert fake.mode is None
    fake.infer(node)
    assert "val" not in node.meta


def test_views_and_symbolic_sizes_fall_back_to_fake_tensor_prop():
    """A view is never keyed: FakeTensorProp gives it a value on its input's storage. An op
    on a symbolic size gets what FakeTensorProp gives; an input without a value leaves the
    node without one."""
    ep = torch.export.export(Ops(), _program()[1], dynamic_shapes=(
        {0: torch.export.Dim("batch", min=2, max=8)}, None, None, None))
    graph = ep.graph
    _cache, k, _pos, row, _x = (n for n in graph.nodes if n.op == "placeholder")
    output = next(n for n in graph.nodes if n.op == "output")
    fake = FakeValues(graph)
    view = _new_node(graph, output, aten.transpose.int, k, 0, 1)
    assert fake.infer(view)
    assert view.meta["val"].untyped_storage()._cdata == k.meta["val"].untyped_storage()._cdata
    assert _metadata(view.meta["val"]) == _metadata(_expected(fake.mode, aten.transpose.int,
                                                              (k, 0, 1), {}))
    summed = _new_node(graph, output, aten.sum.dim_IntList, k, [1])
    assert fake.infer(summed)
    assert not isinstance(summed.meta["val"].shape[0], int)  # the symbolic batch size
    assert "tensor_meta" not in summed.meta  # only asked for with tensor_meta=True
    del row.meta["val"]
    orphan = _new_node(graph, output, aten.mul.Tensor, row, 2)
    assert not fake.infer(orphan) and "val" not in orphan.meta


class Layouts(torch.nn.Module):
    """Values on a symbolic token size in the layouts a decoder's (de)quantize nodes read:
    contiguous, transposed, sliced (not dense, at an offset), expanded (a zero stride),
    with size-one dimensions in several places, and a symbolic size squared."""

    def forward(self, x, y):
        heads = x.view(1, x.shape[1], 4, 8)
        return (x, heads.transpose(1, 2), heads.transpose(1, 2)[..., 4:],
                heads[:, :, :1].expand(1, x.shape[1], 3, 8), x.transpose(1, 2)[:, :1],
                x[:, :, None, :], y @ y.transpose(1, 2), x.permute(2, 0, 1))


def _symbolic_program():
    tokens = torch.export.Dim("tokens", min=1, max=64)
    args = (torch.randn(1, 5, 32), torch.randn(1, 5, 8))
    return torch.export.export(Layouts(), args, dynamic_shapes=({1: tokens}, {1: tokens}))


def _layout(val):
    return (str(tuple(val.shape)), str(val.stride()), val.storage_offset(),
            str(val.untyped_storage().nbytes()), val.dtype, val.device)


def test_quantize_and_dequantize_on_symbolic_layouts_get_the_kernels_values():
    """(De)quantize nodes, whose Meta kernel is an ``empty_like`` of the input, get the
    layout (sizes, strides, storage size, dtype) the fake mode's dispatch of the kernel
    gives, on every layout of symbolic sizes, for the first node of a layout and the
    cached repeats; each value on a storage of its own."""
    import torch.ao.quantization.fx._decomposed  # registers the ops

    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    graph = _symbolic_program().graph
    output = graph.output_node()
    values = [n for n in output.args[0]]
    assert all(n.meta["val"]._has_symbolic_sizes_strides for n in values)
    fake = FakeValues(graph)
    made = []
    for _ in range(2):
        for value in values:
            q = _new_node(graph, output, quantize, value, 0.1, 3, 0, 255, torch.uint8)
            dq = _new_node(graph, output, dequantize, q, 0.1, 3, 0, 255, torch.uint8,
                           out_dtype=torch.float16)
            for node in (q, dq):
                assert fake.infer(node)
                expected = _expected(fake.mode, node.target, node.args, node.kwargs)
                assert _layout(node.meta["val"]) == _layout(expected), (value.name, node.name)
                made.append(node.meta["val"])
    assert len({v.untyped_storage()._cdata for v in made}) == len(made)
    # A dense input's strides are the result's as they are: no symbolic arithmetic.
    x, q = values[0].meta["val"], made[0]
    assert q.stride()[0].node is x.stride()[0].node


def test_a_failing_kernel_check_on_symbolic_sizes_is_reported_as_the_kernel_reports_it():
    """quantize's Meta kernel refuses an integer input: the node gets no value and the
    kernel's error comes out, as without the layout shortcut."""
    import torch.ao.quantization.fx._decomposed  # registers the ops

    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    graph = _symbolic_program().graph
    output = graph.output_node()
    x = output.args[0][0]
    fake = FakeValues(graph)
    good = _new_node(graph, output, quantize, x, 0.1, 3, 0, 255, torch.uint8)
    assert fake.infer(good)
    bad = _new_node(graph, output, quantize, good, 0.1, 3, 0, 255, torch.uint8)
    with pytest.raises(AssertionError, match=r"Expecting input to have dtype torch\.float32"):
        fake.infer(bad)
    assert "val" not in bad.meta


class ItemPositionCache(torch.nn.Module):
    """ExecuTorch llama's KV cache: written through a ``narrow`` at ``input_pos[0].item()``,
    so the written view's storage offset is data-dependent (``4*u0``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, 16, 4))

    def forward(self, k, input_pos):
        start = input_pos[0].item()
        torch._check_is_size(start)
        torch._check(start < 16)
        self.k_cache.narrow(2, start, k.shape[2]).copy_(k)
        return self.k_cache.sum(2)


@pytest.mark.parametrize("form", ["exported", "module"])
def test_a_write_at_a_data_dependent_offset_gets_its_value_without_guarding(form):
    from pass_manager import PassManager, assert_same_behaviour
    from passes import InplaceToFunctional, MarkMutableBuffers

    def call(start, n=3):
        return torch.randn(1, 2, n, 4), torch.arange(start, start + n)

    tokens = torch.export.Dim("tokens", min=1, max=8)
    ep = torch.export.export(ItemPositionCache(), call(0),
                             dynamic_shapes=({2: tokens}, {0: tokens}))
    program = ep if form == "exported" else ep.module()
    # Asking whether the written view's offset is 0 guarded on it: a fake-failure refusal.
    result = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(program).program
    assert_same_behaviour(ItemPositionCache(), result, [call(0), call(3, 2), call(5, 4)])
