"""InputsToBuffers: make state a program carries through its call signature resident."""

from __future__ import annotations

import keyword
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import Node

from pass_manager import Effects, Pass, PassResult
from pass_manager.collector import collector_paused

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._analysis.buffers import USER_INPUT, state_nodes
from ._carried.pairs import check_pair, resolve_pairs, suspected_pairs
from ._carried.record import EXAMPLE_META, records_of
from ._carried.resident import Carried, make_resident
from ._carried.specs import input_names, listed_outputs, output_names
from ._carried.view import ProgramView
from .errors import CarriedStateError, StateNameError, StatePairingError

__all__ = ["InputsToBuffers", "carried_buffers"]

_NAME = "InputsToBuffers"


def carried_buffers(program: Any) -> dict[str, str]:
    """Which input (by placeholder name) or created output (``"output:<name>"``) became which
    buffer, over every InputsToBuffers run that changed ``program``."""
    found: dict[str, str] = {}
    for record in records_of(program):
        names = output_names(record.out_spec)
        for moved in record.moved:
            key = moved.input if moved.input is not None else (
                "output:" + names[moved.output_indices[0]])
            found[key] = moved.buffer
    return found


@dataclass(frozen=True, repr=False)
class InputsToBuffers(Pass):
    """Turn state carried through the call signature into resident mutable buffers.

    Three kinds of carried state become non-persistent buffers (as HF's and ExecuTorch's
    caches are), which the program then reads and writes itself:

    * an input the program mutates in place (a ``USER_INPUT_MUTATION`` output, or a
      GraphModule's trailing ``copy_(input, value)``: run MarkMutableBuffers and
      InplaceToFunctional first; this pass requires that functional form);
    * an input paired with an output that returns its next value: by ``next_values``
      (input name -> output name) or by ``pair_by_name`` (``("past_key_values.",
      "present.")`` pairs ``past_key_values.0.key`` with ``present.0.key``, as OpenVINO's
      stateful export does);
    * state the graph creates and returns (HF's prefill builds its caches from ``zeros``):
      ``created`` maps such an output to a buffer, which the program then writes instead.
      A prefill and a decode converted with the same buffer names share one resident state.

    An input is named by its placeholder (``cache_0``) or, for a keyword input, its dotted
    path (``cache.0``: leaf 0 of keyword ``cache``); an output by its dotted path
    (``logits``, ``cache.0``; ``0``, ``1`` for a returned tuple; ``""`` for a single returned
    tensor: ``next_values={"h": ""}``). ``buffers`` chooses the
    inputs and names their buffers (a sequence: named after the input); by default every
    input mutated in place or paired becomes a buffer named after its dotted path (else its
    placeholder; a part that is a Python keyword gets an underscore, ``state.def_``, as
    torch.fx cannot write ``self.state.def``). The inputs and the outputs that carried the
    state leave the call signature (pytree specs, graph signature, module call graph and
    example inputs agree). A buffer
    starts as ``initial_values[buffer]``, else the example input's value (an ExportedProgram's
    example inputs; a GraphModule's input that BuffersToInputs made: the value its buffer
    held), else zeros (a note says so). Each write keeps a value of its own, as InplaceToFunctional
    leaves them: state paired with another state's old value reads a ``clone`` of it, one
    output paired with two inputs is written into the second through ``aten.copy``.
    A buffer keeps the strides the program was traced with (exact in Python; a note says
    so when they are not contiguous, which ExecuTorch's ``to_edge`` cannot lower and
    ``passes.executorch``'s helpers lower contiguous).

    Which input became which buffer: ``passes.inputs_to_buffers.carried_buffers(result)``
    (input name, or ``"output:<name>"`` for created state -> buffer), the notes (one line
    each) and the statistics (``inputs made buffers``, ``in place``, ``paired``, ``created``).
    The result is a new program; its input is left untouched. With neither ``next_values``
    nor ``pair_by_name`` given, an input an output looks like the next value of (OpenVINO's
    names, the same path, an ``index_copy`` of it ...: the rules ``decode_on_runtime``
    refuses an unpaired program by) stays an input, and a note names it and the pairing; a
    ``pair_by_name`` that pairs no input is noted too.

    Example (GraphModule form; an input ``h`` paired with output ``1``)::

        before:  %h = placeholder[h]           after:  %h = get_attr[h]
                 %x = placeholder[x]                   %x = placeholder[x]
                 %mul = aten.mul(%h, 0.5)              %mul = aten.mul(%h, 0.5)
                 %add = aten.add(%mul, %x)             %add = aten.add(%mul, %x)
                 return (%add, %add)                   %copy_ = aten.copy_(%h, %add)
                                                       return (%add,)

    Raises:
        PreconditionError: Functional or MutableBuffersMarked does not hold (in-place
            writes left: run MarkMutableBuffers and InplaceToFunctional first).
        ProgramFormError: the program is neither a GraphModule nor an ExportedProgram.
        PassFailedError: run by a PassManager or as ``pass_(program)``, in place of the
            errors below (its ``__cause__``); the program is left as it was.
        StateNameError: an option names no input or output, or an input that is not state
            (neither mutated in place nor paired), or a buffer no state gets; names one input
            twice (its keyword path and its placeholder) with two buffers or next values; or
            is not of its documented shape (a string for ``buffers``, a list for a mapping).
        StatePairingError: an input and its next value differ in shape or dtype, or the
            program writes the input in place with another value than the paired output.
        CarriedStateError: otherwise impossible: a buffer name already taken, with a
            Python keyword as a part (``buffers={"x": "state.def"}``) or an empty one
            (``".k"``, ``"a..b"``), an initial value that is no tensor, an input that
            is one leaf of a container (a ``StaticCache``, a dataclass) whose other leaves
            stay inputs (a list, tuple or dict keeps them), a
            dynamic shape, an initial value of another shape or dtype.
    """

    buffers: Mapping[str, str] | Sequence[str] | None = None
    next_values: Mapping[str, str] | None = None
    pair_by_name: tuple[str, str] | None = None
    created: Mapping[str, str] | None = None
    initial_values: Mapping[str, torch.Tensor] | None = None

    requires = frozenset({Functional, MutableBuffersMarked})
    preserves = frozenset({Functional, MutableBuffersMarked})
    effects = Effects.rewrite(in_place=False)  # a new program; its input is left untouched

    def call(self, program: Any) -> PassResult:
        self._check_options()
        with collector_paused():
            view = ProgramView.of(program)
            carried, notes = self._plan(view)
            if not carried:
                return PassResult(program, False, notes)
            result = make_resident(view, carried, self._refuse)
        statistics: Counter[str] = Counter()
        for c in carried:
            statistics["inputs made buffers" if c.input is not None else "created"] += 1
            if c.input is not None:
                statistics["in place" if c.in_place else "paired"] += 1
            how = ("created by the graph" if c.input is None else
                   "written in place" if c.in_place else "paired with its next value")
            source = f"input {c.input.name!r}" if c.input is not None else "output"
            notes.append(f"{source} -> buffer {c.buffer!r} ({how})")
        return PassResult(result, True, notes, statistics)

    # -- planning ---------------------------------------------------------------------
    def _check_options(self) -> None:
        """Refuse options of another shape than documented before anything is read: a
        string where a sequence of names is wanted would be read letter by letter, and a
        name that is no string or a value that is no tensor would fail deep in the rewrite."""
        if isinstance(self.buffers, str):
            raise StateNameError(_NAME, self.buffers, "buffers is one string, not a sequence "
                                 "or mapping of input names (it would be read letter by "
                                 f"letter): pass [{self.buffers!r}]")
        for option in ("buffers", "next_values", "created"):
            value = getattr(self, option)
            if value is None:
                continue
            if option != "buffers" and not isinstance(value, Mapping):
                raise StateNameError(_NAME, option, f"{option} is a {type(value).__name__}, "
                                     "not a mapping of names")
            entries = value.items() if isinstance(value, Mapping) else ((n, "") for n in value)
            for key, name in entries:
                if not isinstance(key, str) or not isinstance(name, str):
                    raise StateNameError(_NAME, str(key), f"{option} maps {key!r} to "
                                         f"{name!r}: names are strings")
        if self.pair_by_name is not None and not (
                isinstance(self.pair_by_name, (tuple, list)) and len(self.pair_by_name) == 2
                and all(isinstance(p, str) for p in self.pair_by_name)):
            raise StateNameError(_NAME, "pair_by_name", f"pair_by_name is "
                                 f"{self.pair_by_name!r}, not an (input prefix, output "
                                 "prefix) pair of strings")
        if self.initial_values is not None:
            if not isinstance(self.initial_values, Mapping):
                raise CarriedStateError(_NAME, "initial_values", "initial_values is a "
                                        f"{type(self.initial_values).__name__}, not a mapping "
                                        "of buffer names to tensors")
            for buffer, value in self.initial_values.items():
                if not isinstance(value, torch.Tensor):
                    raise CarriedStateError(_NAME, str(buffer), "initial_values gives a "
                                            f"{type(value).__name__}, not a tensor")

    def _refuse(self, what: str, names: list[str]):
        def refuse(index: int, container: str, staying: list[int]) -> CarriedStateError:
            others = ", ".join(repr(names[i]) for i in staying)
            return CarriedStateError(
                _NAME, names[index], f"this {what} is one leaf of a {container} whose other "
                f"leaves ({others}) stay in the call signature, and a {container} cannot be "
                "passed without it: make those leaves state too (each written in place or "
                "paired with its next value), or none of them; a leaf that is not state "
                f"(only read) cannot leave: pass the state outside the {container}")
        return refuse

    def _plan(self, view: ProgramView) -> tuple[list[Carried], list[str]]:
        names = input_names(view.in_spec, [p.name for p in view.inputs])
        by_input_name = {n: i for i, ns in enumerate(names) for n in ns}
        outputs = output_names(view.out_spec)
        by_output_name = {n: i for i, n in enumerate(outputs)}
        notes: list[str] = []

        def input_index(name: str, option: str) -> int:
            if name not in by_input_name:
                raise StateNameError(_NAME, name, f"{option} names no input of the program "
                                     f"(inputs: {', '.join(sorted(by_input_name))})")
            return by_input_name[name]

        def output_index(name: str, option: str) -> int:
            if name not in by_output_name:
                raise StateNameError(_NAME, name, f"{option} names no output of the program "
                                     f"(outputs: {listed_outputs(outputs)})")
            return by_output_name[name]

        pairs = resolve_pairs(names, outputs, self.next_values, self.pair_by_name, _NAME)
        written = {view.inputs.index(p) for p in view.writes if p in view.inputs}
        if self.buffers is None:
            chosen = {i: _buffer_name(names[i][-1]) for i in sorted(written | set(pairs))}
        elif isinstance(self.buffers, Mapping):
            chosen, named = {}, {}
            for n, b in self.buffers.items():
                i = input_index(n, "buffers")
                if i in chosen and chosen[i] != b:  # ``cache.0`` and ``cache_0``: one input
                    raise StateNameError(_NAME, n, f"buffers names input {view.inputs[i].name!r} "
                                         f"twice, as {named[i]!r} (buffer {chosen[i]!r}) and as "
                                         f"{n!r} (buffer {b!r}): name it once")
                chosen[i], named[i] = b, n
        else:
            chosen = {input_index(n, "buffers"):
                      _buffer_name(names[input_index(n, "buffers")][-1]) for n in self.buffers}
        if self.pair_by_name is not None and not resolve_pairs(names, outputs, None,
                                                               self.pair_by_name, _NAME):
            prefix_in, prefix_out = self.pair_by_name
            notes.append(f"pair_by_name {tuple(self.pair_by_name)!r} pairs no input: no "
                         f"input named {prefix_in!r} + <path> has an output named "
                         f"{prefix_out!r} + <path> (inputs: "
                         f"{', '.join(n[-1] for n in names)}; outputs: {listed_outputs(outputs)})")
        if self.next_values is None and self.pair_by_name is None:
            # State carried as a pair is moved only when paired: say so rather than leave it
            # an input silently (the same rules decode_on_runtime and quantize_methods
            # refuse an unpaired program by).
            moved = {names[i][-1] for i in chosen}
            for pair in suspected_pairs(view.source):
                if pair.input_name not in moved:
                    notes.append(f"input {pair.input_name!r} stays an input though output "
                                 f"{pair.output_name!r} looks like its next value ({pair.why}): "
                                 f"pass next_values={{{pair.input_name!r}: "
                                 f"{pair.output_name!r}}} (or pair_by_name) to make it "
                                 "resident")
        carried = []
        for i, buffer in chosen.items():
            node = view.inputs[i]
            carried.append(self._input_state(view, node, buffer, pairs.get(i), outputs,
                                             notes))
        for out, buffer in (self.created or {}).items():
            index = output_index(out, "created")
            if index in pairs.values():
                raise StateNameError(_NAME, out, "created names an output already paired "
                                     "with an input")
            value = view.outputs[index]
            if not isinstance(value, Node) or not isinstance(value.meta.get("val"),
                                                              torch.Tensor):
                raise StateNameError(_NAME, out, "created names an output that is no tensor")
            initial = self._initial(buffer, value, None, notes)
            carried.append(Carried(buffer, None, value, (index,), False, initial))
        self._check_buffers(view, carried)
        return carried, notes

    def _input_state(self, view: ProgramView, node: Node, buffer: str, output: int | None,
                     outputs: list[str], notes: list[str]) -> Carried:
        written = view.writes.get(node)
        if written is None and output is None:
            raise StateNameError(_NAME, node.name, "buffers names an input the program neither "
                                 "mutates in place nor returns the next value of: it is not "
                                 "state (pair it with next_values or pair_by_name)")
        traced = node.meta.get("val")
        if isinstance(traced, torch.Tensor) and any(not isinstance(d, int) for d in traced.shape):
            # Said first: of a symbolic size, the functionalizer's whole copy of the written
            # value is not seen through, and the pairing was refused for another reason.
            raise CarriedStateError(_NAME, buffer, f"its shape {tuple(traced.shape)} is "
                                    "dynamic; a buffer's shape is fixed (export the state "
                                    "with a static shape)")
        value = written
        if output is not None:
            paired = view.outputs[output]
            if written is not None and not _same_value(written, paired, node):
                raise StatePairingError(_NAME, node.name, f"the program writes it in place "
                                        f"with {written.name}, but output {outputs[output]!r} "
                                        f"returns {getattr(paired, 'name', paired)}")
            if not isinstance(paired, Node):
                raise StatePairingError(_NAME, node.name, f"output {outputs[output]!r} is a "
                                        "constant, not its next value")
            check_pair(_NAME, node, paired, outputs[output])
            value = written if written is not None else paired  # the copy, when written
        example = _example_value(view, node)
        initial = self._initial(buffer, value, example, notes)
        # the buffer's read keeps the input's traced layout
        if isinstance(traced, torch.Tensor) and not traced.is_contiguous():
            notes.append(f"buffer {buffer!r} keeps the strides {tuple(traced.stride())} the "
                         "program was traced with: ExecuTorch 1.5.1 does not lower a "
                         "non-contiguous non-persistent buffer (to_edge: 'Missing input spec "
                         "for lifted tensor'); passes.executorch's decode_on_runtime and "
                         "lower_to_pte lower it contiguous, or export with a contiguous example")
        return Carried(buffer, node, value, (output,) if output is not None else (),
                       written is not None, initial)

    def _initial(self, buffer: str, value: Node, example: torch.Tensor | None,
                 notes: list[str]) -> torch.Tensor:
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise CarriedStateError(_NAME, value.name, "its value has no fake tensor "
                                    "(meta['val']): the buffer's shape is unknown")
        if any(not isinstance(s, int) for s in val.shape):
            raise CarriedStateError(_NAME, buffer, f"its shape {tuple(val.shape)} is "
                                    "dynamic; a buffer's shape is fixed")
        given = (self.initial_values or {}).get(buffer)
        if given is not None:
            if tuple(given.shape) != tuple(val.shape) or given.dtype != val.dtype:
                raise CarriedStateError(_NAME, buffer, f"initial_values gives a "
                                        f"{given.dtype} {tuple(given.shape)} tensor for a "
                                        f"{val.dtype} {tuple(val.shape)} state")
            return given.detach().clone()
        if example is not None:
            if tuple(example.shape) != tuple(val.shape) or example.dtype != val.dtype:
                raise CarriedStateError(_NAME, buffer, f"its example input is a "
                                        f"{example.dtype} {tuple(example.shape)} tensor but "
                                        f"the program takes a {val.dtype} "
                                        f"{tuple(val.shape)} one: give its initial_values")
            return example.detach().clone()
        notes.append(f"buffer {buffer!r} starts as zeros (no example input or initial value)")
        return torch.zeros(val.shape, dtype=val.dtype, device=val.device)

    def _check_buffers(self, view: ProgramView, carried: list[Carried]) -> None:
        taken = {s.name for s in state_nodes(view.gm if not view.exported else view.source
                                             ).values() if s.kind != USER_INPUT}
        taken |= set(view.constants)
        seen: set[str] = set()
        for c in carried:
            if not all(c.buffer.split(".")):
                raise CarriedStateError(_NAME, c.buffer, "a part of the buffer name is empty "
                                        "(a leading, trailing or doubled '.'): a buffer's "
                                        "path names a module per part; give another name in "
                                        "buffers")
            if _clashes(c.buffer, taken | seen) or _attribute_taken(view.gm, c.buffer):
                raise CarriedStateError(_NAME, c.buffer, "the buffer name is taken (by state "
                                        "the program has, another input, or an attribute), "
                                        "is the path of a module holding state, or lies "
                                        "under a tensor: give another name in buffers")
            if any(keyword.iskeyword(part) for part in c.buffer.split(".")):
                raise CarriedStateError(_NAME, c.buffer, "a part of the buffer name is a Python "
                                        "keyword: torch.fx writes the buffer's read as "
                                        f"self.{c.buffer}, which is no Python; give another "
                                        "name in buffers")
            seen.add(c.buffer)
        unknown = set(self.initial_values or {}) - seen
        if unknown:
            name = sorted(unknown)[0]
            raise StateNameError(_NAME, name, "initial_values names a buffer no state becomes "
                                 f"(buffers: {', '.join(sorted(seen))})")


def _buffer_name(path: str) -> str:
    """The buffer an input at dotted ``path`` becomes by default: ``path``, each part that is
    a Python keyword with an underscore appended (``state.def`` -> ``state.def_``): torch.fx
    writes a buffer's read as ``self.state.def``, which does not compile."""
    return ".".join(part + "_" if keyword.iskeyword(part) else part
                    for part in path.split("."))


def _clashes(fqn: str, taken: set[str]) -> bool:
    """Whether ``fqn`` is one of ``taken``, a module path above one (``l`` beside
    ``l.weight``: the module ``ep.module()`` builds would be replaced by the tensor), or a
    path under one (a tensor has no attributes to hold it)."""
    return any(fqn == t or t.startswith(fqn + ".") or fqn.startswith(t + ".") for t in taken)


def _attribute_taken(gm: torch.nn.Module, fqn: str) -> bool:
    owner: Any = gm
    for part in fqn.split("."):
        if isinstance(owner, torch.nn.Module) and part in owner._modules:
            owner = owner._modules[part]
        elif hasattr(owner, part):
            return True
        else:
            return False
    return True


def _same_value(written: Node, paired: Any, node: Node) -> bool:
    """Whether the value written into ``node`` in place is the paired output's: the same node
    once ops that keep every element at its index are looked through (:func:`_kept_source`).
    The functionalizer makes a whole copy to give a mutation output that is also a user output
    a value of its own (``aten.copy(node, paired)``); a program writing its state through an
    alias and returning that alias's ``copy_`` (Qwen3-Next's recurrent state:
    ``state.to(float32)``, updated, then ``copy_``) returns one (``aten.copy(alias,
    written)``); a program reading its updated cache through a cast to the dtype it already
    has (GPT-Neo's ``key.to(torch.float32)`` in fp32: eager returns the cache itself) returns
    that cast, which export records as the output; ``cache[:]``, ``cache.view_as(cache)``,
    ``cache.unsqueeze(0).squeeze(0)`` or ``cache.t().t()`` return the cache too."""
    return isinstance(paired, Node) and _kept_source(written) is _kept_source(paired)


_aten = torch.ops.aten

# Ops whose result lists their tensor argument's elements in the same (row-major) order
# whenever it has as many elements and the same dtype: reshapes and squeezes, a slice,
# narrow or select that takes every element, an expand that adds only dimensions of one,
# casts to the dtype it has, aliases and copies. ``aten.copy(dst, value)`` holds ``value``'s
# (its second argument). (``view.dtype`` reinterprets the bytes: not listed.)
_IN_ORDER = frozenset({
    _aten.to.dtype, _aten.to.dtype_layout, _aten.to.device, _aten.to.other,
    _aten._to_copy.default, _aten.type_as.default, _aten.alias.default, _aten.alias_copy.default,
    _aten.detach.default, _aten.clone.default, _aten.contiguous.default,
    _aten.lift_fresh_copy.default, _aten.copy.default,
    _aten.view.default, _aten.view_copy.default, _aten.reshape.default,
    _aten._unsafe_view.default, _aten.view_as.default, _aten.reshape_as.default,
    _aten.flatten.using_ints, _aten.unflatten.int,
    _aten.squeeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze_copy.dim,
    _aten.squeeze_copy.dims, _aten.unsqueeze.default, _aten.unsqueeze_copy.default,
    _aten.expand.default, _aten.expand_copy.default, _aten.expand_as.default,
    _aten.slice.Tensor, _aten.slice_copy.Tensor, _aten.narrow.default, _aten.select.int,
    _aten.select_copy.int,
})

# Ops that reorder their argument's dimensions, followed as a permutation: a chain of them
# composing to none (``t().t()``, ``permute(0, 1)``) keeps every element at its index.
_PERMUTING = frozenset({
    _aten.permute.default, _aten.permute_copy.default, _aten.transpose.int,
    _aten.transpose_copy.int, _aten.t.default, _aten.t_copy.default,
})


def _kept_source(node: Node) -> Node:
    """The furthest node whose elements ``node`` holds unchanged, each at the same index,
    through ops of :data:`_IN_ORDER` and :data:`_PERMUTING` (every one keeping the dtype and
    the number of elements). The chain may pass through other shapes (``flatten`` then a
    ``view`` back) and through permutations that compose to none; it stops at an op that
    reorders a permuted value's elements in memory order (a reshape of a transpose)."""
    have = node.meta.get("val")
    if not isinstance(have, torch.Tensor):
        return node
    shape, found, current = tuple(have.shape), node, node
    # order[k]: which dimension of ``current`` the k-th dimension of the value at the last
    # in-order step reads (None: the identity, elements in row-major order)
    order: tuple[int, ...] | None = None
    while current.op == "call_function" and (current.target in _IN_ORDER
                                             or current.target in _PERMUTING):
        source = current.args[1] if current.target is _aten.copy.default else current.args[0]
        value = current.meta.get("val")
        new = source.meta.get("val") if isinstance(source, Node) else None
        if not (isinstance(value, torch.Tensor) and isinstance(new, torch.Tensor)
                and value.dtype == new.dtype and _numel(value) is not None
                and _numel(value) == _numel(new)):
            break
        if current.target in _PERMUTING:
            dims = _permutation(current, new.dim())
            order = tuple(dims[k] for k in (order or range(len(dims))))
        elif order is not None and order != tuple(range(len(order))):
            break  # a reshape, a slice ... of a permuted value: another element order
        else:
            order = None
        current = source
        if (order is None or order == tuple(range(len(order)))) and tuple(new.shape) == shape:
            found = current
    return found


def _numel(value: torch.Tensor) -> int | None:
    """The number of elements of ``value``; None when a dimension is symbolic."""
    count = 1
    for size in value.shape:
        if not isinstance(size, int):
            return None
        count *= size
    return count


def _permutation(node: Node, ndim: int) -> tuple[int, ...]:
    """``dims`` of ``permute(x, dims)`` for a permuting ``node`` over ``ndim`` dimensions: the
    result's dimension k is ``x``'s ``dims[k]``."""
    dims = list(range(ndim))
    if node.target in (_aten.permute.default, _aten.permute_copy.default):
        return tuple(d % ndim for d in node.args[1])
    if node.target in (_aten.transpose.int, _aten.transpose_copy.int):
        a, b = (d % ndim for d in node.args[1:3])
    else:  # t(): 0-d and 1-d unchanged
        a, b = (0, 1) if ndim == 2 else (0, 0)
    dims[a], dims[b] = dims[b], dims[a]
    return tuple(dims)


def _example_value(view: ProgramView, node: Node) -> torch.Tensor | None:
    """The example input's value of ``node``: an ExportedProgram keeps its example inputs; a
    GraphModule keeps none, but an input BuffersToInputs made keeps the buffer's value."""
    if not view.exported:
        return node.meta.get(EXAMPLE_META)
    if view.source.example_inputs is None:
        return None
    leaves = pytree.tree_leaves(view.source.example_inputs)
    value = leaves[view.inputs.index(node)]
    return value if isinstance(value, torch.Tensor) else None
