"""A generic, condition-checked pass manager for torch.fx programs.

Passes declare the conditions they require, provide and preserve; the manager orders them
(a networkx DAG), checks conditions around each pass with caching, measures whether a pass
changed the program, and rolls back a pass that fails. Everything else is an instrument.
This package never imports ``passes``.
"""

from .archive import load_program, save_program
from .conditions import ALL_CONDITIONS, Condition
from .effects import Effects
from .errors import (
    ArchiveError,
    EffectsError,
    InstrumentError,
    PassFailedError,
    PassManagerError,
    PipelineElementError,
    PipelineError,
    PostconditionError,
    PreconditionError,
    ProgramFormError,
    SemanticsError,
    UntrustedFileError,
    ValidationInputError,
)
from .instruments import (
    ClaimCheck,
    Instrumentation,
    PrintDiff,
    PrintIR,
    Reproducer,
    SemanticValidation,
    Timing,
)
from .manager import PassManager, parse_pipeline
from .pass_base import Pass, PassResult, as_pass, function_pass
from .program import EXPORTED_PROGRAM, GRAPH_MODULE, graph_module_of, graph_of
from .program_sets import JointCondition, MethodsRunResult, register_joint_condition
from .replay import load_reproducer, replay
from .report import PassRecord, Report
from .running import RunResult
from .validation import assert_same_behaviour, first_difference, run_program

__all__ = [
    "ALL_CONDITIONS",
    "EXPORTED_PROGRAM",
    "GRAPH_MODULE",
    "ArchiveError",
    "ClaimCheck",
    "Condition",
    "Effects",
    "EffectsError",
    "InstrumentError",
    "Instrumentation",
    "JointCondition",
    "MethodsRunResult",
    "Pass",
    "PassFailedError",
    "PassManager",
    "PassManagerError",
    "PassRecord",
    "PassResult",
    "PipelineElementError",
    "PipelineError",
    "PostconditionError",
    "PreconditionError",
    "PrintDiff",
    "PrintIR",
    "ProgramFormError",
    "Report",
    "Reproducer",
    "RunResult",
    "SemanticValidation",
    "SemanticsError",
    "Timing",
    "UntrustedFileError",
    "ValidationInputError",
    "as_pass",
    "assert_same_behaviour",
    "first_difference",
    "function_pass",
    "graph_module_of",
    "graph_of",
    "load_program",
    "load_reproducer",
    "parse_pipeline",
    "register_joint_condition",
    "replay",
    "run_program",
    "save_program",
]
