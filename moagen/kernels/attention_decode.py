"""Attention decode: one new query row per (batch, query head) against a KV cache of which
the first n rows are valid (n is given at call time; the cache has room for `cap` rows).

Grouped-query attention: q_heads query heads share kv_heads KV heads, query head h reading
KV head h // (q_heads / kv_heads), by indexing, so the cache is read once per group; MQA is
kv_heads = 1. The query is the newest position, so it sees every valid row: decode is
causal by construction.
"""
import os

from moagen import reference
from moagen.cuda_archs import WARP
from moagen.kernels.attention import HEAD_DIM_BOUNDS, KEY_BLOCK, softmax_scale
from moagen.kernels.cases import Bench, Check, references
from moagen.kernels.layers import Layers, cpu
from moagen.kernels.tunable import Tunable
from moagen.moa.expr import (Scalar, array, exp, idiv, inner, lift, log, psi, reduce, sym, take)
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.algebra.given import GivenSize
from moagen.steps.algebra.online import OnlineSoftmax
from moagen.steps.algebra.splitkeys import SplitKeys
from moagen.steps.gpu.blocks import BlockTiles, ThreadTiles
from moagen.steps.gpu.staging import RegisterTile
from moagen.steps.gpu.vector import VectorLoads
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.gpu_blocks import GpuBlocks
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import Parallel
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.split import SplitLoop
from moagen.steps.loop.unroll import keys_summed, rows_together, tiled

Q = array("q", "batch", "q_heads", "d")
K_CACHE = array("K", "batch", "kv_heads", "cap", "d")
V_CACHE = array("V", "batch", "kv_heads", "cap", "d")


GROUP = idiv(sym("q_heads"), sym("kv_heads"))  # query heads per KV head


def softmax_weighted(scores, values, var="j"):
    """softmax(scores) . values and the scores' logsumexp, the softmax made stable by the
    maximum. Decode's scores are q . K; the merge of partial results over ranks
    (moagen.ranks.merge) is the same with each part's logsumexp as its score."""
    row_max = reduce("max", scores, axis=0, var=var, name="row_max")
    weights = exp(scores - row_max)
    row_sum = reduce("+", weights, axis=0, var=var, name="row_sum")
    return inner(weights / row_sum, values, var=var, name="acc"), row_max + log(row_sum)


def _one_head(b, h):
    kv_head = idiv(h, GROUP)
    q = psi((b, h), Q)
    keys, values = (take("n", psi((b, kv_head), cache)) for cache in (K_CACHE, V_CACHE))
    return softmax_weighted(Scalar("scale") * inner(keys, q, var="c", name="qk"), values)


_O, _LSE = _one_head(sym("b"), sym("h"))
SPEC = KernelSpec(
    name="attention_decode",
    inputs=(Q, K_CACHE, V_CACHE),
    scalars=("scale",),
    given=("n",),
    outputs=(Output("O", lift(("b", "h"), ("batch", "q_heads"), _O), ("b", "h", "c")),
             Output("lse", lift(("b", "h"), ("batch", "q_heads"), _LSE), ("b", "h"))),
)


def validate(sizes, scalars):
    """What the index arithmetic assumes: whole groups, and valid rows inside the cache."""
    if sizes["n"] < 1:
        raise ValueError("attention_decode: n must be at least 1 (a softmax over no rows)")
    if sizes["q_heads"] % sizes["kv_heads"]:
        raise ValueError(f"attention_decode: kv_heads = {sizes['kv_heads']} does not divide "
                         f"q_heads = {sizes['q_heads']}")
    if sizes["n"] > sizes["cap"]:
        raise ValueError(f"attention_decode: n = {sizes['n']} valid rows exceed the cache's "
                         f"capacity of {sizes['cap']} rows")


HEADS = ("b", "h")
KEY_SPLITS = 16  # slices of the cache per query row: enough for every core of a node
HEAD_THREADS = 128  # a block's threads on a GPU: a feature each at d = 128
ROW = (Accumulate("c", over="j", nest="O"), FuseNests(("O", "lse"), over=HEADS, name="heads"),
       Hoist())


def _online(heads, keys):
    """One pass, running max and sum, over blocks of keys; the query heads walked group by
    group (h = GROUP g + r), `heads` of a group together (they read the same KV rows: once),
    adding `keys` value rows at a time into their output rows."""
    groups = SplitLoop("heads", "h", outer="kv_heads", inner=GROUP)
    return Layers(algorithm=ROW + (OnlineSoftmax("heads", block=KEY_BLOCK),),
                  schedule=(*keys_summed("heads", keys), groups, LowerReductions(),
                            *rows_together("heads", groups.members, heads)),
                  mapping=cpu(Parallel(("b", groups.groups, tiled(groups.members, heads)),
                                       nest="heads")))


def _split(heads):
    """The valid rows cut into slices run in parallel, merged by their logsumexp. On a GPU
    (flash-decoding's split) a thread block per slice of a query head, and one per query
    head to merge them, their threads sharing the head dimension: a block's dot products
    are block-wide reductions, its output row a feature a thread."""
    split = SplitKeys("heads", over=HEADS, var="j", splits=KEY_SPLITS)
    slices = ("b", tiled("h", heads), split.slices)
    return Layers(algorithm=ROW + (OnlineSoftmax("heads"), split, LowerReductions()),
                  schedule=rows_together(split.partial, "h", heads),
                  mapping={"cpu": (Parallel(slices, nest=split.partial),
                                   Parallel(HEADS, nest=split.merge)),
                           "cuda": (GpuBlocks(slices, nest=split.partial, block=HEAD_THREADS),
                                    GpuBlocks(HEADS, nest=split.merge, block=HEAD_THREADS))})


def _grouped(heads):
    """Flash-decoding on a GPU, a block a group: the valid rows cut into slices of
    WARP_KEYS w rows (w given at call time, by default keys_a_warp's: a long cache fills the
    GPU in about WAVES waves, not more slices than that, a short one a warp's 32), merged by
    their logsumexp; a thread block per (batch, KV head, SLICE_WARPS slices) computing
    `heads` query heads of the group together, so that each K and V row is read once for
    them (a group of more heads: a block per `heads` of them; the heads past the last whole
    `heads` a block each, the edge). A warp a slice, walking its keys with a running max,
    sum and output row per query head in registers; its lanes across d (4 consecutive
    features a lane), each dot product summed over the lanes by warp shuffles: no barrier
    and no shared memory. CPU: a thread per slice of a query head."""
    split = SplitKeys("heads", over=HEADS, var="j", splits=SLICE_WARPS * _BLOCK_SLICES,
                      rows=WARP_KEYS * sym("w"))
    groups = SplitLoop(split.partial, "h", outer="kv_heads", inner=GROUP)
    together = rows_together(split.partial, groups.members, heads)
    edge = gpu_grouped(together[0].edge, split, groups.groups, groups.members) \
        if together else ()
    return Layers(algorithm=ROW + (OnlineSoftmax("heads"), GivenSize("w", keys_a_warp), split,
                                   LowerReductions()),
                  schedule={"cpu": (), "cuda": (groups, *together)},
                  mapping={"cpu": (Parallel(("b", "h", split.slices), nest=split.partial),
                                   Parallel(HEADS, nest=split.merge)),
                           "cuda": (*gpu_grouped(split.partial, split, groups.groups,
                                                 tiled(groups.members, heads)), *edge,
                                    GpuBlocks(HEADS, nest=split.merge, block=HEAD_THREADS))})


WARP_KEYS = 32  # keys a warp walks, w times over (w a size given at call time)
SLICE_WARPS = 4  # warps a block, each its own slice
# a block's slices of the cache: SLICE_WARPS slices of WARP_KEYS w keys each
_BLOCK_SLICES = idiv(sym("n") + SLICE_WARPS * WARP_KEYS * sym("w") - 1,
                     SLICE_WARPS * WARP_KEYS * sym("w"))
WAVES = 2  # the grid keys_a_warp aims for: twice the blocks the device holds at once
RESIDENT_BLOCKS = 7  # blocks an SM holds: the float32 partial kernel's on sm_90 (moagen cost --cuda)


def keys_a_warp(sizes, sms=None):
    """w, the keys a warp walks in WARP_KEYS: the largest that leaves the grid (a block per
    batch, KV head, group's `heads` query heads and SLICE_WARPS slices) WAVES waves of blocks
    on `sms` SMs of RESIDENT_BLOCKS each (a CPU: a block a core at once), so that a long
    cache is not cut into more slices, each with its partial results to store and merge,
    than fill the device; 1 where the cache is too short for that (one wave or less)."""
    group = sizes["q_heads"] // sizes["kv_heads"]
    blocks = (sizes["batch"] * sizes["kv_heads"] * _ceil(group, GROUP_HEADS)
              * _ceil(sizes["n"], SLICE_WARPS * WARP_KEYS))
    at_once = sms * RESIDENT_BLOCKS if sms else os.cpu_count() or 1
    return max(1, blocks // (WAVES * at_once))


def _ceil(a, b):
    return -(-a // b)
LANE_FEATURES = 4  # consecutive features of d a lane takes: 128 at d = 128 for a warp


def gpu_grouped(nest, split, groups, members):
    """The mapping of `nest`, slices of a group's query heads (SplitKeys `split`'s partial
    or its edge, the group split by SplitLoop into `groups` and `members`): a block per
    (b, group, `members`, SLICE_WARPS slices); a warp a slice (axis y); a warp's lanes
    across d (axis x, each LANE_FEATURES of it; d at most 64 or 128 compiled); each
    slice's output rows (O_part, SplitKeys' name for O's) in the registers of the lanes
    that own them, stored once after its keys; each lane's 4 features of a K and a V row
    read once a key for the group's heads, as 16-byte vector loads."""
    return (BlockTiles(("b", groups, members, split.slices), rows=SLICE_WARPS,
                       bounds=HEAD_DIM_BOUNDS, nest=nest),
            ThreadTiles(split.slices, 1, "y", threads=SLICE_WARPS, nest=nest),
            ThreadTiles("c", LANE_FEATURES, "x", threads=WARP, nest=nest),
            RegisterTile("O_part", nest=nest),
            VectorLoads(("K", "V"), "c", nest=nest))


HEAD_SPACE = {"heads": (1, 2, 4, 8)}
GROUP_HEADS = 4  # grouped's query heads a block (its default `heads`)
VARIANTS = {
    # three passes over the valid rows (max, sum, weighted sum)
    "dnf": (frozenset(), Layers(algorithm=ROW, mapping=cpu(Parallel(HEADS)))),
    # the CPU's keys 1: what `moagen tune` chose on the development machines (float32, n 65536)
    "online": Tunable(frozenset(), _online, defaults={"heads": 4, "keys": 1},
                      space={**HEAD_SPACE, "keys": (1, 2, 4)}, cuda={"keys": 2}),
    # a GPU's block takes one query head's slice: its threads are the head's features
    "split": Tunable(frozenset(), _split, defaults={"heads": 4}, space=HEAD_SPACE,
                     cuda={"heads": 1}),
    # a GPU's block takes a group's query heads (4 of them) over slices of the cache, a
    # warp a slice: each K and V row read once for the 4
    "grouped": Tunable(frozenset(), _grouped, defaults={"heads": GROUP_HEADS}, space=HEAD_SPACE),
}

KERNELS = [(SPEC, VARIANTS, validate)]

# What verification and the benchmarks run this kernel on (moagen.kernels.cases): MHA, GQA
# (3 query heads a KV head), MQA; n = cap and n < cap. The bench: 32 query heads over 8 KV
# heads of 128, a full cache of n rows.
CHECKS = {"attention_decode": Check(
    references(reference.attention_decode_numpy, reference.attention_decode_torch),
    (dict(batch=1, q_heads=1, kv_heads=1, cap=1, d=3, n=1),
     dict(batch=2, q_heads=6, kv_heads=2, cap=11, d=5, n=7),
     dict(batch=1, q_heads=8, kv_heads=1, cap=300, d=80, n=257)), softmax_scale)}
BENCH = {"attention_decode": Bench(lambda n: dict(batch=1, q_heads=32, kv_heads=8, cap=n, d=128,
                                                  n=n),
                                   quick=(4096,), full=(1024, 8192, 32768)).measured_against(
    "sdpa_decode", "O by F.scaled_dot_product_attention(enable_gqa=True) on the cache's "
                   "first n rows; no lse (SDPA returns none)", outputs=(0,))}
