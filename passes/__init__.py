"""Passes that keep mutable buffers (KV caches, counters, accumulators) correct through
torch.export, pt2e quantization and delegation.
"""

__all__: list[str] = []
