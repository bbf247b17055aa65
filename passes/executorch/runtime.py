"""Decode on ExecuTorch's runtime: lower with XNNPACK (buffers decided by
:class:`BufferOwningPartitioner`), serialize to a ``.pte`` program, load it with the pybind
runtime in the wheel (``executorch.extension.pybindings.portable_lib``) and call it once
per step; the mutable buffers (KV caches) live in the loaded program and persist across
calls, exactly as on a device.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.backend.partitioner import Partitioner
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from executorch.extension.pybindings import portable_lib
from torch.export import ExportedProgram

from pass_manager.validation import Trace, call_inputs

from . import ParameterMutationOnExecuTorchError
from .partitioner import BufferOwningPartitioner

__all__ = ["RuntimeDecode", "decode_on_runtime", "decode_pte", "lower_to_pte", "output_grid"]


@dataclass
class RuntimeDecode:
    """What the runtime computed (``trace.outputs``, one entry per call) and what it took."""

    trace: Trace
    notes: list[str] = field(default_factory=list)
    delegates: int = 0
    lower_seconds: float = 0.0
    pte_bytes: int = 0


def _exported(program: Any, example_inputs: tuple) -> ExportedProgram:
    # A private copy: lowering must not touch the caller's state, and the runtime starts
    # from the buffers' values as they are now (the initial state of the decode).
    if isinstance(program, ExportedProgram):
        return copy.deepcopy(program)
    return torch.export.export(copy.deepcopy(program), copy.deepcopy(example_inputs))


def lower_to_pte(
    program: Any, example_inputs: tuple, partitioner: Partitioner | None = None
) -> tuple[bytes, BufferOwningPartitioner, int]:
    """``program`` (ExportedProgram or module) as a ``.pte`` buffer, the wrapper used, delegates.

    Raises:
        ParameterMutationOnExecuTorchError: ``program`` writes a parameter, which the
            runtime would not keep between calls.
    """
    wrapper = BufferOwningPartitioner(partitioner or XnnpackPartitioner())
    # ExecuTorch's emitter writes buffers back in place; with autograd on, parameters that
    # require grad make those writes illegal.
    with torch.no_grad():
        ep = _exported(program, example_inputs)
        lowered = to_edge_transform_and_lower(ep, partitioner=[wrapper])
        count = sum(
            1 for n in lowered.exported_program().graph.nodes
            if n.op == "get_attr" and n.target.startswith("lowered_module")
        )
        sig = lowered.exported_program().graph_signature
        if sig.parameters_to_mutate:
            raise ParameterMutationOnExecuTorchError(sorted(sig.parameters_to_mutate.values()))
        # ExecuTorch serializes only the shape of a mutated buffer unless asked: the runtime
        # must start from the program's state (e.g. a reset cache, a non-zero counter).
        # Their names go into the plan too, so that planned_memory can say which is which.
        mutated = set(sig.buffers_to_mutate.values())
        names = [name for name, fqn in sig.inputs_to_buffers.items() if fqn in mutated]
        config = ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(names)],
                                         emit_mutable_buffer_names=True)
        return lowered.to_executorch(config).buffer, wrapper, count


def decode_on_runtime(
    program: Any,
    example_inputs: tuple,
    steps: Sequence[Any],
    partitioner: Partitioner | None = None,
) -> RuntimeDecode:
    """Lower ``program``, load it once, and call it once per step (state persists)."""
    start = time.perf_counter()
    pte, wrapper, count = lower_to_pte(program, example_inputs, partitioner)
    seconds = time.perf_counter() - start
    return RuntimeDecode(decode_pte(pte, steps), list(wrapper.notes), count, seconds, len(pte))


def decode_pte(pte: bytes, steps: Sequence[Any]) -> Trace:
    """Load the ``.pte`` program ``pte`` once and call its ``forward`` once per step."""
    module = portable_lib._load_for_executorch_from_buffer(pte)
    trace = Trace()
    for args, kwargs in call_inputs(list(steps)):
        if kwargs:
            raise TypeError("the ExecuTorch runtime takes positional inputs only")
        flat = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        outputs = module.forward(flat)
        trace.outputs.append([o.clone() if isinstance(o, torch.Tensor) else o for o in outputs])
    return trace


def output_grid(program: Any) -> float | None:
    """The step of the quantization grid of ``program``'s outputs (the largest output scale).

    A quantized program ends in ``dequantize_per_tensor(q, scale, ...)``; a runtime whose
    integer kernels round differently lands on a neighbouring grid point, so per-step
    outputs agree within this step. ``None`` when no output is dequantized.
    """
    graph = program.graph if hasattr(program, "graph") else program.graph_module.graph
    scales = []
    for node in graph.output_node().all_input_nodes:
        if node.op == "call_function" and "dequantize" in str(node.target):
            scale = node.args[1]
            if isinstance(scale, (float, int)):
                scales.append(float(scale))
    return max(scales, default=None)
