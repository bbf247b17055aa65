"""One predicate for "this node quantizes or dequantizes": every spelling a program holds
(pt2e's ``quantized_decomposed`` ops with number or tensor qparams, per tensor, channel,
token or channel group; torchao's affine ops; the Edge op wrapping each; the out variant
``to_executorch`` runs), and the checks that knew only some of them."""

from __future__ import annotations

import pytest
import torch
import torch.ao.quantization.fx._decomposed  # defines the quantized_decomposed ops
import torchao.quantization.quant_primitives  # noqa: F401  (defines torchao's affine ops)
from torch.fx import Graph

from pass_manager import PassManager
from passes import InplaceToFunctional, MarkMutableBuffers
from passes._analysis.quantize_ops import (
    is_dequantize,
    is_fake_quantize,
    is_quantize,
    quantize_op,
    scale_of,
)
from passes._carried.pairs import suspected_pairs
from passes.flow.quantized_graphs import buffer_grid
from tests.models.quantized_state import PerChannelCache

qd, ao, aten = torch.ops.quantized_decomposed, torch.ops.torchao, torch.ops.aten

# (op, quantize or dequantize): every overload of each, ATen and Edge dialect.
QUANTIZE_OPS = [
    ("quantized_decomposed", "quantize_per_tensor", False),
    ("quantized_decomposed", "dequantize_per_tensor", True),
    ("quantized_decomposed", "quantize_per_channel", False),
    ("quantized_decomposed", "dequantize_per_channel", True),
    ("quantized_decomposed", "quantize_per_token", False),
    ("quantized_decomposed", "dequantize_per_token", True),
    ("quantized_decomposed", "quantize_per_channel_group", False),
    ("quantized_decomposed", "dequantize_per_channel_group", True),
    ("torchao", "quantize_affine", False),
    ("torchao", "dequantize_affine", True),
    ("torchao", "quantize_affine_float8_non_decomposed", False),
    ("torchao", "dequantize_affine_float8_non_decomposed", True),
]
NOT_QUANTIZE_OPS = [("quantized_decomposed", "choose_qparams"),
                    ("quantized_decomposed", "choose_qparams_per_token_asymmetric"),
                    ("aten", "fake_quantize_per_tensor_affine"), ("aten", "add")]


def _node(target) -> torch.fx.Node:
    return Graph().create_node("call_function", target, (), {})


def _spellings(namespace: str, name: str) -> list:
    """Every overload of the op (``.default``, ``.tensor``, ``.tensor2``, ``.out`` ...) and
    the Edge op wrapping each."""
    pytest.importorskip("executorch")
    import executorch.kernels.quantized  # noqa: F401  (per-token ops, out variants)
    from executorch.exir.dialects._ops import ops as exir_ops

    packet = getattr(getattr(torch.ops, namespace), name)
    found = [getattr(packet, overload) for overload in packet.overloads()]
    edge = getattr(getattr(exir_ops.edge, namespace), name)
    return found + [getattr(edge, op._overloadname) for op in found]


@pytest.mark.parametrize(("namespace", "name", "dequantizes"), QUANTIZE_OPS,
                         ids=[name for _, name, _ in QUANTIZE_OPS])
def test_every_spelling_of_a_quantize_op_is_recognised(namespace, name, dequantizes):
    spellings = _spellings(namespace, name)
    assert len(spellings) >= 2
    for target in spellings:
        node = _node(target)
        assert quantize_op(node) is not None, target
        assert (quantize_op(node).namespace, quantize_op(node).name) == (namespace, name)
        assert (is_dequantize(node), is_quantize(node)) == (dequantizes, not dequantizes)
        assert not is_fake_quantize(node)


@pytest.mark.parametrize(("namespace", "name"), NOT_QUANTIZE_OPS,
                         ids=[name for _, name in NOT_QUANTIZE_OPS])
def test_an_op_that_computes_qparams_or_fake_quantizes_is_no_quantize_op(namespace, name):
    for target in _spellings(namespace, name):
        node = _node(target)
        assert quantize_op(node) is None, target
        assert is_fake_quantize(node) == name.startswith("fake_quantize"), target


def test_the_scale_is_read_by_its_schema_name_wherever_the_op_puts_it():
    """``scale`` is the second argument of a per-tensor op, the third of torchao's."""
    graph = Graph()
    x, s = graph.placeholder("x"), graph.placeholder("s")
    per_tensor = graph.call_function(qd.dequantize_per_tensor.default,
                                     (x, 0.05, 0, -128, 127, torch.int8))
    affine = graph.call_function(ao.dequantize_affine.default,
                                 (x, [1, 4], s, s, torch.int8, -128, 127))
    assert scale_of(per_tensor) == 0.05
    assert scale_of(affine) is s
    assert scale_of(x) is None


class _AffineCarriedCache(torch.nn.Module):
    """Returns the next value of the cache it is passed through torchao's affine q/dq (a
    quantizer annotating the cache write with one block over the whole cache)."""

    GRID = ([2, 8, 4], torch.int8, -128, 127)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor):
        block, dtype, low, high = self.GRID
        scale, zero = torch.tensor([0.05]), torch.tensor([0])
        new = cache.index_copy(1, pos, x)
        q = ao.quantize_affine(new, block, scale, zero, dtype, low, high)
        return (new * x).sum(), ao.dequantize_affine(q, block, scale, zero, dtype, low, high)


def test_state_carried_through_torchaos_affine_quantization_is_suspected():
    """The pairing rules passed through ``quantized_decomposed`` q/dq only: a cache carried
    through torchao's ``quantize_affine`` was not suspected, so ``QuantizeMutableBuffers``
    and ``InputsToBuffers`` did not refuse it for want of a pairing ([] on the base)."""
    program = torch.export.export(
        _AffineCarriedCache(), (torch.randn(2, 1, 4), torch.tensor([0]), torch.zeros(2, 8, 4)))
    [pair] = suspected_pairs(program)
    assert (pair.input_name, pair.output_name) == ("cache", "1")


def test_the_grid_of_state_quantized_per_channel_is_its_largest_scale():
    """The main job's "no worse than torchao's flow" check allows one grid step of each
    buffer: state quantized per channel had none ({} on the base, a tolerance of 0)."""
    exported = torch.export.export(PerChannelCache(), (torch.randn(2, 1, 4), torch.tensor([0])))
    functional = PassManager([MarkMutableBuffers(), InplaceToFunctional()]).run(exported).program
    assert buffer_grid(functional.module()) == {"cache": pytest.approx(0.1)}
