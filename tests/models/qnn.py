"""ExecuTorch's Qualcomm quantizer, as a QNN deployment quantizes (no QNN SDK needed).

``QnnQuantizer`` annotates every op it knows (data movement, norms and softmax included)
with 8-bit activations and weights by default, observed by moving-average observers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["qnn_quantizer"]


def qnn_quantizer() -> Any:
    """``QnnQuantizer()`` with its default configuration."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer

    return QnnQuantizer()
