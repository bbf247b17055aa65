"""Instruments: hooks around every pass and every run of the core loop (``running``).

One module per feature: :mod:`.base` (the hook API), :mod:`.timing`, :mod:`.claim_check`
(a pass that says "unmodified" but changed the program), :mod:`.semantic_validation`,
:mod:`.print_diff`, :mod:`.print_ir` and :mod:`.reproducer` (crash reproducers; replaying
them is :mod:`pass_manager.replay`).
"""

from .base import Instrumentation
from .claim_check import ClaimCheck
from .print_diff import PrintDiff
from .print_ir import PrintIR
from .reproducer import Reproducer
from .semantic_validation import SemanticValidation
from .timing import Timing

__all__ = [
    "ClaimCheck",
    "Instrumentation",
    "PrintDiff",
    "PrintIR",
    "Reproducer",
    "SemanticValidation",
    "Timing",
]
