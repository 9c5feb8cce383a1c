"""Algebraic steps: online softmax, split keys, key blocks and tiles, causal blocks and rows,
partial sums and part buffers, scatter."""
