"""Loop steps: tiling, unrolling, interchange, splits, fusion and hoisting, the parallel and
GPU mappings, and the closing steps (reductions lowered, layout, SIMD marks)."""
