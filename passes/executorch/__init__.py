"""ExecuTorch integration (the optional ``executorch`` extra): buffer ownership in
ExecuTorch's own lowering, our passes in its flow, and decoding on its runtime; several
methods of one model (a prefill and a decode) in one ``.pte`` over one shared state
(``BufferOwningPartitioner(p, methods=programs)``, :func:`run_methods_on_runtime`).

Nothing here imports ExecuTorch until a name that needs it is used, so
``import passes.executorch`` always works; without the extra, using
``BufferOwningPartitioner`` raises :class:`ExecuTorchMissingError` saying how to install it.

Example:
    >>> from passes.executorch import BufferOwningPartitioner
    >>> lowered = to_edge_transform_and_lower(ep, partitioner=[BufferOwningPartitioner(p)])
"""

from __future__ import annotations

import importlib
import shlex
from pathlib import Path
from typing import Any

from pass_manager import PassManagerError

from ..delegation.errors import BufferConsumptionError

__all__ = [
    "INSTALL_HINT",
    "BufferOwningPartitioner",
    "DelegateStateDtypeError",
    "DelegateStateWarning",
    "ExecuTorchInputError",
    "ExecuTorchMissingError",
    "NonContiguousStateError",
    "ParameterMutationOnExecuTorchError",
    "PortableKernelAbortError",
    "PortableKernelAbortWarning",
    "SharedBufferDelegationError",
    "UnfoldedQuantizeError",
    "available",
    "decode_on_runtime",
    "executorch_state",
    "planned_memory",
    "run_methods_on_runtime",
]

EXECUTORCH_VERSION = "1.5.1"


def _install_hint(checkout: Path) -> str:
    """How to install the extra where this package is: a source checkout (``checkout``, the
    folder above the package, holds setup.cfg and constraints.txt) installs its own folder
    under its pins, named absolutely so the line works from any folder; a wheel install
    (no checkout to name) installs the extra of the published distribution."""
    pin = f"executorch=={EXECUTORCH_VERSION}"
    if (checkout / "setup.cfg").is_file() and (checkout / "constraints.txt").is_file():
        constraints = shlex.quote(str(checkout / "constraints.txt"))
        return (f"pip install -c {constraints} --no-deps {pin} && pip install -c "
                f"{constraints} -e {shlex.quote(f'{checkout}[executorch]')}   (or: make -C "
                f"{shlex.quote(str(checkout))} test, which does both)")
    return f"pip install --no-deps {pin} && pip install 'mutable-buffer-passes[executorch]'"


# ExecuTorch's wheel requires ~20 packages it never imports for lowering or its runtime
# (coremltools, pandas, scikit-learn, hydra, ...) and would let pip move torch/torchao,
# so it is installed alone; the few modules it does import come from the extra.
INSTALL_HINT = _install_hint(Path(__file__).resolve().parents[2])

# Public name -> the submodule that defines it (each imports ExecuTorch at its top).
_LAZY = {
    "BufferOwningPartitioner": "partitioner",
    "executorch_state": "partitioner",
    "decode_on_runtime": "runtime",
    "planned_memory": "plan",
    "run_methods_on_runtime": "methods",
}


class ExecuTorchMissingError(PassManagerError, ImportError):
    """The optional ExecuTorch extra is not installed (or cannot be imported)."""

    def __init__(self, wanted: str, cause: BaseException):
        self.wanted = wanted
        self.cause = f"{type(cause).__name__}: {cause}"
        PassManagerError.__init__(
            self,
            f"{wanted} needs ExecuTorch {EXECUTORCH_VERSION} ({self.cause}); install it with: "
            + INSTALL_HINT,
            pass_name=wanted,
        )


class ExecuTorchInputError(PassManagerError, TypeError):
    """A helper of :mod:`passes.executorch.runtime` was given what it cannot take: a program
    of another form, inputs that do not fit it, or options that contradict it; the message
    says what to pass instead. A ``TypeError`` too, like a call with the wrong arguments.

    Attributes:
        helper: the function given it, e.g. ``"decode_on_runtime"``.
        argument: what is at fault: ``"program"``, ``"example_inputs"``, ``"partitioner"``
            or one of the steps, ``"steps[2]"``.
        reason: what is wrong and what to pass.
        node: the node at fault, when one is (an operator the runtime lacks), else None.
    """

    def __init__(self, helper: str, argument: str, reason: str, node: str | None = None):
        self.helper = helper
        self.argument = argument
        self.reason = reason
        self.node = node
        super().__init__(f"{helper}: {argument}: {reason}", pass_name=helper)


class SharedBufferDelegationError(BufferConsumptionError):
    """``BufferOwningPartitioner(..., methods=..., strict=True)``: a partition of one method
    takes a buffer that other methods of the same ``.pte`` use too.

    ExecuTorch's memory planning shares a top-level mutable buffer between the methods; a
    delegate's copy is its own, so the other methods would never see what it writes (and it
    would never see theirs).

    Attributes:
        buffer: the buffer's FQN.
        methods: the methods using it.
        partitions: the partitions of the method being lowered that take it.
    """

    def __init__(self, buffer: str, methods: list[str], partitions: list[str], reason: str):
        self.methods = list(methods)
        super().__init__(buffer, partitions, reason, "BufferOwningPartitioner")


class DelegateStateDtypeError(BufferConsumptionError):
    """``BufferOwningPartitioner``: a delegate would own a buffer stored in a dtype its
    backend cannot keep as state (Core ML keeps float state only, as fp16: an int8 cache
    from ``QuantizeMutableBuffers`` fails inside Core ML's converter otherwise, and so does
    a bfloat16 buffer: ``KeyError: torch.bfloat16``).

    Attributes:
        buffer: the buffer's FQN.
        backend: the delegate's backend id, e.g. ``"CoreMLBackend"``.
        dtype: the buffer's dtype.
        partitions: the partition that would own it.
    """

    def __init__(self, buffer: str, partition: str, backend: str, dtype: Any, accepted: str):
        self.backend = backend
        self.dtype = dtype
        if getattr(dtype, "is_floating_point", False):  # a float its converter cannot take (bf16)
            advice = (f"store it as float32 or float16 for this backend ({backend}'s "
                      f"converter takes no {dtype} value: KeyError inside it)")
        else:
            advice = ("keep it float for this backend (QuantizeMutableBuffers.for_partitioner("
                      "partitioner), or QuantizeMutableBuffers(state_owner='coreml'), stores "
                      "the rest as integers)")
        super().__init__(
            buffer, [partition],
            f"{backend} keeps {accepted} state only and it is stored as {dtype}; {advice} "
            "or lower it with a backend that leaves state at the top level (XNNPACK)",
            "BufferOwningPartitioner")


class UnfoldedQuantizeError(PassManagerError):
    """``BufferOwningPartitioner`` wrapping XNNPACK: a partition quantizes a constant
    (a weight, a bias, a constant tensor) in the graph, as ``convert_pt2e(fold_quantize=
    False)`` (``quantize_program(..., fold=False)``) leaves it. XNNPACK lowers that without
    a complaint and its runtime computes wrong values (an ``nn.Linear(8, 8)``: off by up to
    3.8 from the Python program, ExecuTorch 1.5.1), so it is refused.

    Attributes:
        node: the quantize node.
        constant: the constant it quantizes (its FQN).
        partition: the partition holding the node.
    """

    def __init__(self, node: str, constant: str, partition: str):
        self.node = node
        self.constant = constant
        self.partition = partition
        super().__init__(
            f"BufferOwningPartitioner: partition {partition!r} quantizes the constant "
            f"{constant!r} in the graph ({node}), which XNNPACK lowers into a program "
            "that computes wrong values on the runtime; convert with fold_quantize=True "
            "(quantize_program's default fold=True), which stores it quantized",
            pass_name="BufferOwningPartitioner")


def portable_kernel_abort(side: str, dtype: Any) -> str:
    """Why ExecuTorch 1.5.1's portable quantized kernel aborts on a node whose ``side``
    (``"input"``, ``"output"``, ``"scales"`` or ``"zero points"``) is of ``dtype``, and what
    to do: the words :class:`PortableKernelAbortError` and its warning share."""
    name = str(dtype).split(".")[-1]
    if side in ("input", "output"):
        return (f"its {side} is {name}: that kernel takes float32 and float16 only and aborts "
                f"the process on {name} (Unhandled {side} dtype) when the .pte runs; quantize "
                f"a float32 model, or keep the state it writes float32 (or float16), so that "
                f"no {name} value is quantized or dequantized")
    wanted = "float64" if side == "scales" else "int64"
    return (f"its {side} are {name}: that kernel takes {wanted} {side} only and aborts the "
            f"process on {name} ones when the .pte runs; give the grid's {side} as {wanted} "
            "tensors, as torchao's observers do (float64 scales, int64 zero points)")


class PortableKernelAbortError(PassManagerError):
    """A node left at the top level of a lowered program would run on an ExecuTorch 1.5.1
    portable kernel that aborts the process on its dtypes (a quantize of a bfloat16 value,
    a dequantize to bfloat16, a per-channel quantize whose scales are not float64 or whose
    zero points are not int64).

    Attributes:
        helper: the function that lowered the program, e.g. ``"decode_on_runtime"``.
        node: the node's name.
        dtype: the dtype the kernel does not take.
        method: the method holding the node (``"forward"`` for one program).
    """

    def __init__(self, helper: str, node: str, op: str, side: str, dtype: Any,
                 method: str):
        self.helper = helper
        self.node = node
        self.dtype = dtype
        self.method = method
        super().__init__(
            f"{helper}: method {method!r}: {node} ({op}) runs at the top level on ExecuTorch's "
            f"portable quantized kernel; {portable_kernel_abort(side, dtype)}",
            pass_name=helper)


class DelegateStateWarning(UserWarning):
    """``BufferOwningPartitioner``: a delegate will own a buffer whose value on the device
    is not the program's: Core ML keeps fp32 state as fp16 (``keep_precision`` keeps it
    fp32 at the top level), and zero-fills state when the model is prewarmed (a non-zero
    initial value is lost; require :data:`passes.conditions.ZeroInitialState` to refuse
    such programs).

    Attributes:
        buffer: the buffer's FQN.
        backend: the delegate's backend id.
        issue: ``"fp16"``, ``"initial value"``, or ``"fp16 compute"`` (a float buffer
            kept fp32 at the top level, by ``keep_precision``, because several methods
            share it, or for an ownership reason, is updated by a Core ML partition
            computing in fp16, which rounds its new value all the same).
    """

    # Rebuilt as ``cls(*args)`` (``warnings``, ``copy``, pytest-xdist): ``args`` are the
    # constructor's arguments, the last one the message.
    def __init__(self, buffer: str, backend: str, issue: str, message: str):
        self.buffer = buffer
        self.backend = backend
        self.issue = issue
        self.message = message
        super().__init__(buffer, backend, issue, message)

    def __str__(self) -> str:
        return self.message


class PortableKernelAbortWarning(UserWarning):
    """``BufferOwningPartitioner``: a node it leaves at the top level (no partition took it)
    would run on an ExecuTorch 1.5.1 portable kernel that aborts the process on its dtype
    (a quantize of a bfloat16 value, a dequantize to bfloat16). A warning, since a later
    partitioner in the list may still take it; the runtime helpers refuse the lowered
    program (:class:`PortableKernelAbortError`).

    Attributes:
        node: the node's name.
        dtype: the float dtype the kernel does not take.
    """

    # Rebuilt as ``cls(*args)`` (``warnings``, ``copy``, pytest-xdist).
    def __init__(self, node: str, dtype: Any, message: str):
        self.node = node
        self.dtype = dtype
        self.message = message
        super().__init__(node, dtype, message)

    def __str__(self) -> str:
        return self.message


class ParameterMutationOnExecuTorchError(PassManagerError):
    """The program writes a parameter, which ExecuTorch's runtime would not keep.

    ExecuTorch 1.5.1 serializes parameters as constants: a ``PARAMETER_MUTATION`` becomes
    one more output of the method and the parameter keeps its old value at the next call
    (with torch's own functionalization as with ours). Registering the tensor as a buffer
    makes it state the runtime keeps.

    Attributes:
        parameters: the FQNs of the written parameters.
        node: the node computing the first one's new value (None if not known).
        pass_name: the helper the caller called that refused it.
    """

    def __init__(self, parameters: list[str], node: str | None = None,
                 helper: str = "lower_to_pte"):
        self.parameters = parameters
        self.node = node
        names = ", ".join(repr(p) for p in parameters)
        super().__init__(
            f"the program writes the parameter(s) {names}; ExecuTorch's runtime would "
            "return the new value as an extra output and keep the old one, so every call "
            "after the first would be wrong. Register them as buffers "
            "(module.register_buffer) to keep them as state on the device",
            pass_name=helper,
        )


class NonContiguousStateError(PassManagerError):
    """A buffer is not contiguous and an op reading memory by strides (``as_strided``)
    reads it: lowered, the buffer is contiguous (ExecuTorch keeps state so, and fails on a
    non-persistent buffer of another layout), and that op would compute another value.

    Attributes:
        helper: the function lowering the program, e.g. ``"decode_on_runtime"``.
        method: the method reading the buffer (``"forward"`` for one program).
        buffer: the buffer's FQN.
        size: its size.
        stride: its strides.
        node: the node reading it by strides.
    """

    def __init__(self, helper: str, method: str, buffer: str, size: tuple, stride: tuple,
                 node: str, op: str):
        self.helper = helper
        self.method = method
        self.buffer = buffer
        self.size = size
        self.stride = stride
        self.node = node
        super().__init__(
            f"{helper}: method {method!r}: buffer {buffer!r} (size {size}, stride {stride}) "
            f"is not contiguous and {node} ({op}) reads its memory by strides; ExecuTorch "
            "lowers a buffer contiguous (and fails on a non-persistent one of another "
            "layout: 'Missing input spec for lifted tensor'), so that op would compute "
            "another value on the device: register it contiguous: .contiguous()",
            pass_name=helper)


def import_executorch(wanted: str) -> None:
    """Import ExecuTorch's lowering API or raise :class:`ExecuTorchMissingError`."""
    try:
        importlib.import_module("executorch.exir")
    except ImportError as e:
        raise ExecuTorchMissingError(wanted, e) from e


def available() -> bool:
    """Whether the ExecuTorch extra can be imported here."""
    try:
        import_executorch("passes.executorch")
    except ExecuTorchMissingError:
        return False
    return True


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import_executorch(name)
    module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
    value = getattr(module, name)
    globals()[name] = value
    return value
