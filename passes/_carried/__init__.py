"""Carried state (private): the engine moving state between a program's call signature
(inputs it mutates, input/output pairs) and resident mutable buffers, for
:class:`passes.InputsToBuffers` and :class:`passes.BuffersToInputs`."""
