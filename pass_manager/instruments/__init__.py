"""Instruments: hooks around every pass and run of the core loop, one module per idea
(replaying a :mod:`.reproducer` is :mod:`pass_manager.replay`)."""

from .base import ClaimCheck, Instrumentation, Timing, check_instrument
from .print_ir import PrintDiff, PrintIR
from .reproducer import Reproducer
from .semantic_validation import SemanticValidation

__all__ = [
    "ClaimCheck",
    "Instrumentation",
    "PrintDiff",
    "PrintIR",
    "Reproducer",
    "SemanticValidation",
    "Timing",
    "check_instrument",
]
