"""A generic, condition-checked pass manager for torch.fx programs.

Passes declare the conditions they require, provide and preserve; the manager orders
them (a networkx DAG), checks conditions before and after each pass with caching,
measures whether a pass changed the program, and rolls back a pass that fails.
This package never imports ``passes``.
"""

from .conditions import ALL_CONDITIONS, Condition
from .errors import (
    PassFailedError,
    PassManagerError,
    PipelineError,
    PostconditionError,
    PreconditionError,
    ProgramFormError,
    SemanticsError,
)
from .instrumentation import Instrumentation, PrintDiff, Timing
from .manager import PassManager, RunResult
from .pass_base import Pass, PassResult, as_pass, function_pass, known_passes
from .program import EXPORTED_PROGRAM, GRAPH_MODULE, graph_module_of, graph_of
from .report import PassRecord, Report
from .validation import assert_same_behaviour, first_difference, run_program

__all__ = [
    "ALL_CONDITIONS",
    "EXPORTED_PROGRAM",
    "GRAPH_MODULE",
    "Condition",
    "Instrumentation",
    "Pass",
    "PassFailedError",
    "PassManager",
    "PassManagerError",
    "PassRecord",
    "PassResult",
    "PipelineError",
    "PostconditionError",
    "PreconditionError",
    "PrintDiff",
    "ProgramFormError",
    "Report",
    "RunResult",
    "SemanticsError",
    "Timing",
    "as_pass",
    "assert_same_behaviour",
    "first_difference",
    "function_pass",
    "graph_module_of",
    "graph_of",
    "known_passes",
    "run_program",
]
