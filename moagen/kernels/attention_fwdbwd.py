"""Fused attention forward + backward: from Q, K, V and dO, one call computes O, the per-row
logsumexp and dQ, dK, dV, keeping memory O(n d): each softmax row is recomputed, never
stored. Two ONFs of the same DNF:

- atomic: parallel over (batch, head, query row); every row adds its share to every key
  row of dK and dV, so those updates are atomic (the paper's measured regression);
- owner: the forward (one pass, online softmax) and delta per query row; then dK and dV
  parallel over key rows, each thread owning its rows (no atomics); then dQ in a second
  pass over query rows. No atomics at all, so the result does not depend on thread
  timing. Each pass walks the other side with a few rows at once (UnrollJam); the backward
  passes walk it by blocks of 64 rows (KeyBlocks), a block's probabilities one vector loop.
  With parts > 0 (a schedule parameter) dQ has no pass of its own: the key
  rows' pass adds dS K into one buffer per part of the keys, summed after (PartBuffers);
  the number of parts, not of threads, fixes the order of the additions; blocks of 64 key
  rows sweep the query rows together, so that each query block is read once per key block
  (BlockInterchange), not once per few key rows. With lanes > 0 (the CPU's form) every
  product is a register tile: the forward in FlashAttention's form (attention.flash_tiles,
  the causal kernel's key blocks past the diagonal skipped), and the key rows' scores and
  dO V^T against `lanes` query rows at a time (KeyTiles over the query rows, Q and dO packed
  in panels), FlashAttention-2's backward tiles.
"""
import math
from functools import partial

from moagen import reference
from moagen.kernels.attention import (CHECK_SIZES, KEY_BLOCK, ON_HEADS, K, Q, V, flash_tiles,
                                      softmax_parts, softmax_scale)
from moagen.kernels.attention_bwd import BH, DO, EXTENTS, gradients
from moagen.kernels.cases import Check, references
from moagen.kernels.layers import Layers, cpu
from moagen.kernels.tunable import Tunable
from moagen.moa.expr import inner, lift, log, named, omega, psi
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.causalrows import CausalRows
from moagen.onf.fusion import FuseNests, Scatter
from moagen.onf.interchange import BlockInterchange
from moagen.onf.keyblocks import KeyBlocks
from moagen.onf.keytiles import KeyTiles
from moagen.onf.online import OnlineSoftmax
from moagen.onf.partials import PartBuffers
from moagen.onf.reductions import LowerReductions
from moagen.onf.schedule import Accumulate, Distribute, Hoist, Parallel
from moagen.onf.unroll import keys_summed, rows_together, tiled


def _one_head(q, k, v, do, causal):
    row_max, weights, row_sum = softmax_parts(q, k, causal)
    o = named("O", inner(omega("/", weights, row_sum), v, var="j", name="acc"), index=("i", "c"))
    lse = named("lse", row_max + log(row_sum), index=("i",))
    return (o, lse) + gradients(q, k, v, o, do, lse, causal)


def spec(causal: bool) -> KernelSpec:
    o, lse, dq, dk, dv = _one_head(*(psi(BH, a) for a in (Q, K, V, DO)), causal)
    rows, keys = ("b", "h", "i", "c"), ("b", "h", "j", "c")
    return KernelSpec(
        name="attention_fwdbwd_causal" if causal else "attention_fwdbwd",
        inputs=(Q, K, V, DO),
        scalars=("scale",),
        outputs=(Output("O", lift(BH, EXTENTS, o), rows),
                 Output("lse", lift(BH, EXTENTS, lse), ("b", "h", "i")),
                 Output("dQ", lift(BH, EXTENTS, dq), rows),
                 Output("dK", lift(BH, EXTENTS, dk), keys),
                 Output("dV", lift(BH, EXTENTS, dv), keys)),
    )


QUERY_ROWS, KEY_ROWS = ("b", "h", "i"), ("b", "h", "j")


def _owner(rows, keys, parts, lanes, block, causal):
    """The forward in one pass over blocks of `block` keys (online softmax), the backward
    nests by blocks of the other side's rows (KeyBlocks: a block's probabilities one vector
    loop); in each of the three nests `rows` query (or key) rows walk the other side
    together; the query rows' nests add `keys` of its rows at a time into theirs.

    lanes > 0: the products as register tiles `lanes` wide, the forward's in
    FlashAttention's form (flash_tiles, which also skips the causal kernel's key blocks past
    the diagonal), the backward's scores and dO V^T of the walking rows against `lanes` of
    the other side's (KeyTiles). lanes = 0: one row of the other side at a time.

    parts > 0: no dQ pass. The key rows' pass adds each dS K into dQ as well (dQ scattered
    over keys, its dS shared with dK's), into one buffer per part of the keys of a head
    (PartBuffers), summed after: six n x n x d products instead of nine, and the key rows'
    pass runs in parallel over heads and parts rather than over key rows; it sweeps the
    query blocks by blocks of 64 key rows (BlockInterchange)."""
    scatter_dq = Scatter("dQ", over="j", outer=("b", "h"))
    algorithm = (Accumulate("c", over="j", nest="O"),
                 scatter_dq if parts else Accumulate("c", over="j", nest="dQ"),
                 Accumulate("c", over="i", nest="dK"), Accumulate("c", over="i", nest="dV"),
                 FuseNests(("O", "lse", "delta"), over=QUERY_ROWS, name="forward"),
                 FuseNests(("dK", "dV", "dQ") if parts else ("dK", "dV"), over=KEY_ROWS,
                           name="keys"),
                 Hoist(), OnlineSoftmax("forward", block=block), LowerReductions())
    if parts:
        key_blocks, split = KeyBlocks("keys", "i", KEY_BLOCK), PartBuffers("keys", "j", "dQ", parts)
        algorithm += (key_blocks, split)
        passes = (("forward", QUERY_ROWS, "j"), ("keys", ("b", "h", split.within), "i"))
        extra = (Parallel(("b", "h", split.part), nest=split.zero),
                 Parallel(QUERY_ROWS, nest=split.merge))
    else:
        algorithm += (KeyBlocks("dQ", "j", KEY_BLOCK), KeyBlocks("keys", "i", KEY_BLOCK))
        passes = (("forward", QUERY_ROWS, "j"), ("dQ", QUERY_ROWS, "j"), ("keys", KEY_ROWS, "i"))
        extra = ()
    schedule, mapping = (), ()
    for nest, loops, other in passes:
        jammed = loops[-1]
        if nest == "forward" and lanes:
            # its output tiles stay in registers over a block's keys: no keys summed
            schedule += flash_tiles(nest, rows, lanes, causal)
        else:
            together = rows_together(nest, jammed, rows)
            schedule += keys_summed(nest, keys, loop=other) + together
            if nest == "keys" and lanes and causal:
                # each tile of key rows (and each key row after them) starts at the first
                # query rows that see its keys, on a whole register tile of them
                align = math.lcm(lanes, keys)
                schedule += (CausalRows(nest, tiled(jammed, rows), other, align),
                             *(CausalRows(jam.edge, jammed, other, align) for jam in together))
        # with parts the key rows' pass is parallel over its parts, the rows inside them
        parallel = ("b", "h", split.part) if parts and nest == "keys" else \
            loops[:-1] + (tiled(jammed, rows),)
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
        schedule += tuple(KeyTiles(nest, other, lanes) for nest, _, other in passes[1:])
    # the key rows' additions into dK, dV (and dQ's part) a loop each
    schedule += (Distribute("c"),)
    return Layers(algorithm, schedule, cpu(*mapping, *extra))


dK_dV_SCATTERED = (Scatter("dK", over="i", outer=("b", "h")),
                   Scatter("dV", over="i", outer=("b", "h")))
ATOMIC = (frozenset(), Layers(
    algorithm=(Accumulate("c", over="j", nest="O"), Accumulate("c", over="j", nest="dQ"),
               *dK_dV_SCATTERED,
               FuseNests(("O", "lse", "dQ", "dK", "dV"), over=QUERY_ROWS, name="rows"),
               Hoist()),
    mapping=cpu(Parallel(QUERY_ROWS, nest="rows"),
                *(Parallel(KEY_ROWS, nest=s.zero) for s in dK_dV_SCATTERED))))


def variants(causal: bool):
    """The variants of the plain or the causal kernel (on a CPU the causal owner skips the
    key blocks past each query tile in its forward, the query rows before each key tile in
    its key rows' pass).

    On a CPU dQ comes from the key rows' pass, in one part (the heads already feed the
    threads), and every product is a register tile of 8 rows by 16 lanes (two float64
    vector registers, one of float32: 32 float32 lanes ran 10% faster at n 1024, d 64, the
    same causal, and took twice as long to build, C 20 s against 11); the causal forward
    walks blocks of 32 keys, so that fewer of its scores are on the diagonal blocks that
    select (docs/PERFORMANCE.md, "The owner in FlashAttention's form"). On a GPU dQ keeps its pass (parts 0): that pass runs a thread
    per query row, the parts only one per part of a head's keys; a thread walks the other
    side a row at a time (lanes 0)."""
    return {"atomic": ATOMIC,
            "owner": Tunable(frozenset({"delta"}), partial(_owner, causal=causal),
                             defaults={"rows": 8, "keys": 2, "parts": 1, "lanes": 16,
                                       "block": 32 if causal else KEY_BLOCK},
                             # 36 candidates: each build of a tiled owner takes ~20 s
                             space={"rows": (4, 8), "keys": (1, 2, 4), "parts": (0, 1),
                                    "lanes": (0, 16, 32)},
                             cuda={"rows": 4, "keys": 4, "parts": 0, "lanes": 0,
                                   "block": KEY_BLOCK})}


KERNELS = [(spec(False), variants(False)), (spec(True), variants(True))]

# what verification and the benchmarks run these kernels on (moagen.kernels.cases)
CHECKS = {name: Check(references(reference.attention_fwdbwd_numpy,
                                 reference.attention_fwdbwd_torch, causal=causal),
                      CHECK_SIZES, softmax_scale)
          for name, causal in (("attention_fwdbwd", False), ("attention_fwdbwd_causal", True))}
BENCH = {name: ON_HEADS.measured_against(
             "sdpa_fwdbwd", "O by F.scaled_dot_product_attention, dQ, dK, dV by its autograd; "
                            "no lse (SDPA returns none)", outputs=(0, 2, 3, 4), causal=causal)
         for name, causal in (("attention_fwdbwd", False), ("attention_fwdbwd_causal", True))}
