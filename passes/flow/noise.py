"""The known-harmless warnings of torch, torchao and ExecuTorch, held out of the main job's
output and shown on request (``--show-warnings``).

Each is named here with why it is harmless for this job; anything else still shows, as one
line. Held lines are kept (:func:`held`) so ``--show-warnings`` prints them after the
report, and a user who doubts a result can see everything the libraries said.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["KNOWN", "held", "hold_known_noise", "native_stderr_held"]


@dataclass(frozen=True)
class Known:
    pattern: str
    why: str


KNOWN = (
    Known(r"Failed to load .*_C_(mxfp8|cutlass)",
          "torchao's optional CUDA kernels, absent on a CPU-only machine"),
    Known(r"is an Enum subclass and is now natively supported",
          "torchao registers an enum with torch's pytree the older way (at import)"),
    Known(r"isinstance\(treespec, LeafSpec\)",
          "torch deprecates a pytree check its own deepcopy and ExecuTorch still use"),
    Known(r"Mutation on a buffer in the model is detected",
          "ExecuTorch's emitter warns before it sees InitializedMutableBufferPass, which the "
          "job runs"),
    Known(r"has not been tested with coremltools",
          "coremltools names the newest torch it was tested with; lowering is checked here"),
    Known(r"cpuinfo_utils|Failed to (load|parse) .*cpu",
          "ExecuTorch's native CPU probe on a virtual machine"),
    Known(r"XNNPACKQuantizer is deprecated", "torchao's copy of the XNNPACK quantizer"),
)
_PATTERN = re.compile("|".join(f"(?:{k.pattern})" for k in KNOWN))
_held: list[str] = []
_installed: list[bool] = []


def _is_known(text: str) -> bool:
    return _PATTERN.search(text) is not None


def held() -> list[str]:
    """Every known-harmless line held so far, in order."""
    return list(_held)


class _HoldKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if _is_known(text):
            _held.append(f"{record.name}: {text}")
            return False
        return True


def hold_known_noise() -> None:
    """Hold the known lines from now on: torch's and torchao's loggers, Python warnings.

    Call it before torchao is first imported: its kernel-loading lines come at import.
    """
    for name in ("torchao", "torch.utils._pytree", "torch", "executorch", "coremltools"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HoldKnown) for f in logger.filters):
            logger.addFilter(_HoldKnown())
    if _installed:
        return
    _installed.append(True)

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if _is_known(text):
            _held.append(f"{category.__name__}: {text}")
            return
        print(f"warning: {category.__name__}: {text.splitlines()[0] if text else ''}",
              file=sys.stderr)

    warnings.showwarning = showwarning


@contextlib.contextmanager
def native_stderr_held() -> Iterator[None]:
    """Hold the known lines native code (ExecuTorch's runtime) writes to file descriptor 2;
    the rest is written back to stderr when the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for raw in sink.read().decode(errors="replace").splitlines():
                if _is_known(raw):
                    _held.append(f"native: {raw}")
                elif raw.strip():
                    print(raw, file=sys.stderr)
