"""Instruments: hooks around every pass and run of the core loop, one module per feature
(replaying a :mod:`.reproducer` is :mod:`pass_manager.replay`)."""

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
