"""Attention backward, given Q, K, V, the forward's output O and per-row logsumexp lse, and
the output gradient dO (per batch and head; optionally causal), derived from the forward
spec by moagen.moa.grad and its rewrites (not written by hand):

    P  = exp(scale * Q K^T - lse)          the softmax, recomputed from lse
    dV = P^T dO
    dP = dO V^T
    dS = scale * P * (dP - delta),  delta = rowsum(dO * O)  (== rowsum(dP * P))
    dQ = dS K,      dK = dS^T Q

Its intermediates P (the forward's probs) and dS (the cotangent of the scores, scale
included) are named as the variants materialize them.
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

from moagen import reference
from moagen.kernels import attention
from moagen.kernels.attention import (CHECK_SIZES, HEAD_DIM_BOUNDS, KEY_BLOCK, ON_HEADS, K, Q, V,
                                      flash_tiles, softmax_scale)
from moagen.kernels.cases import Check, references
from moagen.kernels.chain import backward
from moagen.kernels.layers import Layers, cpu
from moagen.kernels.tunable import Tunable
from moagen.moa.expr import array, psi
from moagen.moa.grad import grad
from moagen.moa.rewrites import substitute
from moagen.moa.spec import KernelSpec
from moagen.onf.names import loop_role
from moagen.steps.algebra.causalrows import CausalRows
from moagen.steps.algebra.keyblocks import KeyBlocks
from moagen.steps.algebra.keytiles import ColumnTiles, KeyTiles
from moagen.steps.algebra.maskedblocks import MaskedBlocks
from moagen.steps.algebra.online import OnlineSoftmax
from moagen.steps.algebra.partials import PartBuffers
from moagen.steps.algebra.scatter import Scatter
from moagen.steps.gpu.blocks import BlockTiles, ThreadTiles, UnrollInner
from moagen.steps.gpu.partials import BlockPartials
from moagen.steps.gpu.staging import RegisterScratch, RegisterTile, SharedScratch, Stage
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.distribute import Distribute
from moagen.steps.loop.fission import Fission
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.interchange import BlockInterchange
from moagen.steps.loop.parallel import GpuThreads, Parallel
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.unroll import keys_summed, rows_together, tiled

O = array("O", "batch", "heads", "n", "d")
DO = array("dO", "batch", "heads", "n", "d")
LSE = array("lse", "batch", "heads", "n")
BH, EXTENTS = ("b", "h"), ("batch", "heads")
QUERY_ROWS, KEY_ROWS = ("b", "h", "i"), ("b", "h", "j")
WRT = {"Q": QUERY_ROWS + ("c",), "K": KEY_ROWS + ("c",), "V": KEY_ROWS + ("c",)}
INPUTS = (Q, K, V, O, DO, LSE)


# how the backward is derived (moagen.moa.grad; `moagen grad attention_fwd`): dO given for
# O, lse kept; the inputs in the order of the kernels' callers
VJP = {forward: dict(wrt=WRT, cotangents=("O",), order=tuple(a.name for a in INPUTS),
                     labels={"probs": "P", "dscores": "dS"})
       for forward in ("attention_fwd", "attention_fwd_causal")}


def spec(causal: bool, name=None) -> KernelSpec:
    """The vector-Jacobian product of attention_fwd[_causal]."""
    name = name or ("attention_bwd_causal" if causal else "attention_bwd")
    forward = attention.spec(causal)
    return grad(forward, name=name, **VJP[forward.name])


def gradients(q, k, v, o, do, lse, causal):
    """dQ, dK, dV of one head as MoA expressions: the derived backward's, with the head's
    Q, K, V, O, dO and lse read from these expressions (the fused kernel's O and lse are
    its own intermediates)."""
    given = {psi(BH, a): e for a, e in zip(INPUTS, (q, k, v, o, do, lse))}
    return tuple(substitute(out.value.body, given) for out in spec(causal).outputs)


# dQ rows belong to query rows, dK and dV rows to key rows: each nest is parallel over the
# rows it owns, so no thread writes another's output and no atomics are needed
OWNERS = (Parallel(QUERY_ROWS, nest="dQ"), Parallel(KEY_ROWS, nest="dK"),
          Parallel(KEY_ROWS, nest="dV"))
SPREAD = (Accumulate("c", over="j", nest="dQ"), Accumulate("c", over="i", nest="dK"),
          Accumulate("c", over="i", nest="dV"))
SCATTER_DK = Scatter("dK", over="i", outer=("b", "h"))
SCATTER_DQ = Scatter("dQ", over="j", outer=("b", "h"))


@dataclass(frozen=True)
class Rows:
    """The loops over a kernel's query and key rows, the head loops first (the same for
    both sides), and `group`: a loop over the query heads that share a key head
    (moagen.kernels.attention_gqa), which the key rows' sums run over too; None without."""
    heads: tuple = BH
    group: Optional[str] = None

    @property
    def query(self):
        return self.heads + ((self.group,) if self.group else ()) + ("i",)

    @property
    def key(self):
        return self.heads + ("j",)


def owner(rows, keys, parts, lanes, causal, block=None, loops=Rows(), scratch=None,
          queries=None, then=(), padded=False):
    """The backward by key rows that own their dK and dV rows (no atomics), the passes by
    blocks of the other side's rows (KeyBlocks: a block's probabilities one vector loop);
    in each pass `rows` query (or key) rows walk the other side together; the query rows'
    pass adds `keys` of its rows at a time into theirs.

    block None: the backward alone (this kernel), O and lse read, delta a pass of its own.
    block: the fused kernel's (attention_fwdbwd), a forward pass first that computes O, lse
    and delta in one pass over blocks of `block` keys (online softmax).

    lanes > 0: the products as register tiles `lanes` wide, the forward's in
    FlashAttention's form (flash_tiles, which also skips the causal kernel's key blocks past
    the diagonal), the backward's scores and dO V^T of the walking rows against `lanes` of
    the other side's (KeyTiles), and the key rows' dK and dV as tiles of their rows by
    `lanes` columns kept over a block of query rows (ColumnTiles): FlashAttention-2's
    backward. lanes = 0: one row of the other side at a time.

    parts > 0: no dQ pass. The key rows' pass adds each dS K into dQ as well (dQ scattered
    over keys, its dS shared with dK's), into one buffer per part of the keys of a head
    (PartBuffers), summed after: six n x n x d products instead of nine (the fused
    kernel's count), and the key rows' pass runs in parallel over heads and parts rather
    than over key rows; it sweeps the query blocks by blocks of 64 key rows
    (BlockInterchange).

    loops: the row loops (Rows); with a group, the key rows' sums over the group's query
    heads come first (dK and dV accumulate over them, then over each head's rows).

    scratch: on a GPU, the names of the backward's block scratch (gpu_flash_bwd's; None:
    BWD_SCRATCH, this kernel's). queries: on a GPU, the forward's thread block's query rows
    (gpu_flash's). then: steps the CPU's schedule takes last (a kernel's own).

    padded: the scores masked as `last >= j`, keys past a size last (attention_cross's
    padded keys): on the CPU the key rows' pass (lanes > 0) skips the query rows for its
    tiles past last (CausalRows: their dK and dV rows zeros), the dQ pass (a GPU's too) the
    key blocks past last's (MaskedBlocks)."""
    forward = block is not None
    query_rows, key_rows, heads = loops.query, loops.key, loops.heads
    scatter_dq = Scatter("dQ", over="j", outer=heads)
    over_group = tuple(Accumulate("c", over=loops.group, nest=n) for n in ("dK", "dV")) \
        if loops.group else ()
    algorithm = ((Accumulate("c", over="j", nest="O"),) if forward else ()) + over_group + (
        scatter_dq if parts else Accumulate("c", over="j", nest="dQ"),
        Accumulate("c", over="i", nest="dK"), Accumulate("c", over="i", nest="dV"))
    if forward:
        algorithm += (FuseNests(("O", "lse", "delta"), over=query_rows, name="forward"),)
    algorithm += (FuseNests(("dK", "dV", "dQ") if parts else ("dK", "dV"), over=key_rows,
                            name="keys"), Hoist())
    if forward:
        algorithm += (OnlineSoftmax("forward", block=block),)
    algorithm += (LowerReductions(),)
    passes = (("forward", query_rows, "j"),) if forward else ()
    if parts:
        key_blocks, split = KeyBlocks("keys", "i", KEY_BLOCK), PartBuffers("keys", "j", "dQ", parts)
        algorithm += (key_blocks, split)
        passes += (("keys", heads + (split.within,), "i"),)
        extra = (Parallel(heads + (split.part,), nest=split.zero),
                 Parallel(query_rows, nest=split.merge))
    else:
        algorithm += (KeyBlocks("dQ", "j", KEY_BLOCK), KeyBlocks("keys", "i", KEY_BLOCK))
        passes += (("dQ", query_rows, "j"), ("keys", key_rows, "i"))
        extra = ()
    if not forward:
        extra += (Parallel(query_rows, nest="delta"),)
    schedule, mapping = (), ()
    for nest, walking, other in passes:
        jammed = walking[-1]
        if nest == "forward" and lanes:
            # its output tiles stay in registers over a block's keys: no keys summed
            schedule += flash_tiles(nest, rows, lanes, causal)
        else:
            together = rows_together(nest, jammed, rows)
            schedule += keys_summed(nest, keys, loop=other) + together
            if nest == "keys" and lanes and (causal or padded):
                # each tile of key rows (and each key row after them) starts at the first
                # query rows that see its keys, on a whole register tile of them (past its
                # rows' end where padded and none does)
                align = math.lcm(lanes, keys)
                schedule += (CausalRows(nest, tiled(jammed, rows), other, align),
                             *(CausalRows(jam.edge, jammed, other, align) for jam in together))
            if nest == "dQ" and padded:
                # the key blocks past last's (no loop of rows: last is free of them)
                schedule += tuple(MaskedBlocks(n, loop_role(other, "blk"), rows="")
                                  for n in (nest, *(jam.edge for jam in together)))
        # with parts the key rows' pass is parallel over its parts, the rows inside them
        parallel = heads + (split.part,) if parts and nest == "keys" else \
            walking[:-1] + (tiled(jammed, rows),)
        # the forward's row tiles go to the threads in turn, as the flash variant's: a causal
        # tile sees more keys than the one before it (contiguous chunks left the second
        # thread three quarters of the work: 0.71 of the plain kernel's time at n 4096,
        # 0.59 interleaved)
        mapping += (Parallel(parallel, nest=nest, interleave=nest == "forward"),)
    if parts and rows < KEY_BLOCK:
        # blocks of 64 key rows sweep the query blocks together: a query block is read once
        # for them
        schedule += (BlockInterchange("keys", tiled(split.within, rows), key_blocks.blocks,
                                      KEY_BLOCK // rows),)
    if lanes:
        schedule += tuple(KeyTiles(nest, other, lanes) for nest, _, other in passes
                          if nest != "forward")
    # the key rows' additions into dK, dV (and dQ's part) a loop each
    schedule += (Distribute("c"),)
    if lanes:
        # and the loop over the query rows summed together holding them one loop each: dK's
        # and dV's become register tiles, a tile of the jammed key rows by `lanes` columns
        # kept in registers over a block's query rows, each query row's columns loaded once
        # for all the key rows (dQ's part is indexed by the query rows: it stays as it is)
        summed = tiled("i", keys)
        schedule += (Distribute(summed, nest="keys"), ColumnTiles("keys", summed, "c", lanes))
    if forward and not (parts or lanes or loops != Rows()):
        # the fused kernel on a GPU: the flash forward's blocks (delta with O, from its
        # registers), then the backward's two passes
        return Layers(algorithm, {"cpu": schedule + then, "cuda": (Distribute("c"), *PRODUCTS_APART)},
                      {"cpu": (*mapping, *extra),
                       "cuda": attention.gpu_flash("forward", 4, 4, block, causal,
                                                   queries=queries)
                               + gpu_flash_bwd(scratch=FWDBWD_SCRATCH, causal=causal)[1:]})
    if not (forward or parts or lanes):
        # on a GPU: FlashAttention-2's backward on thread blocks (gpu_flash_bwd); the CPU's
        # schedule and mapping as they are (OpenACC's too)
        return Layers(algorithm, {"cpu": schedule + then, "cuda": (Distribute("c"), *PRODUCTS_APART)},
                      {"cpu": (*mapping, *extra),
                       "cuda": gpu_flash_bwd(scratch=scratch or BWD_SCRATCH, causal=causal,
                                             loops=loops, padded=padded)})
    return Layers(algorithm, schedule + then, cpu(*mapping, *extra))


# on a GPU, each pass's products of a block one loop each (a key block's Q K^T apart from its
# dO V^T, dK += dS^T Q from dV += P^T dO), so that each loop reads two staged tiles, not four
PRODUCTS_APART = (Fission("j", nest="dQ"), Fission("i", nest="keys"))

# the block scratch KeyBlocks makes in the backward's dQ and keys passes: its names there
# (the keys pass's blocks of scores and dO V^T second, after the dQ pass's)
_KEYS_SECOND = {"qk2": "qk_block2", "dov2": "dov_block2"}
BWD_SCRATCH = {"dS": "t_block", "P2": "t2_block", "dS2": "t3_block", **_KEYS_SECOND}
# ... and in the fused kernel's, after the forward's pass took a name of its own
FWDBWD_SCRATCH = {"dS": "t2_block", "P2": "t3_block", "dS2": "t4_block", **_KEYS_SECOND}
# ... and in the dq_atomic variant's one pass
DQ_ATOMIC_SCRATCH = {"P2": "t2_block", "dS2": "t_block", "qk2": "qk_block", "dov2": "dov_block"}


# a backward pass's thread block on a GPU: 32 rows of its side. The atomic passes at
# float64 take 16: at 32 their tiles ask 173,632-190,528 bytes a block at d 128, over the
# 166,912 an sm_80 block may have (moagen.cuda_archs); at 16, 156,480-158,240
BWD_BLOCK = 32
ATOMIC_CUDA_DTYPES = {"float64": {"block": 16}}


def gpu_flash_bwd(rows=4, lanes=4, block=BWD_BLOCK, scratch=BWD_SCRATCH, causal=False,
                  loops=Rows(), padded=False):
    """FlashAttention-2's backward on a GPU, a pass per side (no atomics): a thread block
    per `block` rows of a head, block / rows x KEY_BLOCK / lanes threads, each a register
    tile of `rows` of the block's rows by `lanes` of the other side's (the scores, dO V^T:
    registers, the thread's own) or by `lanes` columns (its output rows, in registers over
    all the other side's blocks).

    dQ: gpu_query_rows; keys: gpu_key_rows (float64 at d 128: 106 KB of shared memory a
    block, either pass); delta: a GPU thread per query row. Causal: each pass skips the
    blocks of the other side no row of its tile sees (MaskedBlocks). loops (Rows): the
    grouped-query kernel's, its dQ grid folding a group's query heads into one axis, its key
    tiles a KV head's, walking the group's query heads inside. padded (owner's): the dQ pass
    stops at the last key's block (MaskedBlocks); the key rows' pass walks every query block
    (MaskedBlocks takes no mask free of both sides' rows)."""
    return (GpuThreads(loops.query, nest="delta"),
            *gpu_query_rows("dQ", rows, lanes, block, scratch["dS"], causal=causal or padded,
                            loops=loops),
            *gpu_key_rows("keys", rows, lanes, block, scratch, causal, loops=loops))


def gpu_key_rows(nest, rows, lanes, block, scratch, causal=False, dq=False, loops=Rows()):
    """The key rows' pass of a backward on a GPU (gpu_flash_bwd's): a thread block per
    `block` key rows of a head, dK and dV in registers over all the query blocks. Each query
    block's tiles staged as its products need them, each taking the memory of the ones read
    before it: K's and Q's (by rows) for the scores, then V's and dO's for dO V^T, then P
    and dS (the block scratch `scratch` names) and dO and Q again, laid out by columns for
    dV += P^T dO and dK += dS^T Q. Only a product's two operands are live at once: 106 KB a
    block at float64, d 128, two blocks an SM (K, V, Q and dO together: 208 KB, one).

    dq: the pass adds dS K into dQ too, by atomics (the dq_atomic variant): the block's
    dS K summed over its key rows first (block_partials), one atomic addition per element
    of a query block's dQ tile; K's tile then stays live to the end of a query block, and
    dS is laid out with its query rows fastest, for the sums. Causal: the query blocks
    before the tile's first key not visited."""
    query_blocks = loop_role("i", "blk")
    return (BlockTiles(loops.key, rows=block, bounds=HEAD_DIM_BOUNDS, nest=nest),
            *_skipped(causal, nest, query_blocks, "j"),
            *attention.thread_tiles(nest, "j", "i", rows, lanes, KEY_BLOCK // lanes),
            RegisterTile("dK", nest=nest), RegisterTile("dV", nest=nest),
            RegisterScratch(scratch["qk2"], nest=nest),
            RegisterScratch(scratch["dov2"], nest=nest),
            Stage("K", at=query_blocks, nest=nest),
            Stage("Q", at=query_blocks, by="i", nest=nest),
            Stage("V", at=query_blocks, late=True, nest=nest),
            Stage("dO", at=query_blocks, by="i", late=True, nest=nest),
            Stage("lse", at=query_blocks, nest=nest),
            Stage("delta", at=query_blocks, nest=nest),
            SharedScratch(scratch["P2"], fastest="j", nest=nest),
            SharedScratch(scratch["dS2"], fastest="i" if dq else "j", nest=nest),
            Stage("Q", at=query_blocks, by="c", late=True, nest=nest),
            Stage("dO", at=query_blocks, by="c", late=True, nest=nest),
            *(block_partials(nest, ("dQ",), "j", rows, lanes, block) if dq else ()))


def block_partials(nest, arrays, rows, tile, lanes, block, whole=()):
    """A block's atomic additions into `arrays` summed over its `rows` first (BlockPartials:
    one atomic addition per element of a block's tile, FlashAttention-2's dQ), the sums'
    tile (the other side's rows by the columns) over the block's threads as the pass's
    are laid out: `tile` rows each along y, `lanes` columns each along x, each thread a
    register tile of them, a piece of `block` rows by KEY_BLOCK columns at a time (a whole
    query block's spilled in float64 at d 128 beside dK's and dV's tiles); the sum over
    the rows unrolled by 4 (64 FMA a back-edge). After the pass's tiles are placed, its
    scratch dS laid out with the sums' rows fastest: a thread's rows of it, as its columns
    of K, 128-bit loads, 4 FMA a shared load in float64, 8 in float32. whole: the arrays
    whose sums take all the columns at once (an operand's tile staged after them, which
    spans one range of the columns)."""
    return (*(BlockPartials(a, rows, pieces=(block, 0 if a in whole else KEY_BLOCK), nest=nest)
              for a in arrays),
            ThreadTiles(_other(rows), tile, "y", threads=block // tile, nest=nest),
            ThreadTiles("c", lanes, "x", threads=KEY_BLOCK // lanes, nest=nest),
            UnrollInner(rows, 4, nest=nest))


def _other(rows):
    """The other side's rows: i for j, j for i."""
    return {"i": "j", "j": "i"}[rows]


def _skipped(causal, nest, blocks, rows):
    """A causal pass's blocks of the other side that no row of a thread block sees left
    out."""
    return (MaskedBlocks(nest, blocks, rows=rows),) if causal else ()


def gpu_query_rows(nest, rows, lanes, block, ds, p=None, causal=False, loops=Rows(),
                   atomic=()):
    """The query rows' pass of a backward on a GPU: a thread block per `block` query rows of
    a head, block / rows x KEY_BLOCK / lanes threads, dQ in registers over all the key
    blocks. lse's and delta's tiles staged once; each key block's tiles as its products
    need them, each taking the memory of the ones read before it: Q's and K's for the
    scores, dO's and V's for dO V^T, then the block's dS (the scratch `ds`) and K again,
    laid out by columns for dQ += dS K. Q and dO are copied again for every key block (from
    L2: they are the block's own) so that only a product's two operands are live at once:
    106 KB a block at float64, d 128, two blocks an SM (Q, dO, K and V together: 208 KB,
    one). p: the block's P too (the fused atomic kernel's pass adds P^T dO into dV). Causal:
    the key blocks past the block's last row not visited.

    atomic: the outputs the pass adds into by atomics (the atomic variants' dK, and the
    fused kernel's dV), each block's share summed over its query rows first
    (block_partials), one atomic addition per element of a key block's tile; dS (and P)
    then laid out with its keys fastest, for those sums, and dV's sums read dO from a tile
    of their own, laid out by columns (staged after them, as dO V^T's by rows then)."""
    key_blocks = loop_role("j", "blk")
    sums_dv = "dV" in atomic
    do_tiles = (Stage("dO", at=key_blocks, by="c", late=True, nest=nest),
                Stage("dO", at=key_blocks, by="i" if sums_dv else "", late=True, nest=nest))
    return (BlockTiles(loops.query, rows=block, bounds=HEAD_DIM_BOUNDS, nest=nest),
            *_skipped(causal, nest, key_blocks, "i"),
            *attention.thread_tiles(nest, "i", "j", rows, lanes, KEY_BLOCK // lanes),
            RegisterTile("dQ", nest=nest),
            RegisterScratch("qk_block", nest=nest), RegisterScratch("dov_block", nest=nest),
            Stage("lse", at="i", nest=nest), Stage("delta", at="i", nest=nest),
            Stage("Q", at=key_blocks, nest=nest), Stage("K", at=key_blocks, by="j", nest=nest),
            *(() if sums_dv else do_tiles[1:]),
            Stage("V", at=key_blocks, late=True, nest=nest),
            SharedScratch(ds, fastest="j" if atomic else "i", nest=nest),
            *((SharedScratch(p, fastest="j" if sums_dv else "i", nest=nest),) if p else ()),
            Stage("K", at=key_blocks, by="c", late=True, nest=nest),
            *(block_partials(nest, atomic, "i", rows, lanes, block, whole=("dV",))
              if atomic else ()),
            *(do_tiles if sums_dv else ()))


def gpu_key_rows_dv(nest, rows, lanes, block, scratch):
    """dV's own pass on a GPU (the atomic backward's: dK by atomics in the query rows'):
    a thread block per `block` key rows of a head, block / rows x KEY_BLOCK / lanes
    threads, dV in registers over all the query blocks; K's tile staged once, each query
    block's Q (by its rows), lse and dO (by columns, for dV += P^T dO), the block's P (the
    block scratch `scratch` names, as the keys pass's) in shared memory."""
    query_blocks = loop_role("i", "blk")
    return (BlockTiles(KEY_ROWS, rows=block, bounds=HEAD_DIM_BOUNDS, nest=nest),
            *attention.thread_tiles(nest, "j", "i", rows, lanes, KEY_BLOCK // lanes),
            RegisterTile("dV", nest=nest), RegisterScratch(scratch["qk2"], nest=nest),
            Stage("K", at="j", nest=nest),
            Stage("Q", at=query_blocks, nest=nest), Stage("lse", at=query_blocks, nest=nest),
            Stage("dO", at=query_blocks, nest=nest),
            SharedScratch(scratch["P2"], fastest="j", nest=nest))


# the owner's parameters (the fused kernel's add the forward's `block`): on a CPU dQ comes
# from the key rows' pass, in one part (the heads already feed the threads), and every
# product is a register tile of `rows` rows by `lanes` lanes: float64 6 x 8 (a row in two
# AVX2 vector registers; 8 x 16 on AVX-512), float32 6 x 16 on AVX2 (8 x 32 on AVX-512)
# (docs/PERFORMANCE.md, "The owner and the flash backward"). The key rows' pass adds one
# query row at a time (keys 1): with two, gcc 12 computed each pair of terms the dK and dV
# tiles add as a multiply, a multiply-add and an add (the same section). On
# a GPU dQ keeps its pass (parts 0): that pass runs a thread per query row, the parts only
# one per part of a head's keys; a thread walks the other side a row at a time (lanes 0)
OWNER_DEFAULTS = {"rows": 6, "keys": 1, "parts": 1, "lanes": 8}
OWNER_DTYPES = {"float32": {"lanes": 16}}
OWNER_AVX512 = {"float64": {"rows": 8, "lanes": 16}, "float32": {"rows": 8, "lanes": 32}}
OWNER_SPACE = {"rows": (4, 6, 8), "keys": (1, 2, 4), "parts": (0, 1), "lanes": (0, 8, 16, 32)}
OWNER_CUDA = {"rows": 4, "keys": 4, "parts": 0, "lanes": 0}


def variants(causal: bool):
    """The variants of the plain or the causal kernel."""
    return {
        # the n x n P and dS go to memory, as a framework's backward does
        "naive": (frozenset({"P", "dS", "delta"}), Layers(
            algorithm=(Hoist(),),
            mapping=cpu(*(Parallel(QUERY_ROWS, nest=n) for n in ("P", "dS", "delta")), *OWNERS))),
        # each softmax row recomputed from Q, K and lse; only delta (one number a row) is stored
        "dnf": (frozenset({"delta"}), Layers(algorithm=SPREAD + (Hoist(),),
                                             mapping=cpu(Parallel(QUERY_ROWS, nest="delta"),
                                                         *OWNERS))),
        # dQ and dK in one pass over query rows, dK's updates atomic: the separate backward
        # the fused kernel's atomics are counted against
        "atomic": Tunable(frozenset({"delta"}), atomic, defaults={}, space={},
                          cuda={"block": BWD_BLOCK}, cuda_dtypes=ATOMIC_CUDA_DTYPES),
        # FlashAttention-2's backward in its first form: one pass over key rows, which own
        # dK and dV and add their share of dQ by atomics (no dQ pass)
        "dq_atomic": Tunable(frozenset({"delta"}), partial(dq_atomic, causal), defaults={},
                             space={}, cuda={"block": BWD_BLOCK},
                             cuda_dtypes=ATOMIC_CUDA_DTYPES),
        # FlashAttention-2's backward: key rows own dK and dV, the score and dO V^T blocks
        # register tiles; O and lse read, not recomputed (the fused kernel's owner
        # recomputes them in a forward pass of its own)
        "flash": flash_variant(causal),
    }


def atomic(block=BWD_BLOCK) -> Layers:
    """dQ and dK in one pass over query rows, dK's updates atomic. On a GPU that pass on the
    dQ pass's block tiles (gpu_query_rows), dV's own on key tiles (gpu_key_rows_dv), each a
    thread block per `block` rows."""
    return Layers(
        algorithm=(Accumulate("c", over="j", nest="dQ"), Accumulate("c", over="i", nest="dV"),
                   SCATTER_DK, FuseNests(("dQ", "dK"), over=QUERY_ROWS, name="rows"), Hoist()),
        schedule={"cpu": (),
                  "cuda": (LowerReductions(), KeyBlocks("rows", "j", KEY_BLOCK),
                           KeyBlocks("dV", "i", KEY_BLOCK), Distribute("c"),
                           Fission("j", nest="rows"))},
        mapping={"cpu": (Parallel(QUERY_ROWS, nest="delta"), Parallel(QUERY_ROWS, nest="rows"),
                         Parallel(KEY_ROWS, nest=SCATTER_DK.zero),
                         Parallel(KEY_ROWS, nest="dV")),
                 "cuda": (GpuThreads(QUERY_ROWS, nest="delta"),
                          *gpu_query_rows("rows", 4, 4, block, BWD_SCRATCH["dS"],
                                          atomic=("dK",)),
                          GpuThreads(KEY_ROWS, nest=SCATTER_DK.zero),
                          *gpu_key_rows_dv("dV", 4, 4, block, BWD_SCRATCH))})


def dq_atomic(causal: bool, block=BWD_BLOCK) -> Layers:
    """The key rows' pass alone, dQ scattered over the keys: B H n^2 d atomic adds, against
    the flash variant's dQ pass (a third recomputation of the scores and dO V^T). On a CPU
    parallel over key rows (omp atomic); on a GPU gpu_key_rows' blocks of `block` key rows,
    each adding its dS K into dQ from its tiles, summed over its key rows first
    (FlashAttention-2's dQ: B H n^2 d / block atomic adds). Causal: the second pass's
    blocks no key row sees skipped."""
    algorithm = (SCATTER_DQ, Accumulate("c", over="i", nest="dK"),
                 Accumulate("c", over="i", nest="dV"),
                 FuseNests(("dK", "dV", "dQ"), over=KEY_ROWS, name="keys"), Hoist())
    return Layers(
        algorithm,
        schedule={"cpu": (), "cuda": (LowerReductions(), KeyBlocks("keys", "i", KEY_BLOCK),
                                      Distribute("c"), Fission("i", nest="keys"))},
        mapping={"cpu": (Parallel(QUERY_ROWS, nest="delta"),
                         Parallel(QUERY_ROWS, nest=SCATTER_DQ.zero),
                         Parallel(KEY_ROWS, nest="keys")),
                 "cuda": (GpuThreads(QUERY_ROWS, nest="delta"),
                          GpuThreads(QUERY_ROWS, nest=SCATTER_DQ.zero),
                          *gpu_key_rows("keys", 4, 4, block, DQ_ATOMIC_SCRATCH, causal,
                                        dq=True))})


def flash_variant(causal: bool, loops=Rows(), scratch=None, then=(), padded=False) -> Tunable:
    """The flash variant (the owner alone) over the row loops `loops`; scratch, then,
    padded: owner's."""
    return Tunable(frozenset({"delta"}), partial(owner, causal=causal, loops=loops,
                                                 scratch=scratch, then=then, padded=padded),
                   defaults=OWNER_DEFAULTS, space=OWNER_SPACE, cuda=OWNER_CUDA,
                   dtypes=OWNER_DTYPES, avx512=OWNER_AVX512)


SPECS = (spec(False), spec(True))
KERNELS = [(s, variants(causal)) for s, causal in zip(SPECS, (False, True))]
# the names a derived backward has (moagen.kernels.ALIASES)
ALIASES = {"attention_fwd_vjp": "attention_bwd",
           "attention_fwd_causal_vjp": "attention_bwd_causal"}
# a stage's backward in a composite (moagen.kernels.chain)
CHAIN = {attention.spec(causal).name: backward(attention.spec(causal), by, "flash")
         for causal, by in zip((False, True), SPECS)}


def forward_of(causal, forward=reference.attention_fwd_numpy):
    """The backward's O and lse, computed from its Q, K and V in float64 by `forward`, given
    the call's scalars and given sizes (a causal mask's offset) by name."""
    def consistent(arrays, scalars):
        Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
        O, lse = forward(Q, K, V, causal=causal, **scalars)
        return dict(arrays, O=O, lse=lse)
    return consistent


# what verification and the benchmarks run these kernels on (moagen.kernels.cases)
CASES = (("attention_bwd", False), ("attention_bwd_causal", True))
CHECKS = {name: Check(references(reference.attention_bwd_numpy, reference.attention_bwd_torch,
                                 causal=causal), CHECK_SIZES, softmax_scale,
                      inputs=forward_of(causal))
          for name, causal in CASES}
BENCH = {name: ON_HEADS.measured_against(
             "sdpa_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention, the "
                         "forward recomputed (O, lse unused)", causal=causal)
         for name, causal in CASES}
