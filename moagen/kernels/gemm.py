"""A row product's GPU form: a tiled SIMT GEMM, from the mapping steps attention's flash
form uses (moagen.kernels.attention.gpu_flash).

    out[b, i, j] = sum_k A[b, i, k] B[k, j]

A thread block per block_rows x block_cols output tile (BlockTiles over rows and columns);
the sum cut into chunks of `chunk` (Split), each chunk's tiles of both operands staged in
shared memory by the whole block (Stage: A's laid out with the rows last, B's with the
columns last, so that a thread reads its register tile's mr rows and nr columns of a step
of the sum as consecutive numbers: 128-bit shared loads); each thread an mr x nr register
tile of accumulators (ThreadTiles along y over the rows, x over the columns) held over the
whole sum, its loop unrolled so that a back-edge carries 4 steps of it (UnrollInner). The
barriers between a chunk's copies and its reads are derived (moagen.steps.gpu.closing)."""
from moagen.steps.gpu.blocks import BlockTiles, ThreadTiles, UnrollInner
from moagen.steps.gpu.staging import Stage
from moagen.steps.loop.split import Split

# the steps of the sum a back-edge of its loop carries: 4 x the tile's FMA
UNROLL = 4


def gemm(label, cols, summed, operands, outer, mr, nr, block_rows, block_cols, chunk):
    """(its schedule step, its mapping steps) for the row product `label` over the loops
    outer + (i, cols), summing over `summed` (a loop: after LowerReductions) its row
    operand and its column operand (`operands`)."""
    rows_operand, cols_operand = operands
    chunks = Split(summed, chunk, nest=label)
    return chunks, (
        BlockTiles(outer + ("i", cols), rows=block_rows, cols=block_cols, nest=label),
        ThreadTiles("i", mr, "y", nest=label),
        ThreadTiles(cols, nr, "x", nest=label),
        Stage(rows_operand, at=chunks.blocks, nest=label),
        Stage(cols_operand, at=chunks.blocks, nest=label),
        UnrollInner(summed, UNROLL, nest=label))
