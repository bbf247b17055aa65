"""The errors the passes raise, for users to catch.

Each derives from :class:`pass_manager.PassManagerError`; a pass that raises one leaves the
program exactly as it was.
"""

from __future__ import annotations

from torch.fx import Node

from pass_manager import PassManagerError

__all__ = [
    "AmbiguousFrozenBufferError",
    "LiftError",
    "QuantizationFlowError",
    "QuantizationInputError",
    "QuantizedStateError",
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
            (written state sharing its storage with other state the program reads).
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
    """QuantizeMutableBuffers met a graph it cannot read: a malformed quantize/dequantize
    node, or a buffer whose recorded grid disagrees with its tensor. Nothing was rewritten.

    Attributes:
        node: the name of the node (or buffer) at fault.
        reason: what is wrong with it.
    """

    def __init__(self, node: str, reason: str):
        self.reason = reason
        super().__init__(f"{reason}; the program was left unchanged",
                         pass_name="QuantizeMutableBuffers", node=node)


class QuantizationInputError(PassManagerError, ValueError, TypeError):
    """:func:`~passes.quantization.quantize_program` or
    :func:`~passes.quantization.quantize_methods` was given what it cannot take (not an
    ExportedProgram, no calibration call, a call naming no method, a method never called),
    found before anything is prepared. A ``ValueError`` and a ``TypeError`` too, like a
    call with the wrong arguments.

    Attributes:
        helper: the function called.
        argument: the argument at fault, e.g. ``"calls[2]"``.
        reason: what is wrong and what to pass instead.
    """

    def __init__(self, helper: str, argument: str, reason: str):
        self.helper = helper
        self.argument = argument
        self.reason = reason
        super().__init__(f"{helper}: {argument}: {reason}")
