"""The inputs of the runtime helpers' calls: flattened by the program's own call spec, checked
before anything is lowered, and the state a program carries through its inputs threaded from
one call to the next.

ExecuTorch's runtime takes a method's inputs flat and positional: the leaves of ``(args,
kwargs)`` in the order the program was exported with (``ExportedProgram.call_spec.in_spec``).
A step may be written as the program is called in Python (an argument tuple or an ``(args,
kwargs)`` pair, the Hugging Face form) or already flat (the runtime's form); both become the
flat list here, checked input by input (count, names, dtype, and the shape against the
program's static and dynamic dimensions, by torch's own input check), so that a step that
cannot run is reported, naming the step and the input, before a lowering of seconds.

A program that mutates a user input in place (``USER_INPUT_MUTATION``: transformers' own
exporter passes its KV caches so) runs on ExecuTorch 1.5.1's runtime as follows: the method
copies the input into its own memory, writes it there, and returns the new value as an extra
output, ahead of the program's outputs; the tensor the caller passed is left as it was.
Python eager instead writes the caller's tensor, so a later call given the same tensor sees
the new value. :class:`CarriedState` gives the runtime eager's behaviour: it keeps, for every
caller tensor a call wrote, the value the runtime returned, and feeds that value the next time
a step passes the same tensor (never touching the caller's tensor). State carried as an
input/output pair (the program returns the input's next value; :mod:`passes._carried.pairs`
resolves which) is threaded the same way: the paired output's value goes to the next step
passing the same tensor for that input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from pass_manager.call_signature import describe_inputs, signature_of
from pass_manager.validation import as_call

from . import ExecuTorchInputError

__all__ = [
    "CarriedState", "aliased_outputs", "carried_outputs", "flat_inputs", "user_input_names",
]


def user_input_names(program: ExportedProgram) -> list[str]:
    """The names of ``program``'s user inputs, in the flat order the runtime takes them."""
    return [s.arg.name for s in program.graph_signature.input_specs
            if s.kind == InputKind.USER_INPUT]


def _user_placeholders(program: ExportedProgram) -> list[torch.fx.Node]:
    placeholders = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
    return [placeholders[name] for name in user_input_names(program)]


def _declared(value: torch.Tensor) -> str:
    """An exported input's shape, a dynamic size by its symbol: ``[1, s0, 32]``."""
    return "[" + ", ".join(str(s) for s in value.shape) + "]"


def _name(path: tuple, positional: Sequence[str]) -> str:
    """A leaf's path in ``(args, kwargs)`` as the user wrote it: ``cache``, ``kv[0]``."""
    top, key, *rest = path
    if top.idx == 0:
        head = positional[key.idx] if key.idx < len(positional) else f"args[{key.idx}]"
    else:
        head = str(key.key)
    return head + pytree.keystr(tuple(rest))


def _is_flat_form(program: ExportedProgram, args: tuple, kwargs: Mapping) -> bool:
    """Whether the step gives the program's user inputs flat, one positional value each."""
    return (not kwargs and len(args) == len(user_input_names(program))
            and all(pytree.tree_structure(a).is_leaf() for a in args))


def flat_inputs(helper: str, where: str, program: ExportedProgram | None,
                step: Any) -> list[Any]:
    """``step`` as the flat positional list the runtime takes, checked against ``program``.

    ``step`` is an argument tuple, an ``(args, kwargs)`` pair or a keyword mapping, as the
    program is called in Python, or the program's user inputs already flat. ``program`` is
    the exported program the method was lowered from; None for a ``.pte`` alone, which
    takes positional inputs only. The leaves are the caller's own objects (not copies).

    Raises:
        ExecuTorchInputError: naming ``helper`` and ``where`` (e.g. ``steps[2]``): the step
            does not fit the program's inputs (count, keyword names, structure), or an input
            differs from what the program was exported for (a tensor's dtype, its number of
            dimensions, a static size, a dynamic size outside its range).
    """
    args, kwargs = as_call(step)
    if program is None:
        if kwargs:
            raise ExecuTorchInputError(
                helper, where, f"a .pte program takes its inputs flat and positional; got the "
                f"keyword argument(s) {', '.join(kwargs)}: pass the ExportedProgram (its call "
                "spec orders keyword inputs), or the inputs flat in the exported order")
        return list(args)
    signature = signature_of(program)
    names = user_input_names(program)
    reason = signature.mismatch(args, kwargs)
    if reason is None:
        with_paths = signature.leaves(args, kwargs)  # in the exported order, as torch binds
        labels = [_name(path, signature.positional) for path, _ in with_paths]
    elif _is_flat_form(program, args, kwargs):
        with_paths = [((pytree.MappingKey(name),), a) for name, a in zip(names, args, strict=True)]
        labels = list(names)
    else:
        raise ExecuTorchInputError(
            helper, where, f"{reason}; the program takes {signature} (or its {len(names)} "
            f"input(s) flat: {', '.join(names)}), {where} gives {describe_inputs(args, kwargs)}")
    placeholders = _user_placeholders(program)
    if len(with_paths) != len(placeholders):
        raise ExecuTorchInputError(
            helper, where, f"it gives {len(with_paths)} input(s) flat, the program takes "
            f"{len(placeholders)} ({', '.join(names)})")
    for label, (_, value), node in zip(labels, with_paths, placeholders, strict=True):
        wanted = node.meta.get("val")
        if isinstance(wanted, torch.Tensor) and isinstance(value, torch.Tensor) \
                and value.dtype != wanted.dtype:
            raise ExecuTorchInputError(
                helper, where, f"input {label!r} is {str(value.dtype).removeprefix('torch.')}, "
                f"the program was exported for {str(wanted.dtype).removeprefix('torch.')}")
    try:
        # torch's own check of what an exported program can be called with: tensor or not,
        # rank, static sizes, dynamic sizes within their ranges and equal where declared so.
        program._check_input_constraints(with_paths)
    except RuntimeError as e:
        differ = [f"{label!r} has shape {list(value.shape)}, the program was exported for "
                  f"{_declared(node.meta['val'])}"
                  for label, (_, value), node in zip(labels, with_paths, placeholders,
                                                     strict=True)
                  if isinstance(value, torch.Tensor)
                  and isinstance(node.meta.get("val"), torch.Tensor)
                  and list(value.shape) != list(node.meta["val"].shape)]
        raise ExecuTorchInputError(
            helper, where, f"{'; '.join(differ) or 'the inputs do not fit'} ({e})") from e
    return [value for _, value in with_paths]


def carried_outputs(program: ExportedProgram) -> dict[int, int]:
    """``{output position: input position}`` for the user inputs a lowered method writes.

    ``program`` is the method as serialized (``ExecutorchProgramManager.exported_program()``
    or the Edge program): its outputs on the runtime are its output specs without the buffer
    mutations (the runtime keeps those), so a ``USER_INPUT_MUTATION`` output is the written
    input's new value at that position.
    """
    names = user_input_names(program)
    returned = [s for s in program.graph_signature.output_specs
                if s.kind != OutputKind.BUFFER_MUTATION]
    return {position: names.index(spec.target) for position, spec in enumerate(returned)
            if spec.kind == OutputKind.USER_INPUT_MUTATION and spec.target in names}


def aliased_outputs(plan: Any) -> dict[int, int]:
    """For a ``.pte`` alone: the leading outputs of an execution plan that are one of its
    inputs' values (the runtime returns a written input so, ahead of the outputs)."""
    where = {value: position for position, value in enumerate(plan.inputs)}
    found = {}
    for position, value in enumerate(plan.outputs):
        if value not in where:
            break
        found[position] = where[value]
    return found


@dataclass
class CarriedState:
    """The caller's tensors the methods carry state in, valued as Python eager would leave
    them (an input written in place) or as the program pairs them (an input whose next value
    an output returns: :mod:`passes._carried.pairs`).

    Attributes:
        helper: the runtime helper threading it (for its errors).
        notes: what a reader of the results must know: a carried input a later step gave a
            new tensor (that step starts from the new tensor's value, as eager would).
    """

    helper: str = "decode_on_runtime"
    notes: list[str] = field(default_factory=list)
    _values: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _written: dict[str, tuple[str, int]] = field(default_factory=dict)
    _noted: set[str] = field(default_factory=set)

    def inputs(self, flat: Sequence[Any]) -> list[Any]:
        """The values to pass: a tensor an earlier call carried state in gets that state;
        every tensor is a copy (the runtime must not alias the caller's memory)."""
        return [self._values[id(a)][1].clone() if isinstance(a, torch.Tensor)
                and id(a) in self._values else
                a.clone() if isinstance(a, torch.Tensor) else a for a in flat]

    def update(self, where: str, flat: Sequence[Any], outputs: Sequence[Any],
               carried: Mapping[int, int], names: Sequence[str],
               pairs: Mapping[int, int] | None = None) -> tuple[list, dict]:
        """Record what the call ``where`` carried: the inputs it wrote (``carried``: output
        position -> input position) and the inputs whose next value it returned (``pairs``:
        input position -> position among the outputs without the written inputs); return
        those outputs, and every carried input's new value by input name.

        Raises:
            ExecuTorchInputError: one tensor given for two inputs carrying paired state
                (one state cannot hold two next values).
        """
        state = {}
        for output, position in carried.items():
            name = names[position] if position < len(names) else f"input #{position}"
            state[name] = self._record(where, name, flat[position], outputs[output].clone())
        rest = [o.clone() if isinstance(o, torch.Tensor) else o
                for i, o in enumerate(outputs) if i not in carried]
        given: dict[int, str] = {}
        for position, output in (pairs or {}).items():
            name = names[position] if position < len(names) else f"input #{position}"
            tensor = flat[position]
            if isinstance(tensor, torch.Tensor) and id(tensor) in given:
                raise ExecuTorchInputError(
                    self.helper, where, f"inputs {given[id(tensor)]!r} and {name!r} are one "
                    "tensor, but each carries state of its own (paired with its own output): "
                    "give each its own tensor")
            if isinstance(tensor, torch.Tensor):
                given[id(tensor)] = name
            state[name] = self._record(where, name, tensor, rest[output].clone())
        return rest, state

    def _record(self, where: str, name: str, given: Any, value: torch.Tensor
                ) -> torch.Tensor:
        if isinstance(given, torch.Tensor):
            earlier = self._written.get(name)
            if earlier is not None and earlier[1] != id(given) and \
                    id(given) not in self._values and name not in self._noted:
                self._noted.add(name)
                self.notes.append(
                    f"{where} gives {name!r} a new tensor, not the one {earlier[0]} "
                    "wrote: it starts from the new tensor's value (as in eager); "
                    "pass the same tensor to every call to carry the state")
            self._values[id(given)] = (given, value)
            self._written[name] = (where, id(given))
        return value
