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
from functools import partial

from moagen import reference
from moagen.kernels import attention
from moagen.kernels.attention import (CHECK_SIZES, KEY_BLOCK, ON_HEADS, K, Q, V, softmax_parts,
                                      softmax_scale)
from moagen.kernels.attention_bwd import (BH, DO, EXTENTS, KEY_ROWS, OWNER_AVX512, OWNER_CUDA,
                                          OWNER_DEFAULTS, OWNER_DTYPES, OWNER_SPACE, QUERY_ROWS,
                                          gradients, gpu_query_rows, owner)
from moagen.kernels.cases import Check, references
from moagen.kernels.layers import Layers
from moagen.kernels.tunable import Tunable
from moagen.moa.expr import inner, lift, log, named, omega, psi
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.algebra.keyblocks import KeyBlocks
from moagen.steps.algebra.online import OnlineSoftmax
from moagen.steps.algebra.scatter import Scatter
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.distribute import Distribute
from moagen.steps.loop.fission import Fission
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import GpuThreads, Parallel
from moagen.steps.loop.reductions import LowerReductions


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


dK_dV_SCATTERED = (Scatter("dK", over="i", outer=("b", "h")),
                   Scatter("dV", over="i", outer=("b", "h")))
# the block scratch KeyBlocks makes in the atomic kernel's second pass (the forward's scores
# took the first name): its names there
ATOMIC_SCRATCH = {"dS": "t2_block", "P": "t3_block"}


def atomic(causal: bool, queries=KEY_BLOCK) -> Layers:
    """The fused kernel with atomics: the forward (O, lse and delta per query row, online
    softmax over blocks of 64 keys), then a pass over query rows that recomputes each row's
    probabilities, keeps its dQ row and adds its share of every key row's dK and dV: one
    atomic add per (b, h, i, j, c) and output, 2 B H n^2 d in all. On a CPU both passes are
    parallel over query rows (omp atomic). On a GPU the forward is gpu_flash's blocks and
    the second pass gpu_query_rows' (dQ in registers), its P in shared memory of its own
    beside dS for the atomic adds into dV; causal, the forward skips the key blocks past a
    thread block's rows, the second pass selects. queries: the query rows of the forward's
    thread block; the second pass's takes half as many (its four tiles, Q, K, dO and V,
    against the forward's three)."""
    algorithm = (Accumulate("c", over="j", nest="O"), Accumulate("c", over="j", nest="dQ"),
                 *dK_dV_SCATTERED,
                 FuseNests(("O", "lse", "delta"), over=QUERY_ROWS, name="forward"),
                 FuseNests(("dQ", "dK", "dV"), over=QUERY_ROWS, name="rows"), Hoist(),
                 OnlineSoftmax("forward", block=KEY_BLOCK), LowerReductions(),
                 KeyBlocks("rows", "j", KEY_BLOCK))
    zeroed = tuple(s.zero for s in dK_dV_SCATTERED)  # dK and dV cleared before the adds
    on_cpu = (Parallel(QUERY_ROWS, nest="forward"), Parallel(QUERY_ROWS, nest="rows"),
              *(Parallel(KEY_ROWS, nest=z) for z in zeroed))
    on_gpu = (*attention.gpu_flash("forward", 4, 4, KEY_BLOCK, causal, queries=queries),
              *gpu_query_rows("rows", 4, 4, queries // 2, ATOMIC_SCRATCH["dS"],
                              p=ATOMIC_SCRATCH["P"], atomic=("dK", "dV")),
              *(GpuThreads(KEY_ROWS, nest=z) for z in zeroed))
    return Layers(algorithm, schedule={"cpu": (), "cuda": (Distribute("c"),
                                                           Fission("j", nest="rows"))},
                  mapping={"cpu": on_cpu, "cuda": on_gpu})


def variants(causal: bool):
    """The variants of the plain or the causal kernel. The owner is attention_bwd's flash
    with a forward pass before it (attention_bwd.owner, its parameters), which on a CPU
    walks blocks of 32 keys in the causal kernel, so that fewer of its scores are on the
    diagonal blocks that select (docs/PERFORMANCE.md, "Causal kernels"); the causal owner
    skips the key blocks past each query tile in its forward, the query rows before each
    key tile in its key rows' pass."""
    return {"atomic": Tunable(frozenset({"delta"}), partial(atomic, causal), defaults={},
                              space={}, cuda=attention.FLASH_QUERIES,
                              cuda_dtypes=attention.FLASH_CUDA_DTYPES),
            "owner": Tunable(frozenset({"delta"}), partial(owner, causal=causal),
                             defaults={**OWNER_DEFAULTS, "block": 32 if causal else KEY_BLOCK},
                             # 72 candidates: each build of a tiled owner takes ~11 s
                             space=OWNER_SPACE,
                             cuda={**OWNER_CUDA, "block": KEY_BLOCK, **attention.FLASH_QUERIES},
                             cuda_dtypes=attention.FLASH_CUDA_DTYPES,
                             dtypes=OWNER_DTYPES, avx512=OWNER_AVX512)}


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
