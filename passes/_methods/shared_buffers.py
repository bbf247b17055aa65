"""Several methods of one model: programs that share their buffers by name.

A model deployed as several methods (a prefill of N tokens and a one-token decode) is a
mapping ``{name: program}``; ExecuTorch plans one buffer per fully-qualified name for all
of them (``share_mutable_buffers=True``), so each buffer two methods hold must be the same
buffer in both: the same shape, dtype and initial value, and each *facet* of it
(:func:`register_buffer_facet`; the quantization grid of a buffer's values is one).
:func:`shared_buffer_differences` lists what differs, :func:`check_shared_buffers` raises
:class:`~passes.errors.SharedBufferError` on the first.

:data:`SHARED_BUFFERS` is that condition as the pass manager's joint condition, registered
by ``passes``: ``PassManager.run({name: program})`` checks it before the first pass and
after the last. Buffer tensors the methods held as one object before the run are one
object again after it (a pass may give each method a new tensor, e.g. integer storage),
so calling the methods in sequence in Python shares their state as the deployed program
does; so is a written buffer a pass made in several methods under one name (state
``InputsToBuffers`` makes resident in a prefill and a decode), as the device shares it by
name; ``result.notes["reshared"]`` lists those buffers. A method that only reads a buffer
the pipeline stored as integers in the methods writing it (``QuantizeMutableBuffers``) is
made to read those integers before the check (``result.notes["integer reads"]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from pass_manager import graph_module_of
from pass_manager.program_sets import JointCondition

from .._analysis.quantized_state import plan_quantized_state
from ..errors import SharedBufferError
from .grid_facet import GRID_FACET, buffer_grids
from .integer_reads import FloatHolder, read_integer_state, restate_integer_reads

__all__ = [
    "INTEGER_STORAGE",
    "SHARED_BUFFERS",
    "BufferDifference",
    "SharedBuffers",
    "buffer_facets",
    "check_shared_buffers",
    "held_buffers",
    "new_state_groups",
    "register_buffer_facet",
    "share_again",
    "shared_buffer_differences",
    "shared_objects",
    "written_buffers",
    "written_by_any_method",
]

INTEGER_STORAGE = "integer storage"
"""The aspect of a :class:`BufferDifference` for a buffer one method stores as integers and
another writes as float."""

Describer = Callable[[Any], Mapping[str, Any]]
"""``describe(program) -> {fqn: description}``: a facet of each buffer the describer has
something to say about. Descriptions are compared with ``==`` and shown with ``str``; a
buffer a method's describer leaves out (or describes as None) has no such facet there and
is not compared on it (e.g. a method that only reads a cache has no grid of its writes)."""

_FACETS: dict[str, Describer] = {GRID_FACET: buffer_grids}


def register_buffer_facet(name: str, describe: Describer) -> None:
    """Make ``describe`` part of the condition that methods sharing a buffer agree on it.

    Registering a name again replaces its describer.

    Example:
        >>> register_buffer_facet("quantization grid", lambda program: {...})
    """
    if not callable(describe):
        raise TypeError(f"register_buffer_facet({name!r}, ...): the describer is not callable")
    _FACETS[name] = describe


def buffer_facets() -> dict[str, Describer]:
    """The registered facets, by name, in registration order."""
    return dict(_FACETS)


@dataclass(frozen=True)
class BufferDifference:
    """One way two methods disagree about a buffer they share.

    Attributes:
        buffer: its fully-qualified name.
        methods: the two methods, the reference (first holding it) first.
        aspect: ``"shape"``, ``"dtype"``, ``"initial value"`` or a facet's name.
        difference: what differs, in words (both values, each with its method).
    """

    buffer: str
    methods: tuple[str, str]
    aspect: str
    difference: str

    def __str__(self) -> str:
        first, second = self.methods
        return (f"buffer {self.buffer!r}: methods {first!r} and {second!r} differ in "
                f"{self.aspect}: {self.difference}")


def held_buffers(program: Any) -> dict[str, torch.Tensor]:
    """Every buffer of ``program`` by fully-qualified name."""
    if isinstance(program, ExportedProgram):
        found = {}
        for fqn in program.graph_signature.buffers:
            tensor = program.state_dict.get(fqn, program.constants.get(fqn))
            if isinstance(tensor, torch.Tensor):
                found[fqn] = tensor
        return found
    return dict(graph_module_of(program).named_buffers(remove_duplicate=False))


def written_buffers(program: Any) -> set[str]:
    """The buffers ``program`` writes: its signature's buffer mutations, and any buffer an
    in-place op writes (directly or through a view) in a graph that still mutates."""
    gm = graph_module_of(program)
    if isinstance(program, ExportedProgram):
        signature = program.graph_signature
        written = set(signature.buffers_to_mutate.values())
        names = dict(signature.inputs_to_buffers)
        roots = {node: names[node.name] for node in gm.graph.find_nodes(op="placeholder")
                 if node.name in names}
    else:
        written = set()
        buffers = {fqn for fqn, _ in gm.named_buffers(remove_duplicate=False)}
        roots = {node: str(node.target) for node in gm.graph.find_nodes(op="get_attr")
                 if str(node.target) in buffers}
    for node in gm.graph.nodes:  # topological: a view's root is known before its users
        if node.op == "call_method" and node.args and node.args[0] in roots:
            name = str(node.target)  # a traced tensor method: in place by torch's naming
            if name.endswith("_") and not name.startswith("__"):
                written.add(roots[node.args[0]])
            continue
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args, strict=False):
            alias = argument.alias_info
            if alias is None or not isinstance(value, torch.fx.Node) or value not in roots:
                continue
            if alias.is_write:
                written.add(roots[value])
            elif node not in roots:  # a view of the buffer: writes through it write it
                roots[node] = roots[value]
    return written


def written_by_any_method(programs: Mapping[str, Any]) -> set[str]:
    """The buffers some method writes: state in every method holding one, a method that
    only reads it included (alone, that method would take it for a constant)."""
    return set().union(*(written_buffers(program) for program in programs.values()))


def _set_buffer_tensor(program: Any, fqn: str, tensor: torch.Tensor) -> None:
    if isinstance(program, ExportedProgram):
        held = program.state_dict if fqn in program.state_dict else program.constants
        held[fqn] = tensor
        return
    *path, leaf = fqn.split(".")
    owner = graph_module_of(program)
    for part in path:
        owner = getattr(owner, part)
    owner._buffers[leaf] = tensor


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _value_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when ``a`` and ``b`` hold the same bits, else how they differ."""
    if a is b or a.device.type == "meta" or b.device.type == "meta":
        return None
    a, b = a.detach(), b.detach()
    if a.is_floating_point() and a.element_size() in _BITS:
        bits = _BITS[a.element_size()]
        differs = a.contiguous().view(bits) != b.contiguous().view(bits)
    else:
        differs = a != b
    count = int(differs.sum())
    if count == 0:
        return None
    where = tuple(int(i) for i in differs.nonzero()[0])
    text = (f"{count} of {a.numel()} elements differ, the first at {list(where)}: "
            f"{a[where].item()!r} vs {b[where].item()!r}")
    if a.is_floating_point():
        text += f" (max |difference| {float((a.float() - b.float()).abs().max()):.6g})"
    return text


def shared_buffer_differences(programs: Mapping[str, Any]) -> list[BufferDifference]:
    """Every way the methods disagree about a buffer more than one of them holds and at
    least one of them writes (the state a device shares between methods).

    Each method is compared with the first method holding the buffer: shape, dtype, the
    value it holds now (a freshly exported or reset program's initial value, bit for bit);
    then on each registered facet with the first method that has it.
    """
    tensors = {name: held_buffers(program) for name, program in programs.items()}
    holders: dict[str, list[str]] = {}
    for name, held in tensors.items():
        for fqn in held:
            holders.setdefault(fqn, []).append(name)
    # A buffer no method writes is a constant of each method (torchao's constant folding
    # registers its folds as buffers named _tensor_constant_N, one set per method): on a
    # device each method keeps its own, so only written buffers are shared state.
    written = written_by_any_method(programs)
    shared = {fqn: names for fqn, names in holders.items() if len(names) > 1 and fqn in written}
    if not shared:
        return []
    facets = {facet: {name: dict(describe(programs[name])) for name in programs}
              for facet, describe in _FACETS.items()}
    found = []
    for fqn, names in shared.items():
        first = names[0]
        a = tensors[first][fqn]
        for other in names[1:]:
            b = tensors[other][fqn]
            pair = (first, other)
            if tuple(a.shape) != tuple(b.shape):
                found.append(BufferDifference(fqn, pair, "shape", f"{tuple(a.shape)} in "
                                              f"{first!r}, {tuple(b.shape)} in {other!r}"))
                continue
            if a.dtype != b.dtype:
                found.append(BufferDifference(fqn, pair, "dtype",
                                              f"{a.dtype} in {first!r}, {b.dtype} in {other!r}"))
                continue
            value = _value_difference(a, b)
            if value is not None:
                found.append(BufferDifference(fqn, pair, "initial value", value))
        for facet, described in facets.items():
            # Against the first method that has the facet: a method without one (a reset
            # writing zeros has no grid) says nothing about the others.
            having = [name for name in names if described[name].get(fqn) is not None]
            for other in having[1:]:
                this, that = described[having[0]][fqn], described[other][fqn]
                if this != that:
                    found.append(BufferDifference(
                        fqn, (having[0], other), facet,
                        f"{this} in {having[0]!r}, {that} in {other!r}"))
    return found


def parameter_difference(programs: Mapping[str, ExportedProgram]) -> str | None:
    """How two methods sharing state hold a parameter of one name differently, or None.

    Methods sharing a written buffer are one model's, and one model has one tensor per
    parameter name: a difference means they were exported from separate instances (each
    initialized its own way), and every call computes with weights the model never had
    together. Methods sharing no state (an encoder and a decoder in one ``.pte``) may hold
    unrelated parameters of one name."""
    written = written_by_any_method(programs)
    state = {name: set(held_buffers(program)) & written for name, program in programs.items()}
    seen: dict[str, tuple[str, torch.Tensor]] = {}
    for name, program in programs.items():
        for fqn in program.graph_signature.parameters:
            tensor = program.state_dict.get(fqn)
            if tensor is None:
                continue
            first, reference = seen.setdefault(fqn, (name, tensor))
            if first == name or not state[first] & state[name]:
                continue
            if tuple(reference.shape) != tuple(tensor.shape) or reference.dtype != tensor.dtype:
                value = (f"{tuple(reference.shape)} {reference.dtype} vs "
                         f"{tuple(tensor.shape)} {tensor.dtype}")
            else:
                value = _value_difference(reference, tensor)
            if value is not None:
                return (f"methods {first!r} and {name!r} share state but hold parameter "
                        f"{fqn!r} differently ({value}): they were exported from separate "
                        "instances of the model; export every method from one instance "
                        "(or from copy.deepcopy of it)")
    return None


def check_shared_buffers(programs: Mapping[str, Any], when: str = "") -> None:
    """Raise :class:`SharedBufferError` if the methods disagree about a shared buffer."""
    differences = shared_buffer_differences(programs)
    if differences:
        raise SharedBufferError(differences, when)


def shared_objects(programs: Mapping[str, Any]) -> dict[str, list[str]]:
    """For each buffer held as one tensor object by several methods, those methods."""
    tensors = {name: held_buffers(program) for name, program in programs.items()}
    groups: dict[str, list[str]] = {}
    for fqn in {fqn for held in tensors.values() for fqn in held}:
        holders = [name for name in programs if fqn in tensors[name]]
        first = tensors[holders[0]][fqn]
        same = [name for name in holders if tensors[name][fqn] is first]
        if len(same) > 1:
            groups[fqn] = same
    return groups


def new_state_groups(programs: Mapping[str, Any], held_before: Mapping[str, set[str]],
                     ) -> dict[str, list[str]]:
    """For each buffer some method writes that several methods hold now and some of them
    did not hold before the pipeline (``held_before``: per method, the buffers it held),
    those methods: state a pass made resident (``InputsToBuffers`` run on the mapping gives
    each method a ``cache`` of its own), which the device shares by name."""
    written = written_by_any_method(programs)
    holders: dict[str, list[str]] = {}
    for name, program in programs.items():
        for fqn in held_buffers(program):
            holders.setdefault(fqn, []).append(name)
    return {fqn: names for fqn, names in holders.items()
            if len(names) > 1 and fqn in written
            and any(fqn not in held_before.get(name, ()) for name in names)}


def share_again(programs: Mapping[str, Any], groups: Mapping[str, list[str]]) -> list[str]:
    """Make each buffer of ``groups`` one tensor object again across its methods (the
    first method's), where a pass gave the methods their own; returns those buffers.
    Only call it once the methods agree on the buffers' values."""
    reshared = []
    for fqn, names in groups.items():
        tensors = [held_buffers(programs[name]).get(fqn) for name in names]
        if any(t is None for t in tensors) or all(t is tensors[0] for t in tensors):
            continue
        for name, tensor in zip(names[1:], tensors[1:], strict=True):
            if tensor is not tensors[0]:
                _set_buffer_tensor(programs[name], fqn, tensors[0])
        reshared.append(fqn)
    return reshared


def _float_holder(programs: Mapping[str, Any], found: FloatHolder) -> BufferDifference:
    """The difference a method holding as float a buffer another stores as integers
    makes: why it cannot take the integers (for a method writing it off the grid, why its
    own QuantizeMutableBuffers kept the buffer float)."""
    head = f"{found.storing!r} stores it as integers on {found.grid.describe()}, {found.method!r}"
    if found.why is not None:
        return BufferDifference(found.buffer, (found.storing, found.method), INTEGER_STORAGE,
                                f"{head} {found.why}, so it cannot hold those integers")
    reason = next((plan.reason for plan in plan_quantized_state(programs[found.method])[0]
                   if plan.fqn == found.buffer and plan.reason), "its writes are off the grid")
    return BufferDifference(
        found.buffer, (found.storing, found.method), INTEGER_STORAGE,
        f"{head} writes it and keeps it float ({reason}), so its writes cannot go into the "
        "integers")


class SharedBuffers(JointCondition):
    """The methods agree on every buffer they share (:func:`check_shared_buffers`), and
    the buffers they held as one tensor stay one tensor (:func:`share_again`)."""

    name = "shared buffers"

    def check(self, programs: Mapping[str, Any], when: str) -> None:
        check_shared_buffers(programs, when)

    def remember(self, programs: Mapping[str, Any]
                 ) -> tuple[dict[str, list[str]], dict[str, set[str]]]:
        """The buffers held as one tensor, and each method's buffers (to tell the state a
        pass makes from what the methods held apart before)."""
        return (shared_objects(programs),
                {name: set(held_buffers(program)) for name, program in programs.items()})

    def join(self, programs: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
        """A method that only reads a buffer the pipeline stored as integers in the methods
        writing it (QuantizeMutableBuffers decides each method from its own writes) reads
        those integers too: ``notes["integer reads"]``, per method, those buffers. A method
        that writes such a buffer and kept it float (a reset writing a value off the grid),
        or that reads it or writes it only as zeros on a per-channel grid, is a
        :class:`SharedBufferError` (aspect ``"integer storage"``) naming the buffer, both
        methods and the reason: before, the first was made to read the integers, and its
        float writes were stored as integers, wrong."""
        if not all(isinstance(p, ExportedProgram) for p in programs.values()):
            return {}
        written = {name: written_buffers(program) for name, program in programs.items()}
        read, holders = read_integer_state(programs, written)
        if holders:
            raise SharedBufferError([_float_holder(programs, found) for found in holders],
                                    "after the pipeline")
        return {"integer reads": read} if read else {}

    def amend(self, results: Mapping[str, Any], joined: Mapping[str, Any]) -> None:
        """Each method ``join`` made hold the writers' integers: its QuantizeMutableBuffers
        record says so (:func:`restate_integer_reads`). Before, only ``quantize_methods``
        and the flow restated it: a direct ``PassManager`` run left a reset's record saying
        "stays float32" and a reader's saying nothing, unmodified."""
        restate_integer_reads(results, joined.get("integer reads", {}))

    def settle(self, programs: Mapping[str, Any],
               remembered: tuple[dict[str, list[str]], dict[str, set[str]]],
               ) -> dict[str, list[str]]:
        """One tensor again for what was one, and one tensor for the state a pass made in
        several methods under one name (the check just found they agree on it)."""
        groups, held_before = remembered
        made = {fqn: names for fqn, names in new_state_groups(programs, held_before).items()
                if fqn not in groups}
        reshared = share_again(programs, groups)
        return {"reshared": reshared + [fqn for fqn in share_again(programs, made)
                                        if fqn not in reshared]}


SHARED_BUFFERS = SharedBuffers()
