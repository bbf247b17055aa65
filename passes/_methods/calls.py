"""The pieces of :func:`passes.quantization.quantize_methods` that are about methods, not
quantization: the calls it calibrates along, one set of buffer tensors for all the methods,
and what it returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from pass_manager import Report
from pass_manager.call_signature import signature_of

from .._analysis.buffers import (
    BUFFER,
    INITIAL_META,
    MUTABLE_BUFFER_META,
    MUTABLE_INPUT_META,
    PARAMETER,
    USER_INPUT,
    buffer_nodes,
    buffer_tensor,
    find_mutations,
    replace_buffer_tensor,
)
from .._analysis.marked_state import initial_copy, mutable_buffers
from .._analysis.op_schema import written_nodes
from ..errors import InputStateError, QuantizationInputError
from .calibration import described, keywords_bound, sequence_of_calls
from .shared_buffers import held_buffers, written_by_any_method

__all__ = ["MethodCall", "PairedState", "QuantizedMethods", "carried_inputs",
           "check_write_backs", "mark_state_of_other_methods", "method_calls",
           "reads_kept_live", "share_buffer_tensors"]

MethodCall = tuple[str, tuple, dict]


def method_calls(programs: Mapping[str, Any], calls: Iterable[Any], where: str,
                 ) -> list[MethodCall]:
    """``calls`` as ``(method, args, kwargs)`` triples, checked against ``programs``: a
    sequence of calls (not ``None``, a tensor or one call), each naming a method, and every
    method called at least once (its own observers would measure nothing otherwise)."""
    example = "[('prefill', (x, pos)), ('decode', (x1, pos1)), ...]"
    given = calls
    calls = sequence_of_calls(calls, where, "calls", example)
    if isinstance(given, tuple) and len(calls) in (2, 3) and isinstance(calls[0], str) \
            and calls[0] in programs and not isinstance(calls[1], str):
        raise QuantizationInputError(
            where, "calls", f"is one call ({calls[0]!r}, ...), not a sequence of calls: pass "
            f"a list of calls, e.g. {example}")
    found = []
    for index, call in enumerate(calls):
        _check_call_form(call, programs, where, index)
        method, args, kwargs = (*call, {}) if len(call) == 2 else call
        if not isinstance(args, tuple):
            args = tuple(args) if isinstance(args, list) else (args,)
        found.append((method, args, dict(kwargs)))
    uncalled = [name for name in programs if name not in {m for m, _, _ in found}]
    if uncalled:
        raise QuantizationInputError(where, "calls", "no calibration call for method(s) "
                         f"{', '.join(map(repr, uncalled))}: every method needs at least one, "
                         "or the observers only it has measure nothing")
    return found


def _check_call_form(call: Any, programs: Mapping[str, Any], where: str, index: int) -> None:
    """Raise :class:`QuantizationInputError` naming ``calls[index]`` when ``call`` is not
    ``(method, args)`` or ``(method, args, kwargs)`` of one of ``programs``: what it is, in
    a few words (:func:`~passes._methods.calibration.described`, never a tensor's data), and
    the call to write instead, with the method's own input names."""
    methods = ", ".join(map(repr, programs))

    def example(method: str) -> str:
        names = signature_of(programs[method]).positional
        return f"({method!r}, ({', '.join(names)}{',' if len(names) == 1 else ''}))"

    parts = (call,) if isinstance(call, str) else call
    if not (isinstance(parts, (tuple, list)) and parts and isinstance(parts[0], str)):
        reason = (f"is {described(call)}, with no method name first: each call is (method, "
                  f"args) or (method, args, kwargs), the method one of {methods}, e.g. "
                  f"{example(next(iter(programs)))}")
    elif parts[0] not in programs:
        reason = f"names method {parts[0]!r}; the methods are {methods}"
    elif len(parts) == 1:
        reason = (f"is the method {parts[0]!r} alone: give its arguments too, "
                  f"{example(parts[0])}")
    elif len(parts) > 3 or (len(parts) == 3 and not isinstance(parts[2], Mapping)):
        values = ", ".join(described(value, 0) for value in parts[1:4])
        reason = (f"is ({parts[0]!r}, then {len(parts) - 1} values: {values}"
                  f"{', ...' if len(parts) > 4 else ''}); a call is (method, args) or (method, "
                  "args, kwargs), the arguments one tuple and the keyword arguments a dict: "
                  f"pass {example(parts[0])}")
    else:
        return
    raise QuantizationInputError(where, f"calls[{index}]", reason)


def _user_input_values(program: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The value each user input placeholder of ``program`` gets in the call, by name (a
    positional input passed by keyword included, as the calibration call binds it)."""
    args, kwargs = keywords_bound(signature_of(program).positional, tuple(args), kwargs)
    order = list(program.call_spec.in_spec.children()[1].context or ())
    if set(order) - set(kwargs):
        return {}  # not a call of this program: check_calibration_call refuses it
    leaves = pytree.tree_leaves((args, {key: kwargs[key] for key in order}))
    names = list(program.graph_signature.user_inputs)
    return dict(zip(names, leaves, strict=False)) if len(leaves) == len(names) else {}


def carried_inputs(programs: Mapping[str, Any], calls: list[MethodCall],
                   paired: Mapping[str, Iterable[str]] | None = None,
                   ) -> dict[str, dict[str, str]]:
    """Per method, each user input carrying state (the caller's tensor, passed to every
    call) and the label of the state it is: the inputs it writes in place (as Hugging
    Face's exporter passes its caches) and the inputs of ``paired`` (method -> the inputs
    whose next value an output returns).

    The calls thread such state as deployment does: the caller passes one tensor, the
    method writes it (or returns its next value, :class:`PairedState`). Inputs that are
    given one tensor object (in any call, of any method) are one state, labelled
    ``"input <name>"`` by the first method's input name;
    :func:`passes._methods.observers.share_observers` then gives that state one grid in
    every method it flows through.
    """
    mutated = {name: [state.name for state in find_mutations(program).writers
                      if state.kind == USER_INPUT] for name, program in programs.items()}
    for name, inputs in (paired or {}).items():
        mutated[name] = list(dict.fromkeys([*mutated[name], *inputs]))
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(key: tuple[str, str]) -> tuple[str, str]:
        while parent[key] != key:
            key = parent[key]
        return key

    owner: dict[int, tuple[str, str]] = {}
    for method, args, kwargs in calls:
        values = _user_input_values(programs[method], args, kwargs)
        for name in mutated[method]:
            key = (method, name)
            parent.setdefault(key, key)
            value = values.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            other = owner.setdefault(id(value), key)
            if find(other) != find(key):
                parent[find(key)] = find(other)
    return {method: {name: f"input {find((method, name))[1]}" for name in names}
            for method, names in mutated.items() if names}


class PairedState:
    """State carried as input/output pairs, threaded through calibration calls as
    deployment threads it: each call passing the same tensor for a paired input is given
    the output the previous call returned for it (the caller's tensors are not written).

    ``pairs``: per method, ``{flat input: flat output}``.
    """

    def __init__(self, programs: Mapping[str, Any], pairs: Mapping[str, Mapping[int, int]]):
        self.programs, self.pairs = programs, pairs
        self._values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _flat(self, method: str, args: tuple, kwargs: dict) -> tuple[list, Any]:
        program = self.programs[method]
        args, kwargs = keywords_bound(signature_of(program).positional, args, kwargs)
        order = list(program.call_spec.in_spec.children()[1].context or ())
        if set(kwargs) - set(order):
            return [], None  # not a call of this program: left for it to refuse
        ordered = {key: kwargs[key] for key in order if key in kwargs}
        return pytree.tree_flatten((args, ordered))

    def inputs(self, method: str, args: tuple, kwargs: dict) -> tuple[tuple, dict, dict]:
        """The call's ``(args, kwargs)`` with each paired input given its state, and the
        caller's tensors given for them (flat input -> tensor)."""
        pairs = self.pairs.get(method)
        if not pairs:
            return args, kwargs, {}
        leaves, spec = self._flat(method, args, kwargs)
        if spec is None:
            return args, kwargs, {}
        given = {i: leaves[i] for i in pairs if i < len(leaves)}
        for i, tensor in given.items():
            if isinstance(tensor, torch.Tensor) and id(tensor) in self._values:
                leaves[i] = self._values[id(tensor)][1]
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return new_args, new_kwargs, given

    def returned(self, method: str, given: Mapping[int, Any], result: Any) -> None:
        """Keep each paired output of the call as its input's state."""
        outputs = pytree.tree_leaves(result)
        for i, j in self.pairs.get(method, {}).items():
            tensor = given.get(i)
            if isinstance(tensor, torch.Tensor) and j < len(outputs):
                self._values[id(tensor)] = (tensor, outputs[j].detach().clone())


def check_write_backs(prepared: Mapping[str, Any], carried: Mapping[str, Mapping[str, str]],
                      ) -> None:
    """Raise :class:`InputStateError` for an input a method writes in place whose prepared
    graph module does not write it back into the caller's tensor: calibrating it would
    not thread the state from call to call as deployment does."""
    for method, inputs in carried.items():
        graph = prepared[method].graph
        written = {node.meta.get(MUTABLE_INPUT_META) for writer in graph.nodes
                   for node in written_nodes(writer) if node.op == "placeholder"}
        for name in inputs:
            if name not in written:
                raise InputStateError(
                    "quantize_methods", method, name, "the method writes this input in "
                    "place but its prepared graph module does not write the caller's tensor "
                    "back, so calibration cannot carry the state from call to call")


def mark_state_of_other_methods(model: Any, state: set[str]) -> list[str]:
    """Mark, as MarkMutableBuffers marks what a program writes, each buffer of ``state``
    (written by another method) that ``model`` only reads; returns their FQNs. Unmarked,
    such a read is a constant to this method: its observer is not the buffer's shared one,
    calibration runs it on a tensor of its own, and convert_pt2e folds its quantized read
    into a ``_frozen_param`` that UnfreezeMutableBuffer does not look at, so the method
    reads the initial value forever."""
    marked = []
    for node, fqn in buffer_nodes(model).items():
        if fqn in state and MUTABLE_BUFFER_META not in node.meta:
            node.meta[MUTABLE_BUFFER_META] = fqn
            node.meta[INITIAL_META] = initial_copy(buffer_tensor(model, fqn))
            marked.append(fqn)
    return sorted(set(marked))


@contextmanager
def reads_kept_live(model: GraphModule, buffers: frozenset[str]
                    ) -> Iterator[Callable[[GraphModule], GraphModule]]:
    """Within the block, torchao's constant folding keeps every read of ``buffers`` (state
    ``model`` only reads) and of the parameters ``model`` writes live: it folds what it
    computes from a buffer unless it sees the buffer written by a ``copy_``, so each of
    ``buffers`` gets a ``copy_(buffer, buffer)`` (a write of nothing new) that the block's
    end erases. A folded read could not be unfrozen after: the buffer's node goes with it,
    and a read through a conversion (a bool mask's ``.float()``) replays no view.

    Its folding tells state from constants by ``named_buffers`` alone, and runs an op to
    see whether it folds: an update of a written parameter that the quantizer left
    unannotated (``neg_``, any op of a float64 model) would be folded, its ``copy_`` run on
    the parameter itself (a step of state taken at convert time, or torch's leaf-variable
    error for a parameter that requires grad). So within the block each written parameter
    is a buffer (a plain tensor on its storage: a new GraphModule would make a Parameter a
    parameter again). The block gets a function that gives them back as the parameters
    they were in the model convert returns; the block's end gives them back in ``model``.
    """
    graph = model.graph
    added = []
    if buffers:
        nodes = {fqn: node for node, fqn in reversed(buffer_nodes(model).items())}
        with graph.inserting_before(graph.output_node()):
            for fqn in sorted(buffers):
                if fqn in nodes:
                    added.append(graph.call_function(torch.ops.aten.copy_.default,
                                                     (nodes[fqn], nodes[fqn])))
    held = {fqn: buffer_tensor(model, fqn) for fqn, info in mutable_buffers(model).items()
            if info.kind == PARAMETER}

    def give_back(converted: GraphModule) -> GraphModule:
        for fqn, parameter in held.items():
            path, _, leaf = fqn.rpartition(".")
            owner = converted.get_submodule(path)
            if leaf in owner._buffers:
                del owner._buffers[leaf]
                owner._parameters[leaf] = parameter
        return converted

    for fqn, parameter in held.items():
        path, _, leaf = fqn.rpartition(".")
        owner = model.get_submodule(path)
        del owner._parameters[leaf]
        owner._buffers[leaf] = parameter.detach()
    try:
        yield give_back
    finally:
        give_back(model)
        for node in added:
            if node.graph is graph:
                graph.erase_node(node)


def share_buffer_tensors(programs: Mapping[str, Any]) -> dict[str, list[str]]:
    """Make each mutable buffer one tensor object in every method holding it (the first
    method's), so that running the methods in turn runs them on one state; returns, per
    buffer, the methods sharing it. The methods must already agree on its shape, dtype and
    value (``passes.check_shared_buffers``).

    A method that only reads a buffer another method writes holds it too: its own copy
    would stay at the initial value, so each of its calls would read stale state."""
    written = written_by_any_method(programs)
    shared: dict[str, list[str]] = {}
    first: dict[str, torch.Tensor] = {}
    for name, program in programs.items():
        mutable = {fqn for fqn, info in mutable_buffers(program).items() if info.kind == BUFFER}
        for fqn in [*mutable, *(written.intersection(held_buffers(program)) - mutable)]:
            shared.setdefault(fqn, []).append(name)
            tensor = buffer_tensor(program, fqn)
            if fqn not in first:
                first[fqn] = tensor
            elif tensor is not first[fqn]:
                replace_buffer_tensor(program, fqn, first[fqn])
    return {fqn: names for fqn, names in shared.items() if len(names) > 1}


class QuantizedMethods(dict):
    """The quantized methods by name (a plain ``dict`` of ExportedPrograms, in the order
    given, ready for ``to_edge_transform_and_lower``), sharing their buffer tensors.

    Attributes:
        reports: per method, the run report of each stage: ``"transform"`` and
            ``"after_annotate"`` (the PassQuantizer pipelines), ``"unfreeze"``
            (UnfreezeMutableBuffer after convert_pt2e) and, with ``quantize_state=True``,
            ``"quantize_state"`` (QuantizeMutableBuffers).
        shared_buffers: per buffer more than one method holds, those methods.
        observers: per shared buffer, and per shared input state (``"input <name>"``),
            how many observer instances (over all methods) were made its one observer.
        shared_inputs: per state carried in inputs the methods write in place and given
            one tensor (``"input <name>"``, see :func:`carried_inputs`), the methods it
            flows through, by method: ``{label: {method: input name}}``.
        non_finite_reads: one line per quantized value that held inf, NaN or a value at
            +-65504 or beyond during the calls, or whose grid the calls stretched over two
            far clusters (``"method 'decode': 'add' held -inf at calls[1]"``), as
            :attr:`passes.quantization.QuantizationReport.non_finite_reads` records them.
    """

    def __init__(self, programs: Mapping[str, Any], reports: dict[str, dict[str, Report]],
                 shared_buffers: dict[str, list[str]], observers: dict[str, int],
                 shared_inputs: dict[str, dict[str, str]] | None = None,
                 non_finite_reads: list[str] | None = None):
        super().__init__(programs)
        self.reports = reports
        self.shared_buffers = shared_buffers
        self.observers = observers
        self.shared_inputs = shared_inputs or {}
        self.non_finite_reads = non_finite_reads or []

    def __repr__(self) -> str:
        inputs = f"; shared input state: {', '.join(self.shared_inputs)}" \
            if self.shared_inputs else ""
        return (f"QuantizedMethods({', '.join(self)}; shared buffers: "
                f"{', '.join(self.shared_buffers) or 'none'}{inputs})")
