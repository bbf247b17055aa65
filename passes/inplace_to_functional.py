"""InplaceToFunctional: replace in-place ops by functional ones, without re-tracing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pass_manager import Effects, Pass, PassResult
from pass_manager._rollback import transaction
from pass_manager.collector import collector_paused

from ._analysis.buffer_conditions import Functional, MutableBuffersMarked
from ._functionalization.rewrite import Rewrite
from .errors import UnsupportedMutationError

__all__ = ["InplaceToFunctional", "UnsupportedMutationError"]


@dataclass(frozen=True, repr=False)
class InplaceToFunctional(Pass):
    """Replace every in-place op by its functional variant and re-wire later reads.

    A write through a view is written back into its base (``slice_scatter``,
    ``select_scatter``, ``diagonal_scatter``, ``as_strided_scatter`` or the inverse view);
    a later read of any view of that base, taken before or after the write, reads the
    new value. Program state ends as ``PARAMETER_MUTATION`` / ``BUFFER_MUTATION`` /
    ``USER_INPUT_MUTATION`` outputs (ExportedProgram, ordered as ``run_decompositions({})``
    orders them) or as one trailing ``aten.copy_(state, final)`` per mutated parameter,
    buffer or input (GraphModule). Each mutation output has a value of its own: a new
    value written into several pieces of state, or also returned, is copied
    (``aten.copy(state, value)``) for each further mutation output, since torch's
    signature keys mutations by output name. A lifted constant that is a written buffer's
    very tensor (non-strict export lifts one beside the buffer when the module reaches the
    tensor through a plain object: transformers' ``StaticCache`` layers) is read and
    written as that buffer; a write to any other lifted constant is refused. No
    re-tracing: one walk over the graph, fake tensors evaluated only for new nodes.
    Like every Pass, ``call`` leaves ``recompile()`` to the PassManager (or to the caller).
    A failure leaves the program as it was, by the manager's rollback record: the one the
    PassManager takes before every pass, or, when ``call`` is called directly, the same
    record taken by ``call`` itself.

    Example (GraphModule form)::

        before:  %acc = get_attr[acc]
                 %add_ = aten.add_.Tensor(%acc, %x)
                 %mul = aten.mul.Tensor(%acc, 2)
                 return (%mul,)
        after:   %acc = get_attr[acc]
                 %add = aten.add.Tensor(%acc, %x)
                 %mul = aten.mul.Tensor(%add, 2)
                 %copy_ = aten.copy_.default(%acc, %add)
                 return (%mul,)

    Raises:
        PreconditionError: MutableBuffersMarked does not hold: a written buffer, parameter
            or input is not marked (run MarkMutableBuffers first).
        ProgramFormError: the program is neither a GraphModule nor an ExportedProgram.
        PassFailedError: run by a PassManager or called as ``pass_(program)``, in place
            of the UnsupportedMutationError below (its ``__cause__``); the program is left
            as it was.
        UnsupportedMutationError: raised by ``call`` for a mutation it cannot rewrite
            correctly, its ``kind`` saying which: a write to a lifted constant
            ("writes-constant"), an op with no known functional variant, such as an ``out=``
            reduction computing in an out tensor of another dtype, or a random op drawing into
            a tensor laid out so that eager draws other numbers than any functional form
            ("no-variant"), a
            write through a view with no write-back ("no-write-back"), a written tensor
            that may partially overlap another argument, or an operand sharing elements
            with (or being) the tensor an op writes where eager's result is not the
            functional one (matrix products, ``masked_scatter_``, custom ops, ``out=``
            reductions, pools, solves and searches given their input as out) or eager
            raises (index and scatter ops: ``b.index_copy_(0, i, b)``) ("overlap"), a
            write it cannot
            see through, such as one inside a higher-order op ("opaque"), an op failing
            on its fake values ("fake-failure"), a metadata mutation (``unsqueeze_``,
            ``resize_``, ``set_``, ...) changing the shape of program state ("relayout";
            those of intermediates and views become views or renames), a read of a
            written tensor's storage that cannot be kept ("storage"), or written state
            sharing storage elements with other state the program reads, such as a buffer
            registered as a view of another ("shared-storage"), or written state that is
            an expanded tensor ("overlap": its new value cannot be stored into it).
    """

    requires = frozenset({MutableBuffersMarked})
    provides = frozenset({Functional})
    preserves = frozenset({MutableBuffersMarked})
    effects = Effects.rewrite()  # new nodes get new meta; existing entries are replaced

    def call(self, program: Any) -> PassResult:
        # The rewrite changes the program as it goes: a failure restores it from the
        # manager's rollback record (the one the core loop holds, or, when ``call`` is
        # called directly, one the transaction takes): one transaction mechanism.
        with transaction(program, self.effects), collector_paused():
            rewrite = Rewrite(program)
            if not rewrite.has_writes:
                return PassResult(program, False)
            rewrite.run()
            rewrite.commit()
        return PassResult(program, True, rewrite.notes, rewrite.statistics)
