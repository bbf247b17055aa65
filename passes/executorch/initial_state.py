"""Each mutable buffer of a ``.pte`` starts from its own initial value.

ExecuTorch 1.5.1's emitter, asked for the mutable buffers' names
(``emit_mutable_buffer_names=True``) and their initial values
(``InitializedMutableBufferPass``), looks an initialized mutable buffer's bytes up among the
*constants* it has already emitted (``_tensor_spec_to_evalue``: the named-buffer branch
consults ``cached_spec_hash_values``). When a constant with the same bytes came first (an
``int64`` zero such as the Hugging Face cache's ``cumulative_length``, and an ``int64``
zero constant of an earlier method), the buffer is given that constant's index, but the
runtime reads the index in the mutable data segment: the buffer starts from whatever
buffer sits there, or, when no buffer has an entry of its own, the emitter writes no
segment and the runtime refuses to load the method (a float accumulator's zeros matching
QnnQuantizer's per-channel int32 zero points). The Hugging Face prefill's counters started
so from an int8 key cache's bytes (``0x1414141414141414``, its zero point 20 repeated)
and its ``index_put`` failed out of bounds; with float caches the buffer there held zeros
and the wrong read went unseen.

:func:`repair_initial_state` checks every initialized mutable buffer of the emitted program
against the value its method's program holds for it and points each one that reads
another's bytes at a segment entry of its own, then serializes the program again.
"""

from __future__ import annotations

import torch
from executorch.exir import ExecutorchBackendConfig, ExecutorchProgramManager
from executorch.exir._serialize._serialize import serialize_for_executorch
from executorch.exir.schema import Buffer, Tensor

__all__ = ["repair_initial_state"]


def _bytes_of(tensor: torch.Tensor) -> bytes:
    """The bytes the emitter serializes for ``tensor`` (contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def repair_initial_state(et: ExecutorchProgramManager,
                         config: ExecutorchBackendConfig) -> list[str]:
    """Point each initialized mutable buffer of ``et`` whose segment entry does not hold
    its initial value at an entry that does, and serialize ``et`` again with ``config``
    (the one it was made with). Returns a note per repaired buffer (none: unchanged).

    Works around ExecuTorch 1.5.1's emitter (module docstring); a buffer without a name
    or a value in its method's program is left as the emitter made it.
    """
    output = et._emitter_output  # the emitted program, before serialization
    # When every initialized buffer was matched to a constant, the emitter emits no
    # segment at all (None: only its reserved empty entry 0), and the runtime refuses to
    # load the method (``getTensorDataPtr() failed: 0x20``): start one.
    segment = output.mutable_data or [Buffer(storage=b"")]
    notes = []
    for plan in output.program.execution_plan:
        program = et.exported_program(plan.name)
        state = {**program.state_dict, **program.constants}
        for value in plan.values:
            tensor = value.val
            if not (isinstance(tensor, Tensor) and tensor.allocation_info is not None
                    and tensor.data_buffer_idx > 0 and tensor.extra_tensor_info is not None):
                continue
            fqn = tensor.extra_tensor_info.fully_qualified_name
            if not isinstance(state.get(fqn), torch.Tensor):
                continue
            wanted = _bytes_of(state[fqn])
            index = tensor.data_buffer_idx
            held = bytes(segment[index].storage) if index < len(segment) else None
            if held == wanted:
                continue
            segment.append(Buffer(storage=wanted))
            tensor.data_buffer_idx = len(segment) - 1
            notes.append(f"{plan.name}: mutable buffer {fqn!r} was emitted reading entry "
                         f"{index} of the mutable data segment, not its initial value "
                         f"(ExecuTorch's emitter matched it to a constant of the same "
                         f"bytes); it now reads entry {tensor.data_buffer_idx}, its own")
    if notes:
        output.mutable_data = segment
        et._pte_data, et._tensor_data = serialize_for_executorch(
            output, config, et._data_serializer, et._named_data)
        et._buffer = None
    return notes
