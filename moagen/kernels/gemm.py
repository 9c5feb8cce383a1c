"""Products' GPU form: tiled SIMT GEMMs, from the mapping steps attention's flash form uses
(moagen.kernels.attention.gpu_flash).

    out[b, i, j] = sum_k A[b, i, k] B[k, j]  (+ sum_k A'[b, i, k] B'[k, j] ...)

(or, a weight gradient, out[i, j] = sum_b sum_k A[b, i, k] B[b, k, j]: each batch entry's
sum in chunks, the entries' sums added in registers).

A thread block per block_rows x block_cols output tile (BlockTiles over rows and columns);
the sum cut into chunks of `chunk` (Split; several sums over one extent merged into one
first, MergeSums, each step then adding a term at a time, AddTermwise: an FMA each), each
chunk's tiles of every operand staged in shared memory by the whole block (Stage: a row
operand's laid out with the rows last, a column operand's with the columns last, so that a
thread reads its register tile's rows and columns of a step of the sum as consecutive
numbers: 128-bit shared loads); each thread an mr x nr register tile of accumulators
(ThreadTiles along y over the rows, x over the columns) held over the whole sum, its loop
unrolled so that a back-edge carries 4 steps of it (UnrollInner). The barriers between a
chunk's copies and its reads are derived (moagen.steps.gpu.closing)."""
from dataclasses import replace

from moagen.steps.gpu.blocks import BlockTiles, ThreadTiles, UnrollInner
from moagen.steps.gpu.staging import Stage
from moagen.steps.loop.merge_sums import AddTermwise, MergeSums
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.split import Split

# the steps of the sum a back-edge of its loop carries: 4 x the tile's FMA
UNROLL = 4
# a thread's 4 x 4 tile takes 16 FMA a step of the sum for two 128-bit shared loads
# (float32); blocks of 32 x 64 (128 threads), so that the model's 512 x 512 product (bench
# n 512) still has 128 blocks; chunks of 16 of the sum: tiles of 16 x (32 + 4) and
# 16 x (64 + 4) numbers, 6.5 KB (float32) of shared memory a block
GEMM = {"block_rows": 32, "block_cols": 64, "chunk": 16, "thread_rows": 4, "thread_cols": 4}


def on_gemms(layers, rest, products, block_rows, block_cols, chunk, thread_rows,
             thread_cols):
    """`layers` with CUDA's schedule and mapping `rest`'s (a Layers of every other nest)
    and each product (label -> (the loops outside its output tiles, its rows, columns, the
    axis summed, the operands staged)) a tiled SIMT GEMM of thread_rows x thread_cols
    register tiles in block_rows x block_cols blocks, summing in chunks of `chunk`."""
    schedule = rest.schedule_for("cuda") + gemm_schedule(
        {label: (summed, operands) for label, (_, _, _, summed, operands) in products.items()},
        chunk)
    mapping = rest.mapping_for("cuda") + tuple(
        step for label, (outer, rows, cols, summed, operands) in products.items()
        for step in gemm_mapping(label, outer, rows, cols, summed, operands, thread_rows,
                                 thread_cols, block_rows, block_cols, chunk))
    return replace(layers, schedule={"cpu": layers.schedule_for("cpu"), "cuda": schedule},
                   mapping={**layers.mapping, "cuda": mapping})


def gemm_schedule(products, chunk):
    """The schedule of the products (label -> (the axis summed, the operands staged)): a
    product of several sums (more than two operands) as one adding a term at a time, the
    sums as loops, each cut into chunks of `chunk`."""
    merged = [label for label, (_, operands) in products.items() if len(operands) > 2]
    return (*(MergeSums(nest=label) for label in merged),
            LowerReductions(),
            *(AddTermwise(nest=label) for label in merged),
            *(Split(summed, chunk, nest=label) for label, (summed, _) in products.items()))


def gemm_mapping(label, outer, rows, cols, summed, operands, mr, nr, block_rows,
                 block_cols, chunk):
    """The mapping of the product `label` over its loops outer + (rows, cols), summing over
    `summed` in chunks of `chunk` (gemm_schedule) the arrays `operands`."""
    chunks = Split(summed, chunk, nest=label).blocks
    return (BlockTiles(outer + (rows, cols), rows=block_rows, cols=block_cols, nest=label),
            ThreadTiles(rows, mr, "y", nest=label),
            ThreadTiles(cols, nr, "x", nest=label),
            *(Stage(operand, at=chunks, nest=label) for operand in operands),
            UnrollInner(summed, UNROLL, nest=label))
