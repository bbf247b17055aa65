"""Several methods of one model sharing their buffers: the condition that they agree on
them (registered with the pass manager by ``passes``), and the pieces of
``quantize_methods``."""
