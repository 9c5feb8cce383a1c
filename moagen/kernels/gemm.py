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

from moagen.errors import ScheduleError

from moagen.steps.algebra.partials import SplitK
from moagen.steps.gpu.blocks import BlockTiles, ThreadTiles, UnrollInner
from moagen.steps.gpu.mma import SHAPES, WarpMma
from moagen.steps.gpu.staging import Stage
from moagen.steps.loop.parallel import GpuThreads
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
# GEMM's where a kernel names products with too few output tiles for a wave, their sums in
# `parts` parts (on_gemms' split): at the bench's sizes on the H200's 132 SMs, mlp's F, dX
# and weight gradients and qkv_proj's Q, K, V were 0.33-0.67 of a wave whole (float32), in
# 3 parts 1.1-2.0 (docs/journal/2026-12-07-gemm-waves.md)
GEMM_SPLIT = {**GEMM, "parts": 3}
# On tensor cores (the `tensor` variants): the same blocks and chunks, 2 x 2 warps a block
# (128 threads), each a 16 x 32 tile of the block's as fragments (float64: 2 x 4 DMMA
# m8n8k4 accumulators; float32: 1 x 2 of m16n16k8). tf32: how float32 is multiplied,
# 3 (3xTF32, its default: float32-level accuracy) or 1 (one TF32 product, an opt-in of its
# own looser tolerance); 0 for float64 (DMMA)
TENSOR = {"block_rows": 32, "block_cols": 64, "chunk": 16, "warps_y": 2, "warps_x": 2,
          "tf32": 0}
TENSOR_DTYPES = {"float32": {"tf32": 3}}
TENSOR_SPLIT = {**TENSOR, "parts": 3}  # as GEMM_SPLIT
# the kinds a tensor variant runs on (Tunable.kinds): CUDA's alone, the CPU and OpenACC
# having no tensor cores (their tensor variant would be the tiled or flash one again)
TENSOR_KINDS = ("cuda",)
PRECISION = {0: "f64", 3: "3xtf32", 1: "tf32"}

# the products' variant on CUDA where none is named, per dtype (a module's DEVICE_DEFAULTS),
# chosen by the metrics, no GPU having timed them yet: the tensor cores' floor (`moagen cost
# --cuda`) is half the FMA form's in float64 (DMMA at 67 TFLOP/s against DFMA's 34) and
# under half in float32 (3xTF32, three TF32 products, against FFMA)
TENSOR_CORES = {"cuda": {"float64": "tensor", "float32": "tensor"}}


def on_gemms(layers, rest, products, block_rows, block_cols, chunk, thread_rows=0,
             thread_cols=0, warps_y=0, warps_x=0, tf32=None, parts=1, split=None):
    """`layers` with CUDA's schedule and mapping `rest`'s (a Layers of every other nest)
    and each product (label -> (the loops outside its output tiles, its rows, columns, the
    axis summed, the operands staged)) a tiled GEMM in block_rows x block_cols blocks,
    summing in chunks of `chunk`: SIMT, thread_rows x thread_cols register tiles; or, where
    tf32 is given, on tensor cores (warps_y x warps_x warps a block, PRECISION[tf32]).

    split: label -> an axis the product sums over, for the products with too few output
    tiles to fill the GPU: their sums over it cut into `parts` parts (split-K, SplitK: a
    block per (part, output tile), each part's sum into a partial, the parts then added in
    order by the product's own nest, a thread an element; where the axis is the one summed
    in chunks, the parts are runs of whole chunks); the others summed whole."""
    split = {label: SplitK(label, Split(axis, chunk, nest=label).blocks
                           if axis == products[label][3] else axis, parts)
             for label, axis in (split or {}).items() if parts > 1}
    # a split product's GEMM is its partial nest, over the parts and the loops outside
    gemms = {split[label].partial if label in split else label:
             ((split[label].part,) + outer if label in split else outer, rows, cols, summed,
              operands)
             for label, (outer, rows, cols, summed, operands) in products.items()}
    schedule = rest.schedule_for("cuda") + gemm_schedule(
        {label: (summed, operands) for label, (_, _, _, summed, operands) in products.items()},
        chunk, split)
    if tf32 is None:
        threads = lambda label, rows, cols, summed: (
            ThreadTiles(rows, thread_rows, "y", nest=label),
            ThreadTiles(cols, thread_cols, "x", nest=label)), \
            lambda label, summed: (UnrollInner(summed, UNROLL, nest=label),)
    else:
        if tf32 not in PRECISION:
            raise ScheduleError(f"tf32 is one of {', '.join(map(str, PRECISION))}, not {tf32}")
        threads = warp_tiles(block_rows, block_cols, warps_y, warps_x, PRECISION[tf32])
    mapping = rest.mapping_for("cuda") + tuple(
        step for label, (outer, rows, cols, summed, operands) in gemms.items()
        for step in gemm_mapping(label, outer, rows, cols, summed, operands, threads,
                                 block_rows, block_cols, chunk)) + tuple(
        GpuThreads(outer + (rows, cols), nest=label)  # the merges: a thread an element
        for label, (outer, rows, cols, _, _) in products.items() if label in split)
    return replace(layers, schedule={"cpu": layers.schedule_for("cpu"), "cuda": schedule},
                   mapping={**layers.mapping, "cuda": mapping})


def gemm_schedule(products, chunk, split=None):
    """The schedule of the products (label -> (the axis summed, the operands staged)): a
    product of several sums (more than two operands) as one adding a term at a time, the
    sums as loops, each cut into chunks of `chunk`; those in `split` (label -> its SplitK)
    then cut into parts (its partial nest the GEMM)."""
    split = split or {}
    merged = [label for label, (_, operands) in products.items() if len(operands) > 2]
    return (*(MergeSums(nest=label) for label in merged),
            LowerReductions(),
            *(AddTermwise(nest=label) for label in merged),
            *(Split(summed, chunk, nest=label) for label, (summed, _) in products.items()),
            *split.values())


def warp_tiles(block_rows, block_cols, warps_y, warps_x, precision):
    """(the steps giving a product's rows and columns to a block's warps, each a tile of
    fragments; the step putting its sum on tensor cores): gemm_mapping's `threads`."""
    (m, n, _), _ = SHAPES[precision]
    if not (warps_y > 0 and warps_x > 0) or block_rows % (warps_y * m) or \
            block_cols % (warps_x * n):
        raise ScheduleError(f"{precision} tensor cores: blocks of {block_rows} x {block_cols} "
                            f"are no whole fragments of {m} x {n} for {warps_y} x {warps_x} "
                            "warps")
    return (lambda label, rows, cols, summed: (
        ThreadTiles(rows, block_rows // warps_y, "y", threads=warps_y, fragment=m, nest=label),
        ThreadTiles(cols, block_cols // warps_x, "x", threads=warps_x, fragment=n,
                    nest=label)),
        lambda label, summed: (WarpMma(summed, precision, nest=label),))


def gemm_mapping(label, outer, rows, cols, summed, operands, threads, block_rows,
                 block_cols, chunk):
    """The mapping of the product `label` over its loops outer + (rows, cols), summing over
    `summed` in chunks of `chunk` (gemm_schedule) the arrays `operands`; threads: (the
    steps giving the block's rows and columns to its threads, those of the sum once its
    operands are staged), each a function of (label, rows, cols, summed), (label, summed)."""
    chunks = Split(summed, chunk, nest=label).blocks
    tiles, inner = threads
    return (BlockTiles(outer + (rows, cols), rows=block_rows, cols=block_cols, nest=label),
            *tiles(label, rows, cols, summed),
            *(Stage(operand, at=chunks, vector=True, nest=label) for operand in operands),
            *inner(label, summed))
