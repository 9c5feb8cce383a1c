"""Attention over a packed batch of sequences of different lengths (FlashAttention's varlen
form, #54 item 1): the queries of every sequence in one array Q (total_q, kv_heads, group,
d), their keys and values in K, V (total_k, kv_heads, d), and the int64 offsets cu_q, cu_k
(batch + 1 entries, as cu_seqlens): sequence b is query rows cu_q[b] .. cu_q[b+1] - 1 and
key rows cu_k[b] .. cu_k[b+1] - 1. O (total_q, kv_heads, group, d) and lse (total_q,
kv_heads, group) are stored packed as Q. Grouped-query heads as attention_gqa (a query
head of kv head g, index r in its group; MHA is a group of one): the caller's (total_q,
heads, d) is Q with heads = kv_heads * group split, no copy.

Each sequence is attention_cross's head written over the sequence's rows: the offsets'
entries are index expressions (moagen.moa.expr.element: cu_q(b)), so that a sequence's
query and key loops run over its own rows, their bounds read from the offsets, and no
other sequence's key is visited (moagen.moa.spec.Packed stores its rows).

Causal (`_causal`): bottom-right within each sequence, as FlashAttention's varlen: query i
of a sequence of n_q queries and n_k keys sees keys j <= i + n_k - n_q. A query that sees
no key (i < n_q - n_k causal; any query of a sequence with no keys) gets O = 0 and lse =
-inf, as FlashAttention gives them; a sequence of no queries writes nothing.

The backward (`attention_varlen_bwd`, `_causal`) is derived by moagen.moa.grad: dQ packed
by cu_q, dK and dV by cu_k (summed over the group's query heads), read back O and lse as
the forward stores them; a row that saw no key gets zero gradients (its lse -inf floored
as the max was: P = 0).

Variants: dnf (row by row; every target, forward and backward) and the forward's flash
(attention's FlashAttention form: one pass over a row's keys in blocks, row tiles and
register tiles; C and Fortran only). The flash steps take a sequence's loops, their extents
read from the offsets: the running max starts at the floor and O is divided by max(l, 1)
(OnlineSoftmax), the scores' scratch rows are the packed rows
(moagen.onf.loops.scratch_row), K is read from panels whose tiles start at each sequence's
first key (KeyTiles), and causal's row tiles stop at their last row's last key
(CausalBlocks; a row may see none, the floored max keeping the skipped blocks no-ops). CUDA
and OpenACC take dnf only: a grid over each sequence's query tiles needs the longest
sequence as a size given at call time."""
import numpy as np

from moagen import reference
from moagen.kernels import attention
from moagen.kernels.attention import one_head, row_pass, softmax_scale
from moagen.kernels.cases import Bench, Check, references
from moagen.kernels.layers import Layers
from moagen.moa.expr import array, drop, element, iota, lift, offsets, outer, sym, where
from moagen.moa.grad import grad
from moagen.moa.spec import KernelSpec, Output, Packed
from moagen.steps.algebra.maskedkeys import MaskedKeys
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.gpu_blocks import GpuBlocks
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import Parallel

Q = array("Q", "total_q", "kv_heads", "group", "d")
K = array("K", "total_k", "kv_heads", "d")
V = array("V", "total_k", "kv_heads", "d")
CU_Q = offsets("cu_q", "batch", "total_q")
CU_K = offsets("cu_k", "batch", "total_k")
# the loops: a sequence's heads, then its query rows (their extent the sequence's, read from
# cu_q: only the loops outside it run in parallel, a collapsed nest being rectangular)
SEQUENCE = "b"  # the index of a sequence of the batch
HEADS = (SEQUENCE, "g", "r")
ROWS = HEADS + ("i",)
KV_HEADS = (SEQUENCE, "g")  # the backward's dK and dV: a KV head's, summed over its group
KEY_ROWS = KV_HEADS + ("j",)


def _extent(offsets_):
    """Sequence b's rows: offsets(b + 1) - offsets(b)."""
    return element(offsets_, sym(SEQUENCE) + 1) - element(offsets_, SEQUENCE)


def _seen_mask(n_q, n_k):
    """Bottom-right causal: key j past query i's position i + n_k - n_q gets -inf."""
    positions = drop(n_k - n_q, iota(n_k))
    return lambda scores: where(outer(">=", positions, iota(n_k)), scores, float("-inf"))


def spec(causal: bool) -> KernelSpec:
    n_q, n_k = _extent(CU_Q), _extent(CU_K)
    queries, keys = Packed(SEQUENCE, "i", CU_Q), Packed(SEQUENCE, "j", CU_K)
    # a row that sees no key (causal's first n_q - n_k; any of a sequence with no keys):
    # O = 0, lse = -inf (floored)
    o, lse = one_head(queries.read(Q, ("g", "r")), keys.read(K, ("g",)), keys.read(V, ("g",)),
                      causal, mask=_seen_mask(n_q, n_k) if causal else None, floored=True)
    extents = ("batch", "kv_heads", "group")
    packed = queries
    return KernelSpec(
        name=name(causal), inputs=(Q, K, V, CU_Q, CU_K), scalars=("scale",),
        outputs=(Output("O", lift(HEADS, extents, o), ROWS + ("c",), packed),
                 Output("lse", lift(HEADS, extents, lse), ROWS, packed)))


def name(causal: bool, backward=False) -> str:
    return f"attention_varlen_{'bwd' if backward else 'fwd'}{'_causal' if causal else ''}"


def backward_spec(causal: bool) -> KernelSpec:
    """The vector-Jacobian product of the forward, by moagen.moa.grad: dO given for O, O and
    lse saved; dQ packed by cu_q, dK and dV by cu_k (summed over the group's query heads).
    A row that saw no key (lse -inf) gets P = 0 (the lse floored as the forward's max), so
    no gradient and no NaN."""
    keys = KEY_ROWS + ("c",)
    return grad(spec(causal), name=name(causal, backward=True),
                wrt={"Q": ROWS + ("c",), "K": keys, "V": keys}, cotangents=("O",),
                order=("Q", "K", "V", "cu_q", "cu_k", "O", "dO", "lse"),
                labels={"probs": "P", "dscores": "dS"})


# dnf: row by row, a sequence's rows' O and lse in one nest, its heads in parallel (on a GPU
# a thread block a sequence's head, its threads sharing the sequence's rows: the rows' loop
# is no extent of a grid); causal, each pass over a row's keys stops at its last key seen
# (MaskedKeys)
ROW_THREADS = 128


def _forward(causal):
    cut = (MaskedKeys(),) if causal else ()
    return Layers(algorithm=row_pass(ROWS) + cut,
                  mapping={"cpu": (Parallel(HEADS),),
                           "cuda": (GpuBlocks(HEADS, nest="rows", block=ROW_THREADS,
                                              across="i"),)})


# flash: attention's FlashAttention form (moagen.kernels.attention.flash) over a sequence's
# rows, the CPU's threads sharing its heads (its rows' extent read from cu_q); causal, a row
# tile's key blocks stop at its last row's last key seen (CausalBlocks). CPU only
def _flash(causal):
    return attention.flash_variant(causal, loops=ROWS, heads=HEADS, kinds=("cpu",))


# the backward's dnf: dQ's rows owned by a sequence's query heads, dK's and dV's by its KV
# heads (each summing its group's query heads, then their rows: no two threads write one
# row, no atomics); delta (one number a query row) recomputed where used, as a temporary
# could not be sized before the call (its rows are the offsets' values); on a GPU a thread
# block a (sequence, head), its threads sharing the rows; causal, dQ's pass over a row's
# keys stops at its last key seen, dK's and dV's over a key's queries start at the first
# that sees it (MaskedKeys)
def _backward(causal):
    per_key = tuple(step for nest in ("dK", "dV") for step in (
        Accumulate("c", over="r", nest=nest), Accumulate("c", over="i", nest=nest)))
    return Layers(
        algorithm=(Accumulate("c", over="j", nest="dQ"), *per_key, Hoist())
        + ((MaskedKeys(),) if causal else ()),
        mapping={"cpu": (Parallel(HEADS, nest="dQ"), Parallel(KV_HEADS, nest="dK"),
                         Parallel(KV_HEADS, nest="dV")),
                 "cuda": (GpuBlocks(HEADS, nest="dQ", block=ROW_THREADS, across="i"),
                          *(GpuBlocks(KV_HEADS, nest=nest, block=ROW_THREADS, across="j")
                            for nest in ("dK", "dV")))})


KERNELS = [kernel for causal in (False, True) for kernel in (
    (spec(causal), {"dnf": (frozenset(), _forward(causal)), "flash": _flash(causal)}),
    (backward_spec(causal), {"dnf": (frozenset(), _backward(causal))}))]


def _sizes(q_lens, k_lens, kv_heads=1, group=1, d=3):
    """A packed batch of sequences of these query and key lengths."""
    return dict(batch=len(q_lens), total_q=sum(q_lens), total_k=sum(k_lens), kv_heads=kv_heads,
                group=group, d=d, q_lens=tuple(q_lens), k_lens=tuple(k_lens))


def packed_offsets(sizes):
    """cu_q and cu_k of the sizes' sequence lengths (Check.integers)."""
    return {name: np.concatenate(([0], np.cumsum(sizes[lens]))).astype(np.int64)
            for name, lens in (("cu_q", "q_lens"), ("cu_k", "k_lens"))}


# What verification runs these kernels on: lengths 1, 7, 257 and 0 mixed, n_q != n_k (more
# queries than keys: causal's first queries see none), empty sequences of queries, of keys,
# of both; grouped heads (3 over 2 KV heads, d 5). The second has a key for every query:
# the bench's baseline test compares there (-inf lse rows would make its norms NaN)
CHECK_SIZES = (_sizes((1, 7, 257, 0), (7, 1, 257, 0)),
               _sizes((7, 1, 5), (11, 1, 7), kv_heads=2, group=3, d=5),
               _sizes((0, 7, 1, 257), (1, 0, 7, 7)),
               _sizes((257, 0, 7), (1, 257, 7), kv_heads=2, group=3, d=5),
               _sizes((1,), (1,)))
# the bench: 4 sequences of n / 4 queries against n / 4 to n keys, 8 query heads over 2 KV
# heads of 64
BENCH_SIZES = Bench(lambda n: dict(_sizes([n // 4] * 4, [n // 4, n // 2, 3 * n // 4, n],
                                          kv_heads=2, group=4, d=64), n=n),
                    quick=(512,), full=(1024, 4096))
def _forward_of(causal):
    """The backward's O and lse from the numpy forward on its Q, K, V and offsets."""
    def consistent(arrays, scalars):
        O, lse = reference.attention_varlen_fwd_numpy(
            *(arrays[a] for a in ("Q", "K", "V", "cu_q", "cu_k")), causal=causal, **scalars)
        return dict(arrays, O=O, lse=lse)
    return consistent


CHECKS, BENCH = {}, {}
for causal in (False, True):
    CHECKS[name(causal)] = Check(references(reference.attention_varlen_fwd_numpy,
                                            reference.attention_varlen_fwd_torch, causal=causal),
                                 CHECK_SIZES, softmax_scale, integers=packed_offsets)
    BENCH[name(causal)] = BENCH_SIZES.measured_against(
        "sdpa_varlen", "O by one F.scaled_dot_product_attention(enable_gqa=True) per sequence, "
                       "causal bottom-right by its boolean mask; no lse", outputs=(0,),
        causal=causal)
    BENCH[name(causal, backward=True)] = BENCH_SIZES.measured_against(
        "sdpa_varlen_bwd", "dQ, dK, dV by autograd of one F.scaled_dot_product_attention("
                           "enable_gqa=True) per sequence, the forward recomputed (O, lse "
                           "unused)", causal=causal)
    CHECKS[name(causal, backward=True)] = Check(
        references(reference.attention_varlen_bwd_numpy, reference.attention_varlen_bwd_torch,
                   causal=causal), CHECK_SIZES, softmax_scale, inputs=_forward_of(causal),
        integers=packed_offsets)
