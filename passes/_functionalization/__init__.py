"""The functionalization engine behind InplaceToFunctional (private: only
:mod:`passes.inplace_to_functional` imports it). :class:`~.rewrite.Rewrite` walks the
program once; the other modules are what it asks: which grad regions and metadata
mutations to rewrite first (:mod:`.grad_regions`, :mod:`.metadata_mutations`), what it
refuses (:mod:`.mutation_checks`), how a view is written back (:mod:`.view_inverse`,
:mod:`.overlapping_writes`) and which storage elements views touch (:mod:`.element_overlap`)."""
