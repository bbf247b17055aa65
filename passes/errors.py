"""The errors the passes raise, for users to catch.

Each derives from :class:`pass_manager.PassManagerError`; a pass that raises one leaves the
program exactly as it was.
"""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from pass_manager import PassManagerError

__all__ = [
    "AmbiguousFrozenBufferError",
    "CalibrationInputError",
    "CarriedStateError",
    "CarriedStateWarning",
    "FoldedStateWriteError",
    "InputStateError",
    "LiftError",
    "QuantizationFlowError",
    "QuantizationInputError",
    "QuantizedStateError",
    "SharedBufferError",
    "StateNameError",
    "StateOwnerError",
    "StatePairingError",
    "StatePastEndError",
    "UnpairedStateError",
    "UnreplayableFrozenReadError",
    "UnsupportedMutationError",
]


class QuantizationFlowError(PassManagerError):
    """The quantization flow met a graph it cannot handle correctly; nothing was rewritten."""

    def __init__(self, message: str, *, pass_name: str | None = None, node: str | None = None):
        prefix = f"{pass_name}: " if pass_name else ""
        where = f"node {node!r}: " if node else ""
        super().__init__(prefix + where + message, pass_name=pass_name)
        self.node = node


class AmbiguousFrozenBufferError(QuantizationFlowError):
    """A frozen constant matches more than one mutable buffer read; refusing to guess."""

    def __init__(self, pass_name: str, node: str, candidates: list[str]):
        super().__init__(
            "frozen constant matches several mutable buffer reads: "
            + ", ".join(candidates)
            + "; mark the buffers with MarkMutableBuffers before prepare_pt2e (and quantize "
            "with PassQuantizer) so the provenance is recorded",
            pass_name=pass_name,
            node=node,
        )
        self.candidates = candidates


class UnreplayableFrozenReadError(QuantizationFlowError):
    """A frozen constant stands for a value computed from mutable buffers through ops
    UnfreezeMutableBuffer cannot replay (several reads, or a constant beside the buffer)."""

    def __init__(self, pass_name: str, node: str, buffers: list[str], source: str):
        super().__init__(
            f"frozen constant stands for {source!r}, computed from mutable buffer(s) "
            + ", ".join(map(repr, buffers))
            + " alone, which convert_pt2e folded: the program would read their initial "
            "value forever, and the ops on the way cannot be replayed on the live value; make "
            "the program functional before prepare_pt2e (MarkMutableBuffers then "
            "InplaceToFunctional, as quantize_program does), so torchao sees the write-back "
            "and does not fold it",
            pass_name=pass_name,
            node=node,
        )
        self.buffers = buffers
        self.source = source


class FoldedStateWriteError(QuantizationFlowError):
    """``convert_pt2e``'s constant folding ran an in-place write of state once while
    converting (the write computes from buffers and constants alone: a step counter's
    ``add_(1)``), and nothing recorded the value the state had before."""

    def __init__(self, pass_name: str, node: str, buffers: list[str]):
        super().__init__(
            "convert_pt2e(fold_quantize=True) ran this in-place write of "
            + ", ".join(map(repr, buffers))
            + " once while folding constants (it reads buffers and constants alone), so "
            "the converted program starts one step ahead of the model, and the value it "
            "started with is not known: no MarkMutableBuffers mark records it; mark the "
            "program before prepare_pt2e (PassQuantizer(quantizer, "
            "transform=[MarkMutableBuffers()])) so UnfreezeMutableBuffer puts it back, or "
            "quantize a functional program (quantize_program)",
            pass_name=pass_name,
            node=node,
        )
        self.buffers = buffers


class UnsupportedMutationError(PassManagerError):
    """A mutation InplaceToFunctional cannot rewrite correctly; the program is left unchanged.

    Attributes:
        node: the name of the node at fault.
        reason: why it cannot be rewritten.
        kind: a short category: "overlap", "no-variant", "no-write-back",
            "writes-constant", "opaque", "fake-failure", "relayout" (a shape change or
            ``set_`` of program state, a ``resize_`` growing a view's or a viewed
            tensor's storage, an ``out=`` resize of state or of a viewed tensor) or
            "storage" (an op reading a written tensor's storage, such as ``as_strided``,
            whose root is not a contiguous tensor owning all of its storage, or program
            state whose strides a metadata mutation changes) or "shared-storage"
            (written state sharing storage elements with other state the program reads).
    """

    def __init__(self, node: Node, reason: str, kind: str):
        self.node = node.name
        self.reason = reason
        self.kind = kind
        # A refusal is a statistic of the failed pass (see PassManagerError.report).
        self.statistics = {f"refused: {kind}": 1}
        super().__init__(
            f"InplaceToFunctional cannot rewrite node {node.name} ({node.target}): {reason}. "
            "The program was left unchanged.",
            pass_name="InplaceToFunctional",
        )


class LiftError(PassManagerError):
    """A graph module :func:`passes.exported_program_from` cannot lift without tracing.

    Raised rather than build a program that would compute something else, or that only a
    trace could build (a call into a submodule, a write-back the signature cannot say).

    Attributes:
        node: the name of the node at fault (None when the graph as a whole is).
        reason: why it cannot be lifted.
    """

    def __init__(self, reason: str, node: str | None = None):
        self.node = node
        self.reason = reason
        where = f"node {node!r}: " if node else ""
        super().__init__(f"exported_program_from: {where}{reason}")


class QuantizedStateError(QuantizationFlowError):
    """QuantizeMutableBuffers met a graph it cannot read (a malformed quantize/dequantize
    node, a buffer whose recorded grid disagrees with its tensor), an option it cannot take
    (an unknown ``state_owner``), or, with ``strict``, a buffer or a mutated user input that
    stays float (``reason`` says why). Nothing was rewritten.

    Attributes:
        node: the name of the node (or buffer) at fault.
        reason: what is wrong with it.
    """

    def __init__(self, node: str, reason: str):
        self.reason = reason
        super().__init__(f"{reason}; the program was left unchanged",
                         pass_name="QuantizeMutableBuffers", node=node)


class StateOwnerError(QuantizedStateError):
    """QuantizeMutableBuffers (``strict``) was told a stateful delegate will own a buffer
    that could be stored as integers, in a dtype that delegate does not take (Core ML keeps
    state as float only). Nothing was rewritten.

    Attributes:
        node: the buffer's name.
        owner: the backend that will own it (``"coreml"``).
        reason: what the owner takes, and the grid the buffer's values lie on.
    """

    def __init__(self, buffer: str, owner: str, reason: str):
        self.owner = owner
        super().__init__(buffer, reason)


class CarriedStateWarning(UserWarning):
    """:func:`~passes.reset_mutable_buffers` was asked to reset state that lives in the
    caller's tensors (inputs the program mutates in place): it resets none of it.

    Attributes:
        inputs: the names of those inputs.
    """

    # ``args`` are the constructor's arguments and the message is rendered from them:
    # ``warnings``, ``copy``, pickle and pytest-xdist rebuild a warning as ``cls(*args)``.
    def __init__(self, inputs: list[str]):
        self.inputs = list(inputs)
        super().__init__(self.inputs)

    def __str__(self) -> str:
        names = ", ".join(map(repr, self.inputs))
        return (f"reset_mutable_buffers: the state of input(s) {names} lives in the caller's "
                "tensors, which it cannot reset (nothing was reset for them): pass fresh "
                "tensors on the next call, or make the state resident with "
                "passes.InputsToBuffers")


class QuantizationInputError(PassManagerError, ValueError, TypeError):
    """:func:`~passes.quantization.quantize_program` or
    :func:`~passes.quantization.quantize_methods` was given what it cannot take (not an
    ExportedProgram, no calibration call, a call naming no method, a method never called:
    found before anything is prepared; a value the quantizer observes in a dtype pt2e's
    quantize ops cannot take, such as float64 or an integer counter: found after prepare,
    before calibration).
    A ``ValueError`` and a ``TypeError`` too, like a call with the wrong arguments.

    Attributes:
        helper: the function called.
        argument: the argument at fault, e.g. ``"calls[2]"``.
        reason: what is wrong and what to pass instead.
        node: the node of the value at fault (the observed value of an unquantizable
            dtype), or None.
    """

    def __init__(self, helper: str, argument: str, reason: str, *, node: str | None = None):
        self.helper = helper
        self.argument = argument
        self.reason = reason
        self.node = node
        super().__init__(f"{helper}: {argument}: {reason}")


class CarriedStateError(PassManagerError):
    """``InputsToBuffers`` / ``BuffersToInputs`` cannot move this state between the call
    signature and resident buffers as asked; the program was left unchanged.

    Attributes:
        name: the input, output or buffer at fault, as the option named it.
        reason: why, and what to pass instead.
    """

    def __init__(self, pass_name: str, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"{pass_name}: {name!r}: {reason}; the program was left unchanged",
                         pass_name=pass_name)


class StateNameError(CarriedStateError, KeyError):
    """An option names no input, output or buffer of the program, or one that is not state
    (an input the program neither mutates nor returns the next value of). A ``KeyError`` too.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class StatePairingError(CarriedStateError):
    """An input and the output named as its next value do not pair: another shape or dtype,
    or the program writes the input in place with another value."""


class UnpairedStateError(PassManagerError, ValueError):
    """A program returns what looks like the next value of one of its inputs (state carried
    as an input/output pair), but no pairing was given: threading, calibrating or storing
    its calls without one would feed every call the same stale state. Raised by
    ``decode_on_runtime``, ``run_methods_on_runtime`` and ``quantize_methods`` (the rules:
    :mod:`passes._carried.pairs`). A ``ValueError`` too.

    Attributes:
        helper: the function that refused.
        input: the input's name.
        output: the output's name.
        why: the rule that paired them.
        method: the method (several methods), or None.
    """

    def __init__(self, helper: str, input: str, output: str, why: str,
                 method: str | None = None):
        self.helper, self.input, self.output, self.why, self.method = (
            helper, input, output, why, method)
        where = f"method {method!r}: " if method is not None else ""
        super().__init__(
            f"{helper}: {where}output {output!r} looks like the next value of input "
            f"{input!r} ({why}), and no pairing says whether it is: pass "
            f"next_values={{{input!r}: {output!r}}} (or pair_by_name=(input prefix, output "
            "prefix)) to carry it from call to call, or next_values={} to say the program "
            "carries no state so", pass_name=helper)


class CalibrationInputError(QuantizationInputError):
    """A calibration call of :func:`~passes.quantization.quantize_program` or
    :func:`~passes.quantization.quantize_methods` that the program cannot run: an input of
    another dtype or shape than the program was exported with (found before anything is
    prepared), or a call the prepared program raised on (the original error chained).

    Attributes:
        step: the index of the call in the calibration list.
        method: the method called (``quantize_methods``), or None.
        input: the input at fault, e.g. ``"input_pos"`` or ``"kwargs['cache_position']"``,
            or None when the program's error does not say.
    """

    def __init__(self, helper: str, step: int, reason: str, *, input: str | None = None,
                 method: str | None = None):
        self.step = step
        self.method = method
        self.input = input
        where = "calibration" if method is None else "calls"
        argument = f"{where}[{step}]" + (f" ({method!r})" if method else "")
        if input is not None:
            argument += f", input {input!r}"
        super().__init__(helper, argument, reason)


class InputStateError(QuantizationInputError):
    """State a method carries in an input it writes in place (the caller's tensor, as
    Hugging Face's exporter passes its caches) that :func:`~passes.quantization.quantize_methods`
    cannot calibrate along as deployment threads it: the prepared method does not write
    the caller's tensor back.

    Attributes:
        method: the method.
        input: the input's name.
    """

    def __init__(self, helper: str, method: str, input: str, reason: str):
        self.method = method
        self.input = input
        super().__init__(helper, f"programs[{method!r}], input {input!r}",
                         f"{reason}; make the state resident first (passes.InputsToBuffers "
                         "turns such inputs into buffers the methods share), then quantize")


class SharedBufferError(PassManagerError):
    """Methods of one program disagree about a buffer they share by name.

    Attributes:
        buffer: the buffer's fully-qualified name.
        methods: the methods that disagree (the reference first).
        difference: what differs, in words.
        aspect: shape, dtype, initial value or the facet's name.
        differences: every ``BufferDifference`` found (the first is the one above).
    """

    def __init__(self, differences: list[Any], when: str = ""):
        first = differences[0]
        self.buffer = first.buffer
        self.methods = list(first.methods)
        self.aspect = first.aspect
        self.difference = first.difference
        self.differences = list(differences)
        message = f"{when}: " if when else ""
        message += (
            f"the methods do not share buffer {first.buffer!r}: {first.methods[0]!r} and "
            f"{first.methods[1]!r} differ in {first.aspect}: {first.difference}. Methods of "
            "one program share each buffer by name (one buffer for all of them on a "
            "device), so each must hold it alike: "
        )
        # Methods quantized one at a time (each on its own calibration: transformers'
        # PT2EQuantizer quantizes each method it exports alone) come from one model and
        # still differ in grid; exporting them again would not help.
        if first.aspect == "quantization grid":
            message += ("quantize them together (passes.quantization.quantize_methods gives "
                        "each shared buffer one grid), not each on its own.")
        elif first.aspect == "integer storage":
            message += (f"leave the buffer float in every method "
                        f"(passes.quantization.quantize_methods(..., quantize_state=True) "
                        f"decides so for all methods at once; or run "
                        f"QuantizeMutableBuffers(keep_float={{{first.buffer!r}: why}}) on "
                        f"the mapping), or make every write of it a value of that grid.")
        else:
            message += "export them from one model."
        if len(differences) > 1:
            message += "\nAll differences:\n" + "\n".join(f"  - {d}" for d in differences)
        super().__init__(message)


class StatePastEndError(PassManagerError, IndexError):
    """A call writes state at a position the state does not have: a decode given more steps
    than its static KV cache holds. Found before anything runs, from the calls and the
    state's shape (:mod:`passes._analysis.write_bounds`), where eager would raise an
    ``IndexError`` at that call and ExecuTorch's runtime an untyped ``RuntimeError``
    (``index_put.out`` failing with error 0x12). A position wrapped into the state (a ring
    buffer) is in range.

    Attributes:
        helper: what checked the calls, e.g. ``"decode_on_runtime"`` or the model's name.
        argument: the call, ``"steps[16]"`` or ``"calls[3] ('decode')"``.
        step: its index among the calls (the calls before it fit).
        state: the buffer's fully-qualified name (or the input's name).
        dim: the dimension written along.
        position: the position written.
        length: how many positions the state holds along ``dim``.
    """

    def __init__(self, helper: str, argument: str, step: int, state: str, dim: int,
                 position: int, length: int):
        self.helper = helper
        self.argument = argument
        self.step = step
        self.state = state
        self.dim = dim
        self.position = position
        self.length = length
        super().__init__(
            f"{helper}: {argument} writes position {position} of {state!r} along dimension "
            f"{dim}, which holds {length} (positions 0 to {length - 1}): the calls go past "
            "the state's end; give fewer calls, positions within it, or a longer state",
            pass_name=helper)
