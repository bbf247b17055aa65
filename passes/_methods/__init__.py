"""Several methods of one model sharing their buffers: the grid facet the pass manager
compares across methods, and the pieces of ``quantize_methods``."""

from . import grid_facet  # noqa: F401  (registers the grid facet with the pass manager)
