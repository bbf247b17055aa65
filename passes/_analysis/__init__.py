"""Analyses every pass shares (private): a program's state and its writes, what each op's
schema says, storage aliasing, data movement, frozen and recorded buffer reads, the
buffer conditions built on them, which ops quantize or dequantize (every spelling), the
quantization grids values lie on (through data movement) with the state that holds only
such values, and the fake values of new nodes."""
