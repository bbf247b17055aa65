"""The errors the quantization passes raise, for users to catch.

Both derive from :class:`pass_manager.PassManagerError`; a pass that raises one leaves the
program exactly as it was.
"""

from __future__ import annotations

from pass_manager import PassManagerError

__all__ = ["AmbiguousFrozenBufferError", "QuantizationFlowError"]


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
