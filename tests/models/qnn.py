"""ExecuTorch's Qualcomm quantizer, as a QNN deployment quantizes (no QNN SDK needed).

``QnnQuantizer`` annotates every op it knows (data movement, norms and softmax included)
with 8-bit activations and weights by default, observed by moving-average observers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["qnn_quantizer"]


def qnn_quantizer(quant_dtype: str | None = None, per_channel: bool = False) -> Any:
    """``QnnQuantizer()`` with its default configuration, or with ``quant_dtype`` (a
    ``QuantDtype`` name such as ``"use_16a8w"``: 16-bit activations, stored as int32 over
    [0, 65535]) and per-channel linear weights if ``per_channel``."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype

    quantizer = QnnQuantizer()
    if quant_dtype is not None or per_channel:
        quantizer.set_default_quant_config(QuantDtype[quant_dtype or "use_8a8w"],
                                           is_linear_per_channel=per_channel)
    return quantizer
