"""The functionalization engine behind InplaceToFunctional (private: only
:mod:`passes.inplace_to_functional` imports it). :class:`~.rewrite.Rewrite` walks the
program once; its steps are :mod:`.start` (grad regions, metadata mutations, the scan),
:mod:`.storage_reads`, :mod:`.overlapping_writes` and :mod:`.end` (write-backs, outputs)."""
