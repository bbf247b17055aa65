"""Top-level ops ExecuTorch's portable kernels abort the process on, found before serializing.

ExecuTorch 1.5.1's portable quantized kernels (``executorch.kernels.quantized``) run the
quantize and dequantize nodes a program keeps at the top level (every node a partitioner
leaves out, and the portable lowering with no partitioner). They take float32, float64
and float16 as the float side, and check it with ``ET_CHECK_MSG``, which aborts the whole
process: a ``quantize_per_tensor`` of a bfloat16 value (``Unhandled input dtype 15``) or a
``dequantize_per_tensor(..., out_dtype=torch.bfloat16)`` (``Unhandled output dtype 15``)
kills the Python interpreter that runs the ``.pte``, and the device's app. Python runs
them (torch's reference converts a bfloat16 input to float32), so the program looks fine
until it runs. QnnQuantizer annotates a cast such as ``x.to(torch.bfloat16)`` written into
bfloat16 state, which puts both forms in the program. A per-channel quantize aborts the same
way unless its scales are float64 and its zero points int64 (``scale.scalar_type() 6 is not
double type``): torch's reference takes float32 scales, so a model quantizing by hand with
``torch.tensor([0.02, ...])`` scales runs in Python and kills the runtime. (The
per-channel dequantize takes such a grid: measured, it runs.)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from .._analysis.quantize_ops import quantize_op
from . import PortableKernelAbortError

__all__ = ["aborting_kernels", "refuse_aborting_kernels"]

# The float dtypes the portable quantized kernels take (ET_FORALL_FLOAT_TYPES, with Half).
_KERNEL_FLOATS = frozenset({torch.float32, torch.float64, torch.float16})
# The quantize/dequantize ops ExecuTorch's quantized kernel library runs (quantized.yaml):
# pt2e's, per tensor, channel or token, not per channel group.
_PORTABLE_GRANULARITIES = frozenset({"tensor", "channel", "token"})


def _dtype(value: object) -> torch.dtype | None:
    return value.dtype if isinstance(value, torch.Tensor) else None


def aborting_kernels(program: ExportedProgram) -> Iterator[tuple[Node, str, str, torch.dtype]]:
    """The top-level nodes of ``program`` (delegates' bodies are their backends' own) whose
    portable kernel aborts on their dtypes: ``(node, op, side, dtype)``, ``side`` one of
    ``"input"``, ``"output"``, ``"scales"``, ``"zero points"``."""
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        op = quantize_op(node)  # any dialect: ATen, Edge, out variant
        if (op is None or op.namespace != "quantized_decomposed"
                or op.granularity not in _PORTABLE_GRANULARITIES):
            continue
        for side, index, wanted in (("scales", 1, torch.float64), ("zero points", 2, torch.int64)):
            grid = node.args[index] if len(node.args) > index else None
            dtype = _dtype(grid.meta.get("val")) if isinstance(grid, Node) else None
            if (op.granularity == "channel" and not op.dequantizes and dtype is not None
                    and dtype != wanted):
                yield node, op.qualified_name, side, dtype
        if op.dequantizes:
            side, dtype = "output", _dtype(node.meta.get("val"))
        elif node.args and isinstance(node.args[0], Node):
            side, dtype = "input", _dtype(node.args[0].meta.get("val"))
        else:
            continue
        if dtype is not None and dtype.is_floating_point and dtype not in _KERNEL_FLOATS:
            yield node, op.qualified_name, side, dtype


def refuse_aborting_kernels(program: ExportedProgram, helper: str,
                            method: str = "forward") -> None:
    """Raise :class:`PortableKernelAbortError` for the first node of ``program`` (lowered,
    before ``to_executorch()``) whose portable kernel would abort the process."""
    for node, op, side, dtype in aborting_kernels(program):
        raise PortableKernelAbortError(helper, node.name, op, side, dtype, method)
