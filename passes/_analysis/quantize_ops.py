"""Whether a node quantizes or dequantizes a value, in every spelling a program holds.

A quantize (or dequantize) op comes in many spellings, and a check that knows only some
of them is silently blind to the rest:

* pt2e's ``quantized_decomposed`` ops, per tensor (qparams as numbers, ``.default``, or as
  tensors, ``.tensor`` / ``.tensor2``), per channel, per token and per channel group;
* torchao's affine quantization (``torchao::quantize_affine``, ``dequantize_affine`` and
  their float8 forms), which ExecuTorch's Qualcomm backend lowers for block-quantized
  weights;
* ATen's own quantized-tensor ops (``aten::quantize_per_tensor``, ``aten::dequantize``);
* each of them as ``to_edge`` wraps it (an ``EdgeOpOverload``) and as ``to_executorch``
  turns it into its out variant (``.out``, ``.Tensor_out``).

All spellings of one op share its schema's name (``quantized_decomposed::quantize_per_tensor``),
so an op is recognised by that name, never by its printed form or its Python object.
Fake quantization (``aten::fake_quantize_per_tensor_affine``, QAT's rounding in float) is no
quantize op: :func:`is_fake_quantize` names it apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .op_schema import argument_value

__all__ = [
    "QuantizeOp",
    "is_dequantize",
    "is_fake_quantize",
    "is_quantize",
    "is_quantize_or_dequantize",
    "quantize_op",
    "scale_of",
]


@dataclass(frozen=True)
class QuantizeOp:
    """What a quantize or dequantize op is, whatever its spelling.

    Attributes:
        namespace: ``"quantized_decomposed"``, ``"torchao"`` or ``"aten"``.
        name: the op's name in it, ``"dequantize_per_channel"``.
        dequantizes: a dequantize (integer to float) rather than a quantize.
        granularity: which values share qparams: ``"tensor"``, ``"channel"``, ``"token"``,
            ``"channel_group"``, ``"affine"`` (torchao's block sizes, any of these) or
            ``"any"`` (``aten::dequantize``, whose input's qparams say).
    """

    namespace: str
    name: str
    dequantizes: bool
    granularity: str

    @property
    def qualified_name(self) -> str:
        """``"quantized_decomposed.quantize_per_tensor"``: the op in every dialect."""
        return f"{self.namespace}.{self.name}"


def _ops(namespace: str, granularities: dict[str, str]) -> dict[tuple[str, str], QuantizeOp]:
    found = {}
    for suffix, granularity in granularities.items():
        for prefix, dequantizes in (("quantize", False), ("dequantize", True)):
            name = prefix + suffix
            found[(namespace, name)] = QuantizeOp(namespace, name, dequantizes, granularity)
    return found


# (namespace, name) -> the op, for every quantize/dequantize op a program may hold.
_QUANTIZE_OPS = {
    **_ops("quantized_decomposed", {"_per_tensor": "tensor", "_per_channel": "channel",
                                    "_per_token": "token",
                                    "_per_channel_group": "channel_group"}),
    **_ops("torchao", {"_affine": "affine", "_affine_float8_non_decomposed": "affine"}),
    # ATen's quantized tensors: one dequantize for every granularity.
    **{("aten", name): QuantizeOp("aten", name, name == "dequantize", granularity)
       for name, granularity in (("quantize_per_tensor", "tensor"),
                                 ("quantize_per_tensor_dynamic", "tensor"),
                                 ("quantize_per_channel", "channel"),
                                 ("dequantize", "any"))},
}

_FAKE_QUANTIZE_OPS = frozenset({
    ("aten", "fake_quantize_per_tensor_affine"),
    ("aten", "fake_quantize_per_channel_affine"),
    ("aten", "fake_quantize_per_tensor_affine_cachemask"),
    ("aten", "fake_quantize_per_channel_affine_cachemask"),
    ("aten", "_fake_quantize_per_tensor_affine_cachemask_tensor_qparams"),
    ("aten", "_fake_quantize_learnable_per_tensor_affine"),
    ("aten", "_fake_quantize_learnable_per_channel_affine"),
    ("quantized_decomposed", "fake_quant_per_channel"),
})


def _schema(target: Any) -> torch.FunctionSchema | None:
    """The schema of an OpOverload, its out variant, or the ATen op an Edge op wraps (whose
    own schema is ExecuTorch's class, with the same name and arguments)."""
    if not isinstance(target, torch._ops.OpOverload):
        target = getattr(target, "_op", target)
    schema = getattr(target, "_schema", None)
    return schema if isinstance(schema, torch.FunctionSchema) else None


def _schema_name(target: Any) -> tuple[str, str] | None:
    """``("quantized_decomposed", "quantize_per_tensor")`` for any spelling of that op."""
    schema = _schema(target)
    if schema is None:
        return None
    namespace, _, name = schema.name.partition("::")
    return namespace, name


def quantize_op(target: Any) -> QuantizeOp | None:
    """The quantize or dequantize op ``target`` (a node's target, or a node) is, else None."""
    if isinstance(target, Node):
        if target.op != "call_function":
            return None
        target = target.target
    key = _schema_name(target)
    return None if key is None else _QUANTIZE_OPS.get(key)


def is_quantize(node: Node) -> bool:
    """``node`` quantizes a float value onto integers (any spelling, any granularity)."""
    op = quantize_op(node)
    return op is not None and not op.dequantizes


def is_dequantize(node: Node) -> bool:
    """``node`` dequantizes integers back to float (any spelling, any granularity)."""
    op = quantize_op(node)
    return op is not None and op.dequantizes


def is_quantize_or_dequantize(node: Node) -> bool:
    """``node`` quantizes or dequantizes (any spelling, any granularity)."""
    return quantize_op(node) is not None


def is_fake_quantize(node: Node) -> bool:
    """``node`` rounds a float value onto a grid and stays float (QAT's fake quantization)."""
    return node.op == "call_function" and _schema_name(node.target) in _FAKE_QUANTIZE_OPS


def scale_of(node: Node) -> Any:
    """The scale (or scales) argument of a quantize/dequantize node: a number, a tensor, a
    node computing it (dynamic quantization) or a ``get_attr``; None for another node or an
    op without one (``aten::dequantize`` reads it from its quantized input)."""
    if quantize_op(node) is None:
        return None
    schema = _schema(node.target)
    for i, argument in enumerate(schema.arguments):
        if argument.name in ("scale", "scales"):
            return argument_value(node, schema, i)
    return None
