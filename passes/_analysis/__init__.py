"""Analyses every pass shares (private): a program's state and its writes, what each op's
schema says, storage aliasing, data movement, frozen and recorded buffer reads, and the
buffer conditions built on them."""
