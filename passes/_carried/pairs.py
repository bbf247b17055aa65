"""Which output of a program returns the next value of which input: state carried as an
input/output pair (static-shape backends' form: QNN's static llama, Core ML's static LLM
flows), resolved once for every piece of the library that moves, threads, calibrates or
stores such state.

The pairing is what :class:`passes.InputsToBuffers` takes, under the same names everywhere:

* ``next_values``: ``{input name: output name}``;
* ``pair_by_name``: ``(input prefix, output prefix)``: ``("past_key_values.", "present.")``
  pairs input ``past_key_values.0.key`` with output ``present.0.key`` (OpenVINO's stateful
  export's convention).

Inputs are named by placeholder (``cache_0``) or a keyword input's dotted path
(``cache.0``), outputs by their dotted path (``logits``; ``0``, ``1`` for a returned tuple):
:mod:`passes._carried.specs`.

When neither is given, :func:`suspected_pairs` says which input an output looks like the next
value of, by rules that do not fire on a program without state:

* **same name**: an output's dotted path is an input's (keyword ``cache`` in, ``{"cache":
  ...}`` out);
* **OpenVINO's names**: input ``past_key_values.<p>``, output ``present.<p>``;
* **an update of the input**: the output is the input with some of its elements written
  (``index_copy``, ``index_put``, ``slice_scatter``, ``select_scatter`` ... on the input or a
  copy of it, through quantize, dequantize and fake-quantize ops of any spelling:
  :mod:`passes._analysis.quantize_ops`) or shifted (``cat`` of a slice of the input
  with new values, as large as the input: a sliding window), of the input's shape and dtype.

An output computed arithmetically from its input (``h = a * h + b``, a counter ``n + 1``) is
not suspected: such state must be paired by name or ``next_values``. Inputs the program
writes in place are not suspected either (their new value is threaded as it is written).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from .._analysis.buffers import USER_INPUT, find_mutations, trailing_write_backs
from .._analysis.data_movement import DATA_MOVEMENT_OPS
from .._analysis.quantize_ops import is_fake_quantize, is_quantize_or_dequantize
from ..errors import StateNameError, StatePairingError, UnpairedStateError
from .specs import input_names, listed_outputs, output_names
from .view import graph_module_io

__all__ = [
    "OPENVINO_PREFIXES",
    "Pair",
    "Pairing",
    "check_pair",
    "method_pairing",
    "pairs_of",
    "resolve_pairs",
    "suspected_pairs",
]

OPENVINO_PREFIXES = ("past_key_values.", "present.")
"""The input and output prefixes OpenVINO's stateful export pairs by."""

Pairing = Mapping[str, str] | None
"""``next_values``: ``{input name: output name}``; ``{}`` says the program carries no state
as a pair; None: not said."""


@dataclass(frozen=True)
class Pair:
    """One input whose next value an output returns.

    Attributes:
        input: the input's flat position in the call (the runtime's order).
        output: the output's flat position among the program's outputs.
        input_name: the input's name (keyword path, else placeholder).
        output_name: the output's dotted path.
        why: how it was found (``"next_values"``, ``"pair_by_name"`` or a suspicion rule).
    """

    input: int
    output: int
    input_name: str
    output_name: str
    why: str = "next_values"


@dataclass
class _FlatIO:
    inputs: list[Node]
    outputs: list[Any]
    in_names: list[tuple[str, ...]]
    out_names: list[str]
    written: set[Node]


def _flat_io(program: Any) -> _FlatIO:
    """The user inputs and outputs of ``program`` flat, and their names, without copying."""
    if isinstance(program, ExportedProgram):
        # The call spec has a leaf per user input, constants included (HF's prefill takes
        # ``attention_mask={"full_attention": None}``); only tensors have a placeholder.
        leaves = [spec.arg.name for spec in program.graph_signature.input_specs
                  if spec.kind == InputKind.USER_INPUT]
        placeholders = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
        inputs = [placeholders[name] for name in leaves if name in placeholders]
        values = list(program.graph.output_node().args[0])
        outputs, written = [], set()
        by_name = {n.name: n for n in inputs}
        specs = list(program.graph_signature.output_specs)
        if len(specs) != len(values):  # serialized by to_executorch: buffer writes emitted
            specs = [spec for spec in specs if spec.kind != OutputKind.BUFFER_MUTATION]
        if len(specs) != len(values):
            raise TypeError("the graph's outputs do not follow its signature")
        for spec, value in zip(specs, values, strict=True):
            if spec.kind == OutputKind.USER_OUTPUT:
                outputs.append(value)
            elif spec.kind == OutputKind.USER_INPUT_MUTATION and spec.target in by_name:
                written.add(by_name[spec.target])
        in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
        if in_spec is None or out_spec is None:
            leaves = [n.name for n in inputs]
            in_spec = pytree.tree_structure((tuple(inputs), {}))
            out_spec = pytree.tree_structure(tuple(outputs))
    elif isinstance(program, GraphModule):
        inputs, outputs, in_spec, out_spec = graph_module_io(program)
        leaves = [n.name for n in inputs]
        written = {c.args[0] for c in trailing_write_backs(program)}
    else:
        raise TypeError(f"no call signature to pair in a {type(program).__name__}")
    # Written in place anywhere in the graph (a program not functionalized writes its
    # input with index_copy_ and no mutation output or trailing copy_ says so).
    try:
        in_place = {state.name for state in find_mutations(program).writers
                    if state.kind == USER_INPUT}
    except ValueError:  # a serialized program (emitted writes): its signature says them
        in_place = set()
    written |= {n for n in inputs if n.name in in_place}
    names = dict(zip(leaves, input_names(in_spec, leaves), strict=True))
    return _FlatIO(inputs, outputs, [names[n.name] for n in inputs],
                   output_names(out_spec), written)


def resolve_pairs(in_names: Sequence[tuple[str, ...]], out_names: Sequence[str],
                  next_values: Pairing, pair_by_name: tuple[str, str] | None,
                  where: str) -> dict[int, int]:
    """``{flat input: flat output}`` of the pairing given (``next_values`` first, then
    ``pair_by_name`` for the inputs it left).

    Raises:
        StateNameError: ``next_values`` names no input or no output (naming ``where``).
    """
    by_input = {n: i for i, names in enumerate(in_names) for n in names}
    by_output = {n: i for i, n in enumerate(out_names)}
    pairs: dict[int, int] = {}
    named: dict[int, str] = {}
    for name, out in (next_values or {}).items():
        if name not in by_input:
            raise StateNameError(where, name, "next_values names no input of the program "
                                 f"(inputs: {', '.join(sorted(by_input))})")
        if out not in by_output:
            raise StateNameError(where, out, "next_values names no output of the program "
                                 f"(outputs: {listed_outputs(out_names)})")
        i = by_input[name]
        if i in pairs and pairs[i] != by_output[out]:  # ``cache.0`` and ``cache_0``: one input
            raise StateNameError(where, name, f"next_values names one input twice, as "
                                 f"{named[i]!r} (next value {out_names[pairs[i]]!r}) and as "
                                 f"{name!r} (next value {out!r}): name it once")
        pairs[i], named[i] = by_output[out], name
    if pair_by_name is not None:
        prefix_in, prefix_out = pair_by_name
        for i, names in enumerate(in_names):
            for n in names:
                wanted = prefix_out + n[len(prefix_in):]
                if n.startswith(prefix_in) and wanted in by_output and i not in pairs:
                    pairs[i] = by_output[wanted]
    return pairs


def check_pair(where: str, node: Node, value: Any, output: str) -> None:
    """Raise :class:`StatePairingError` unless ``value`` (the output named ``output``) can be
    ``node``'s next value: a tensor of its shape and dtype."""
    have = node.meta.get("val")
    new = value.meta.get("val") if isinstance(value, Node) else None
    if not isinstance(have, torch.Tensor) or not isinstance(new, torch.Tensor):
        raise StatePairingError(where, node.name, f"the input or output {output!r} is no "
                                "tensor with a known shape (meta['val'])")
    if tuple(have.shape) != tuple(new.shape) or have.dtype != new.dtype:
        raise StatePairingError(where, node.name, f"the input is {have.dtype} "
                                f"{tuple(have.shape)} but output {output!r} is {new.dtype} "
                                f"{tuple(new.shape)}: not its next value")


_PASS_THROUGH = {torch.ops.aten.clone, torch.ops.aten.contiguous, torch.ops.aten.alias,
                 torch.ops.aten._to_copy}


def _slice_of(value: Any, node: Node) -> bool:
    return (isinstance(value, Node) and value.op == "call_function"
            and getattr(value.target, "overloadpacket", None) is torch.ops.aten.slice
            and value.args[0] is node)


def _updates(value: Any, node: Node) -> bool:
    """Whether ``value`` is ``node`` with some elements written or shifted in."""
    wrote = False
    seen = 0
    while isinstance(value, Node) and value.op == "call_function" and seen < 64:
        seen += 1
        packet = getattr(value.target, "overloadpacket", None)
        if DATA_MOVEMENT_OPS.get(packet) is not None:
            wrote = True
        elif packet is torch.ops.aten.cat and value.args and any(
                _slice_of(part, node) for part in value.args[0]):
            return True
        elif packet not in _PASS_THROUGH and not (is_quantize_or_dequantize(value)
                                                   or is_fake_quantize(value)):
            return False
        value = value.args[0] if value.args else None
    return wrote and value is node


def suspected_pairs(program: Any) -> list[Pair]:
    """The input/output pairs ``program`` carries state in, by the rules of this module,
    when no pairing is given. Nothing for a program of another form."""
    try:
        io = _flat_io(program)
    except TypeError:
        return []
    by_input = {n: i for i, names in enumerate(io.in_names) for n in names}
    found: dict[int, Pair] = {}
    prefix_in, prefix_out = OPENVINO_PREFIXES
    for j, (out_name, value) in enumerate(zip(io.out_names, io.outputs, strict=True)):
        if not isinstance(value, Node):
            continue
        candidates: list[tuple[int, str]] = []
        if out_name in by_input:
            candidates.append((by_input[out_name], "the output has the input's name"))
        if out_name.startswith(prefix_out):
            wanted = prefix_in + out_name[len(prefix_out):]
            if wanted in by_input:
                candidates.append((by_input[wanted], "OpenVINO's past_key_values./present. "
                                   "names"))
        for i, node in enumerate(io.inputs):
            if _updates(value, node):
                candidates.append((i, "the output is the input with elements written or "
                                   "shifted in"))
        for i, why in candidates:
            node = io.inputs[i]
            have, new = node.meta.get("val"), value.meta.get("val")
            if node in io.written or i in found or not isinstance(have, torch.Tensor) or \
                    not isinstance(new, torch.Tensor) or have.shape != new.shape or \
                    have.dtype != new.dtype:
                continue
            found[i] = Pair(i, j, io.in_names[i][-1], out_name, why)
            break
    return sorted(found.values(), key=lambda p: p.input)


def pairs_of(program: Any, next_values: Pairing, pair_by_name: tuple[str, str] | None,
             where: str, method: str | None = None) -> list[Pair]:
    """The pairs of ``program`` as given (checked: names, shapes and dtypes), or, when
    neither ``next_values`` nor ``pair_by_name`` is given, none, refusing a program that
    :func:`suspected_pairs` finds state in.

    Raises:
        StateNameError: the pairing names no input or output of the program.
        StatePairingError: a paired input and output differ in shape or dtype.
        UnpairedStateError: nothing given, but an output looks like an input's next value.
    """
    if next_values is None and pair_by_name is None:
        suspected = suspected_pairs(program)
        if suspected:
            pair = suspected[0]
            raise UnpairedStateError(where, pair.input_name, pair.output_name, pair.why,
                                     method=method)
        return []
    try:
        io = _flat_io(program)
    except TypeError as error:
        raise StateNameError(where, "next_values", f"the program's inputs and outputs "
                             f"cannot be named ({error}): pass the program before "
                             "lowering") from error
    pairs = resolve_pairs(io.in_names, io.out_names, next_values, pair_by_name, where)
    found = []
    for i, j in sorted(pairs.items()):
        check_pair(where, io.inputs[i], io.outputs[j], io.out_names[j])
        why = "next_values" if any(n in (next_values or {}) for n in io.in_names[i]) \
            else "pair_by_name"
        found.append(Pair(i, j, io.in_names[i][-1], io.out_names[j], why))
    return found


def method_pairing(next_values: Mapping[str, Any] | None, method: str,
                   methods: Sequence[str]) -> Pairing:
    """The ``next_values`` of ``method`` among ``methods``: ``next_values`` is one mapping
    for every method, or ``{method: mapping}`` (every key a method, every value a mapping);
    a method it leaves out has None (not said)."""
    if next_values is None:
        return None
    if next_values and all(isinstance(v, Mapping) for v in next_values.values()) and \
            set(next_values) <= set(methods):
        return next_values.get(method)
    return next_values
