"""The methods of one model called in turn on one state, as on a device.

:func:`run_methods` is :func:`pass_manager.validation.run_program` for a mapping
``{name: program}`` of methods sharing their buffers by name: the buffers the methods
share stay one tensor, so a prefill's writes are what the next decode reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram

from pass_manager import ValidationInputError
from pass_manager.call_signature import signature_of
from pass_manager.validation import StateReader, Trace, copy_program, default_state, snapshot

from .._analysis.buffers import BUFFER, find_mutations
from .._carried.pairs import method_pairing, pairs_of
from .calibration import keywords_bound
from .calls import PairedState

__all__ = ["run_methods"]


def run_methods(
    programs: Mapping[str, Any],
    calls: Sequence[tuple[str, tuple, Mapping[str, Any]]],
    state: StateReader = default_state,
    on_call: Callable[[int], None] | None = None,
    share_by_name: bool = False,
    next_values: Mapping[str, Any] | None = None,
    pair_by_name: tuple[str, str] | None = None,
) -> Trace:
    """Call the methods of one model in deployment order, on one copy of them all.

    ``programs`` maps method names to programs (an ``nn.Module`` each, or an
    ``ExportedProgram``, whose ``module()`` runs on its own state tensors); ``calls`` are
    ``(method, args, kwargs)`` triples. The mapping is copied as a whole, so buffer tensors
    the methods share stay shared in the copy: a prefill's writes are what the next decode
    reads, as on a device. ``share_by_name`` also makes the copies' buffers of one name one
    tensor (the first method's), as a ``.pte``'s shared mutable buffers are, for methods
    whose state was copied apart (each exported or quantized on its own): the buffers some
    method writes. A buffer no method writes stays each method's own (quantization lifts a
    prefill's step 4 and a decode's step 1 as ``_tensor_constant_<n>`` of one name); of a
    method that is neither an ExportedProgram nor a GraphModule every buffer is shared.
    Each call's entry in ``trace.buffers`` holds every method's buffers by name (a shared
    buffer once). The caller's programs are untouched.

    State carried as input/output pairs (``next_values``: one ``{input: output}`` for every
    method or ``{method: {input: output}}``; ``pair_by_name``: ``(input prefix, output
    prefix)``, as :class:`passes.InputsToBuffers` takes them) is threaded as deployment
    threads it (as ``decode_on_runtime`` and ``run_methods_on_runtime`` do): each later
    call passing the same tensor for a paired input is given the output the previous call
    returned for it. Pairs need ExportedPrograms (their call specs name inputs and
    outputs). Unpaired, every call gets the tensors it is given, as eager does; a
    positional input may be passed by keyword, as to the eager module.
    """
    pairs: dict[str, dict[int, int]] = {}
    if next_values is not None or pair_by_name is not None:
        for name, program in programs.items():
            if not isinstance(program, ExportedProgram):
                raise ValidationInputError(
                    "run_methods", "next_values", f"method {name!r} is a "
                    f"{type(program).__name__}: pairs name the inputs and outputs of an "
                    "ExportedProgram; pass the exported methods")
            pairing = method_pairing(next_values, name, list(programs))
            if pairing is None and pair_by_name is None:
                continue
            pairs[name] = {p.input: p.output for p in pairs_of(
                program, pairing, pair_by_name, "run_methods", name)}
    paired = PairedState(programs, pairs)
    copies = copy_program(dict(programs))
    modules = {name: program.module() if isinstance(program, ExportedProgram) else program
               for name, program in copies.items()}
    for name, module in modules.items():
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"cannot run method {name!r}: a {type(module).__name__}")
    if share_by_name:
        _share_buffers_by_name(modules, _written_buffers(programs))
    trace = Trace()
    # Copied together: a tensor several calls pass (input-carried state) stays one tensor.
    for index, (method, args, kwargs) in enumerate(copy.deepcopy(list(calls))):
        if method not in modules:
            raise ValidationInputError("run_methods", f"calls[{index}]",
                                       f"names method {method!r}; the methods are "
                                       f"{', '.join(map(repr, modules))}")
        args, kwargs, given = paired.inputs(method, tuple(args), dict(kwargs))
        if isinstance(programs[method], ExportedProgram):
            # A positional input passed by keyword, as the module and the calibration of
            # quantize_methods take it (the unlifted module raises a keyword mismatch).
            args, kwargs = keywords_bound(signature_of(programs[method]).positional,
                                          args, kwargs)
        with torch.no_grad():
            out = modules[method](*args, **kwargs)
        paired.returned(method, given, out)
        trace.outputs.append(snapshot(out))
        buffers: dict[str, torch.Tensor] = {}
        for module in modules.values():
            buffers.update(state(module))
        trace.buffers.append(buffers)
        trace.inputs.append(snapshot((args, kwargs)))
        if on_call is not None:
            on_call(index)
    return trace


def _written_buffers(programs: Mapping[str, Any]) -> set[str] | None:
    """The buffers some method writes, by name; ``None`` (all of them) when a method is a
    plain module, whose writes no graph shows."""
    written: set[str] = set()
    for program in programs.values():
        if not isinstance(program, (ExportedProgram, torch.fx.GraphModule)):
            return None
        written.update(state.name for state in find_mutations(program).writers
                       if state.kind == BUFFER)
    return written


def _share_buffers_by_name(modules: Mapping[str, torch.nn.Module],
                           written: set[str] | None) -> None:
    first: dict[str, tuple[str, torch.Tensor]] = {}
    for method, module in modules.items():
        for fqn, tensor in list(module.named_buffers()):
            if written is not None and fqn not in written:
                continue  # read-only: each method keeps its own value, as in a .pte
            if fqn not in first:
                first[fqn] = method, tensor
                continue
            other, shared = first[fqn]
            if (shared.shape, shared.dtype) != (tensor.shape, tensor.dtype):
                raise ValidationInputError(
                    "run_methods", None, f"buffer {fqn!r} is {tuple(shared.shape)} "
                    f"{shared.dtype} in method {other!r} but {tuple(tensor.shape)} "
                    f"{tensor.dtype} in {method!r}: one buffer cannot hold both")
            *path, leaf = fqn.split(".")
            owner = module.get_submodule(".".join(path)) if path else module
            owner._buffers[leaf] = shared
