"""Attention forward, O = softmax(scale * Q K^T) V per (batch, head), softmax made stable by
subtracting the row maximum; optionally causal (query i sees keys j <= i, as PyTorch's
is_causal). Written once; the variants differ only in what they materialize and in their
schedule."""
import math
from functools import partial

from moagen import reference
from moagen.kernels.cases import Bench, Check, references
from moagen.kernels.layers import Layers, cpu
from moagen.kernels.tunable import Tunable
from moagen.moa.expr import (Scalar, array, exp, inner, iota, lift, log, maximum, named, omega,
                             outer, psi, reduce, transpose, where)
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.algebra.block_products import BlockProducts
from moagen.steps.algebra.causal import CausalBlocks
from moagen.steps.algebra.keytiles import ColumnTiles, KeyTiles
from moagen.steps.algebra.online import OnlineSoftmax
from moagen.onf.names import loop_role
from moagen.cuda_archs import WARP
from moagen.errors import ScheduleError
from moagen.kernels.gemm import PRECISION, TENSOR_CORES, TENSOR_DTYPES, TENSOR_KINDS
from moagen.kinds import KINDS
from moagen.steps.gpu.blocks import BlockTiles, ThreadPhases, ThreadTiles, UnrollInner
from moagen.steps.gpu.mma import SHAPES, WarpMma, WarpTiles
from moagen.steps.gpu.staging import RegisterTile, SharedScratch, Stage
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import GpuThreads, Parallel
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.unroll import keys_summed, rows_together, tiled

Q = array("Q", "batch", "heads", "n", "d")
K = array("K", "batch", "heads", "n", "d")
V = array("V", "batch", "heads", "n", "d")


def causal_mask(scores):
    """Keys after the query get -inf, so exp gives them zero weight."""
    return where(outer(">=", iota("n"), iota("n")), scores, float("-inf"))


# the least row max of a softmax whose rows may see no key: such a row's weights are
# exp(-inf + 1e30) = 0, not exp(-inf + inf) = NaN; a row that sees one has a larger max (its
# scores finite)
LOWEST = -1e30


def softmax_parts(q, k, causal, mask=causal_mask, floored=False):
    """The scaled (masked) scores and the stable softmax's row max, weights and row sum;
    mask: what causal applies to the scores (moagen.kernels.attention_cross shifts it);
    floored: the row max at least LOWEST (a mask may hide every key of a row)."""
    scores = Scalar("scale") * inner(q, transpose(k), var="c", name="qk")
    scores = named("scores", mask(scores) if causal else scores, index=("i", "j"))
    row_max = reduce("max", scores, axis=1, var="j", name="row_max")
    if floored:
        row_max = maximum(row_max, LOWEST)
    weights = exp(omega("-", scores, row_max))
    row_sum = reduce("+", weights, axis=1, var="j", name="row_sum")
    return row_max, weights, row_sum


def one_head(q, k, v, causal, mask=causal_mask, dropout=None, floored=False):
    """O and the per-row logsumexp, which the backward pass needs; dropout: what the
    probabilities become before they weight V (moagen.kernels.attention_dropout), the lse
    being the softmax's own. floored: a row may see no key, and gets O = 0 (its sum 0,
    divided by 1) and lse = -inf (log 0), as SDPA and FlashAttention give it; a row that
    sees a key has a sum of at least 1 (its max's term), which the division by max(sum, 1)
    leaves, and a max above the floor."""
    row_max, weights, row_sum = softmax_parts(q, k, causal, mask, floored)
    probs = named("probs", omega("/", weights, maximum(row_sum, 1.0) if floored else row_sum),
                  index=("i", "j"))
    return (inner(dropout(probs) if dropout else probs, v, var="j", name="acc"),
            row_max + log(row_sum))


def spec(causal: bool) -> KernelSpec:
    o, lse = one_head(*(psi(("b", "h"), a) for a in (Q, K, V)), causal)
    return KernelSpec(
        name="attention_fwd_causal" if causal else "attention_fwd",
        inputs=(Q, K, V),
        scalars=("scale",),
        outputs=(Output("O", lift(("b", "h"), ("batch", "heads"), o), ("b", "h", "i", "c")),
                 Output("lse", lift(("b", "h"), ("batch", "heads"), lse), ("b", "h", "i"))),
    )

ROWS = ("b", "h", "i")
KEY_BLOCK = 64


def row_pass(rows=ROWS):
    """O and lse of each query row (the loops `rows`) in one nest."""
    return (Accumulate("c", over="j", nest="O"), FuseNests(("O", "lse"), over=rows, name="rows"),
            Hoist())


ROW_PASS = row_pass()


def _online(rows, keys):
    """One pass over the keys, in blocks, with a running max and sum rescaling the output;
    `rows` query rows walk the keys together (each key and value row loaded once for all),
    and add `keys` value rows at a time into their output rows (each output element loaded
    and stored once per `keys` terms). The threads take the row groups in turn: they walk
    one head's keys at the same time, so the last-level cache holds one head's K and V, not
    one per thread (float64, d 128, n 8192: 16 MiB a head, 32 MiB for two). On a GPU a
    thread takes a row group."""
    parallel = ROWS[:-1] + (tiled("i", rows),)
    return Layers(algorithm=ROW_PASS + (OnlineSoftmax("rows", block=KEY_BLOCK),),
                  schedule=(*keys_summed("rows", keys), LowerReductions(),
                            *rows_together("rows", "i", rows)),
                  mapping={"cpu": (Parallel(parallel, nest="rows", interleave=True),),
                           "cuda": (GpuThreads(parallel, nest="rows"),)})


def flash_tiles(nest, rows, lanes, causal, edge_rows=1):
    """FlashAttention's form of a nest's online pass over blocks of keys j: `rows` query rows
    i together, and both products of a block as register tiles (rows x `lanes` sums): the
    scores against K packed in panels of `lanes` keys (K transposed, one copy per call), the
    output by tiles of `lanes` columns kept in registers over the block's keys. The rows left
    over after the tiles (the edge) in tiles of `edge_rows`, then one at a time, the same way
    from the same panels: alone, each of those rows would read every key and value row for
    itself (n_q 512 at rows 12: 8 rows, 17-22% of the time). Causal
    (CausalBlocks, on the row tiles and on the rows left over after them): the key blocks
    past a tile's last row are not visited, those before its diagonal run unmasked, only the
    diagonal blocks select."""
    together = rows_together(nest, "i", rows)
    edges = tuple(jam.edge for jam in together)
    edge_tiles = rows_together(edges[0], "i", edge_rows) if edges else ()
    edges += tuple(jam.edge for jam in edge_tiles)
    masked = tuple(CausalBlocks(n) for n in (nest, *edges)) if causal else ()
    return (*together, *edge_tiles, *masked, KeyTiles(nest, "j", lanes, also=edges),
            ColumnTiles(nest, "j", "c", lanes, pack=True, also=edges))


def edge_rows(rows: int) -> int:
    """The rows a tile of the rows left over after `rows`-row tiles takes: a third of them
    where 3 divides them (12 -> 4, 6 -> 2), else half (8 -> 4); the tiles' rows were
    chosen by register count, the edge's so that at most a few rows run alone."""
    return rows // 3 if rows % 3 == 0 else max(rows // 2, 1)


def flash_params(n: int, d: int, causal: bool, lanes: int) -> dict:
    """The parameters of a kernel in FlashAttention's form (attention_fwd's flash,
    attention_fwdbwd's owner; attention_bwd's flash takes all but `block`, having no forward
    pass) for sizes where its defaults lose; `lanes`: the tiles' width the kernel takes
    otherwise (its defaults on this machine). Tiles at most 16 lanes wide when d < 32 (32
    lanes would leave every output column to the remainder loop), and for causal sequences
    up to 256 blocks of 16 keys (only the diagonal blocks select; at n 64 a block of 64 keys
    is all diagonal) with tiles of 8 rows, two to a block (6 rows straddle the blocks).
    Empty where the defaults stand (docs/PERFORMANCE.md, "Attention at small sizes")."""
    narrow = min(lanes, 16)
    params = {"lanes": narrow} if d < 32 and lanes > narrow else {}
    if causal and n <= 256:
        params.update(block=16, rows=8, lanes=narrow)
    return params


# The CPU's tiles: a row of the score and output tiles in two vector registers, 6 rows (12
# accumulators of AVX2's 16 registers: 8 float64 lanes, 16 float32); AVX-512's 12 rows, a
# row in two 512-bit registers (float64 16 lanes, float32 32: 24 of 32 registers), over
# blocks of 128 keys; float64's 32 lanes (4 registers a row) ran 1.05-1.28x slower once gcc
# wrote 512-bit vectors (docs/PERFORMANCE.md, "The flash forward's tiles")
FLASH_DEFAULTS = {"rows": 6, "lanes": 8, "block": KEY_BLOCK}
FLASH_DTYPES = {"float32": {"lanes": 16}}
FLASH_AVX512 = {"float64": {"rows": 12, "lanes": 16, "block": 128},
                "float32": {"rows": 12, "lanes": 32, "block": 128}}
# On a GPU a thread block takes 64 query rows, float64 32: at 64, Q's, K's and the
# probabilities' tiles ask 174,080 bytes a block at d 128, over the 166,912 an sm_80 block
# may have (moagen.cuda_archs); at 32, 124,928. The key blocks stay 64, so that a thread's
# tile stays 4 x 4 and its output columns in registers unspilled (docs/PERFORMANCE.md,
# "CUDA: FlashAttention-2's form for attention, judged without a GPU")
FLASH_QUERIES = {"queries": KEY_BLOCK}
FLASH_CUDA_DTYPES = {"float64": {"queries": 32}}


def flash(rows, lanes, block, causal, loops=ROWS, then=(), unseen=False, queries=None,
          tf32=None, heads=None):
    """The online pass over blocks of `block` keys in FlashAttention's form (flash_tiles);
    loops: the query rows' (the query row last); then: steps the CPU's schedule takes after
    the tiles' (a kernel's own); unseen: a block may hold none of a row's keys (an added
    mask's, OnlineSoftmax's unseen); heads: the loops the CPU's threads share where not
    also the row tiles (None: loops but the last, then the row tiles; attention_varlen's
    rows, of an extent read from the offsets, cannot join a collapsed parallel nest). On a
    GPU (gpu_flash), causal or not and over any query loops, a thread block per `queries`
    query rows, each thread `rows` of them by `lanes` keys or columns."""
    parallel = heads or loops[:-1] + (tiled("i", rows),)
    return Layers(algorithm=row_pass(loops) + (OnlineSoftmax("rows", block=block,
                                                             unseen=unseen),),
                  schedule={"cpu": (LowerReductions(),
                                    *flash_tiles("rows", rows, lanes, causal, edge_rows(rows)),
                                    *then),
                            "cuda": (LowerReductions(),)},
                  mapping={"cpu": (Parallel(parallel, nest="rows", interleave=True),),
                           "cuda": gpu_flash("rows", rows, lanes, block, causal, loops,
                                             queries, tf32)})


# the head dims a tiled GPU kernel is compiled for: d up to each, a register tile's
# columns a compile-time count
HEAD_DIM_BOUNDS = (("d", (64, 128)),)


def thread_tiles(nest, walking, other, rows, lanes, columns):
    """A thread block's threads over its tiles: along y `rows` each of the block's own rows
    (over `walking`), along x `lanes` each of the other side's rows (over `other`: the
    scores) and `lanes` at a time of the output's columns, `columns` threads across them."""
    return (ThreadTiles(walking, rows, "y", nest=nest),
            ThreadTiles(other, lanes, "x", nest=nest),
            ThreadTiles("c", lanes, "x", threads=columns, nest=nest))


# the tensor variant's warps a block: 4 along the query rows (y), 1 along the keys (x), so
# that the softmax's threads (4 x 32) are the same block: a row's keys across one warp's
# lanes, its max and sum by shuffles
TENSOR_WARPS = (4, 1)


def gpu_flash(nest, rows, lanes, block, causal=False, loops=ROWS, queries=None, tf32=None):
    """FlashAttention-2's form on a GPU: a thread block per `queries` query rows of a head
    (None: `block`, the key blocks' size; the grid: the loops `loops` but the last, then
    row tiles; BlockTiles folds the middle ones where there are more than 3), queries /
    rows x block / lanes threads; each key block's K and V tiles staged in shared memory
    with the block's Q tile, each thread a register tile of `rows` query rows by `lanes`
    keys of the scores and by `lanes` (times d / block) columns of the output, kept in
    registers over all the keys; the block's scores in shared memory, a row's max and sum
    over its lanes by warp shuffles. V's tile takes K's memory once the scores are taken.
    Causal: the key blocks past the block's last row are not visited, the diagonal ones
    select (CausalBlocks over the block's rows; each of its two loops over key blocks
    stages its tiles)."""
    key_blocks = loop_role("j", "blk")  # OnlineSoftmax's loop over blocks of keys
    masked = (CausalBlocks(nest, rows="i"),) if causal else ()
    tiles = BlockTiles(loops, rows=queries or block, bounds=HEAD_DIM_BOUNDS, nest=nest)
    scratch = SharedScratch("probs", fastest="i", nest=nest)
    if tf32 is not None:
        # the scores' product on tensor cores (WarpMma): the block's 4 x 1 warps, each
        # queries / 4 rows by the key block as fragments; the softmax and O += P V by the
        # same 128 threads, 4 along the rows, 32 lanes along a key block and O's columns
        precision = PRECISION[tf32]
        (m, _, k), _ = SHAPES[precision]
        warps_y, warps_x = TENSOR_WARPS
        rows, lanes = (queries or block) // warps_y, block // WARP
        if rows % m or (queries or block) % warps_y or block % (WARP * warps_x):
            raise ScheduleError(f"{precision} tensor cores: {queries or block} query rows "
                                f"by {block} keys are no whole fragments for "
                                f"{warps_y} x {warps_x} warps")
        # O += P V so too: each key block's products summed apart (BlockProducts) as the
        # warps' fragments, 64 of O's columns a warp's tile, added to O's rescaled rows by
        # the threads
        return (tiles, *masked, *thread_tiles(nest, "i", "j", rows, lanes, WARP),
                BlockProducts(key_blocks, "block_out", nest=nest),
                RegisterTile("O", nest=nest),
                Stage("Q", at="i", steps=k, nest=nest),
                Stage("K", at=key_blocks, steps=k, nest=nest),
                Stage("V", at=key_blocks, late=True, nest=nest), scratch,
                SharedScratch("block_out", fastest="c", nest=nest),
                ThreadPhases("i", nest=nest),
                WarpTiles("c", precision, TENSOR_WARPS, nest=nest),
                WarpTiles("j", precision, TENSOR_WARPS, tiles=(0, block), nest=nest),
                WarpMma("c", precision, whole=True, nest=nest),
                WarpMma("j", precision, nest=nest))
    columns = block // lanes
    return (tiles, *masked,
            *thread_tiles(nest, "i", "j", rows, lanes, columns),
            RegisterTile("O", nest=nest),
            Stage("Q", at="i", nest=nest), Stage("K", at=key_blocks, nest=nest),
            Stage("V", at=key_blocks, late=True, nest=nest), scratch,
            # the products' own loops, over d in the scores and a key block in O: 64 FMA of
            # a thread's 4 x 4 tile a back-edge
            UnrollInner("c", 4, nest=nest), UnrollInner("j", 4, nest=nest))


def variants(causal: bool):
    """The variants of the plain or the causal kernel (the causal flash skips key blocks)."""
    return {
        # the standard implementation: the n x n scores and probabilities live in memory
        "naive": (frozenset({"scores", "probs"}), Layers(algorithm=(Hoist(),),
                                                         mapping=cpu(Parallel(ROWS)))),
        # row-wise: nothing of size n x n; each row's max and sum are computed once, and each
        # probability once per key, then spread over the output row
        "dnf": (frozenset(), Layers(algorithm=ROW_PASS, mapping=cpu(Parallel(ROWS)))),
        # CPU defaults: what `moagen tune` chose on the development machines (rows 6-8, keys 2
        # to 4, float64 and float32, d 64 and 128); on a GPU a thread takes 4 rows
        "online": Tunable(frozenset(), _online, defaults={"rows": 8, "keys": 2},
                          space={"rows": (1, 2, 4, 6, 8), "keys": (1, 2, 4)},
                          cuda={"rows": 4, "keys": 4}),
        "flash": flash_variant(causal),
        # flash with CUDA's two products on tensor cores (float64 DMMA, float32 3xTF32;
        # tf32=1, one TF32 product, an opt-in); CUDA only
        "tensor": flash_variant(causal, tensor=True),
    }


def flash_variant(causal: bool, loops=ROWS, then=(), unseen=False, tensor=False, heads=None,
                  kinds=tuple(KINDS)) -> Tunable:
    """The flash variant over the query rows `loops` (the query row last), with its CPU,
    GPU, float32 and AVX-512 defaults; then, unseen, heads: flash's. tensor: the scores'
    product on CUDA tensor cores (gpu_flash's tf32: 0 float64, 3 float32), a thread's tile
    the warps' (rows and lanes taken from the block's). kinds: the target kinds it runs on
    (tensor: CUDA's)."""
    # causal: key blocks of 32 on tensor cores (its two key-block loops' tiles at 64 ask
    # 225,280 bytes a float64 block at d 128, over sm_80's 166,912; at 32, 147,456)
    tf32 = {"tf32": 0, **({"block": 32} if causal else {})} if tensor else {}
    return Tunable(frozenset(), partial(flash, causal=causal, loops=loops, then=then,
                                        unseen=unseen, heads=heads),
                   defaults=FLASH_DEFAULTS,
                   space={"rows": (4, 6, 8, 12), "lanes": (8, 16, 32), "block": (64, 128, 256)},
                   # a thread's register tile on block tiles (gpu_flash), the causal and
                   # grouped-query kernels' too: 4 rows by 4 keys or columns
                   cuda={"rows": 4, "lanes": 4, **FLASH_QUERIES, **tf32},
                   cuda_dtypes={d: {**FLASH_CUDA_DTYPES.get(d, {}), **TENSOR_DTYPES.get(d, {})}
                                for d in ("float64", "float32")} if tensor
                   else FLASH_CUDA_DTYPES,
                   dtypes=FLASH_DTYPES, avx512=FLASH_AVX512,
                   kinds=TENSOR_KINDS if tensor else kinds)


KERNELS = [(spec(False), variants(False)), (spec(True), variants(True))]
# the variant CUDA runs where none is named (moagen.kernels.Kernel.default_variant): the
# forwards' two products on tensor cores, by the metrics as the GEMMs' (`moagen cost --cuda
# attention_fwd -D n=4096 -D heads=8`: floor 0.525 ms against flash's 1.031 in float64,
# 0.213 against 0.523 in float32)
DEVICE_DEFAULTS = {name: TENSOR_CORES for name in ("attention_fwd", "attention_fwd_causal")}

# What verification and the benchmarks run these kernels on (moagen.kernels.cases): one
# key, sizes that divide nothing, n past a block of keys; the bench on 4 heads of 64.
CHECK_SIZES = (dict(batch=1, heads=1, n=1, d=3), dict(batch=2, heads=3, n=7, d=5),
               dict(batch=1, heads=2, n=257, d=80))
ON_HEADS = Bench(lambda n: dict(batch=1, heads=4, n=n, d=64), quick=(128,), full=(256, 512, 1024))


def softmax_scale(sizes):
    """The softmax's scale, 1 / sqrt(d), as the scalar argument `scale`."""
    return {"scale": 1 / math.sqrt(sizes["d"])}


CHECKS = {name: Check(references(reference.attention_fwd_numpy, reference.attention_fwd_torch,
                                 causal=causal), CHECK_SIZES, softmax_scale)
          for name, causal in (("attention_fwd", False), ("attention_fwd_causal", True))}
BENCH = {name: ON_HEADS.measured_against(
             "sdpa", "O by F.scaled_dot_product_attention; no lse (SDPA returns none)",
             outputs=(0,), causal=causal)
         for name, causal in (("attention_fwd", False), ("attention_fwd_causal", True))}
