"""Passes that keep mutable buffers (KV caches, counters, accumulators) correct through
torch.export, pt2e quantization and delegation.
"""

# isort: off
from . import _startup  # noqa: F401  (first: before torch loads; see there)
# isort: on
from pass_manager.program_sets import register_joint_condition

from . import conditions
from ._analysis.marked_state import mutable_buffers, reset_mutable_buffers
from ._lifting import exported_program_from
from ._methods.shared_buffers import (
    SHARED_BUFFERS,
    BufferDifference,
    check_shared_buffers,
    register_buffer_facet,
    shared_buffer_differences,
)
from .buffers_to_inputs import BuffersToInputs
from .consume_buffer_mutations_in_delegate import ConsumeBufferMutationsInDelegate
from .errors import (
    AmbiguousFrozenBufferError,
    CalibrationInputError,
    CarriedStateError,
    CarriedStateWarning,
    FoldedStateWriteError,
    InputStateError,
    LiftError,
    QuantizationFlowError,
    QuantizationInputError,
    QuantizedStateError,
    SharedBufferError,
    StateNameError,
    StateOwnerError,
    StatePairingError,
    StatePastEndError,
    UnpairedStateError,
    UnreplayableFrozenReadError,
    UnsupportedMutationError,
)
from .functional_variants import register_functional_variant
from .inplace_to_functional import InplaceToFunctional
from .inputs_to_buffers import InputsToBuffers
from .mark_mutable_buffers import MarkMutableBuffers
from .quantize_mutable_buffers import QuantizeMutableBuffers
from .skip_annotate_data_movement_ops import SkipAnnotateDataMovementOps
from .unfreeze_mutable_buffer import UnfreezeMutableBuffer

# PassManager.run({name: program}) checks that the methods agree on the buffers they share.
register_joint_condition(SHARED_BUFFERS)

# The one place the version is written: setup.cfg reads it (attr:), --version prints it.
__version__ = "0.1.0"

__all__: list[str] = [
    "AmbiguousFrozenBufferError",
    "BufferDifference",
    "BuffersToInputs",
    "CalibrationInputError",
    "CarriedStateError",
    "CarriedStateWarning",
    "ConsumeBufferMutationsInDelegate",
    "FoldedStateWriteError",
    "InplaceToFunctional",
    "InputStateError",
    "InputsToBuffers",
    "LiftError",
    "MarkMutableBuffers",
    "QuantizationFlowError",
    "QuantizationInputError",
    "QuantizeMutableBuffers",
    "QuantizedStateError",
    "SharedBufferError",
    "SkipAnnotateDataMovementOps",
    "StateNameError",
    "StateOwnerError",
    "StatePairingError",
    "StatePastEndError",
    "UnfreezeMutableBuffer",
    "UnpairedStateError",
    "UnreplayableFrozenReadError",
    "UnsupportedMutationError",
    "check_shared_buffers",
    "conditions",
    "exported_program_from",
    "mutable_buffers",
    "register_buffer_facet",
    "register_functional_variant",
    "reset_mutable_buffers",
    "shared_buffer_differences",
]
