"""Lifting (private): a graph module back into the ExportedProgram export would give, without
a trace. :func:`exported_program_from` is re-exported by :mod:`passes`."""

from .lift import exported_program_from

__all__ = ["exported_program_from"]
