"""Attention with dropout on its probabilities (#54 item 3), forward and backward, in
grouped-query attention's layout (moagen.kernels.attention_gqa: queries (batch, kv_heads,
group, n, d), keys and values (batch, kv_heads, n, d)), the backward derived by
moagen.moa.grad.

As SDPA's dropout_p: O = (P * Z / (1 - p)) V, P the softmax's probabilities and Z the keep
mask, the lse the softmax's own. Z is drawn by a counter-based generator (moagen.philox:
Philox4x32-10 of each element's row in the (batch, heads, n, n) probabilities and its key's
group of 8 under the key `seed`, a size given at call time), so the backward computes the forward's Z again from
the seed instead of reading a stored mask: to grad, Z is a constant, and the derived
backward is dV = (P Z / (1 - p))^T dO, dP = (dO V^T) Z / (1 - p), dS = P (dP - delta).
p is the scalar dropout_p, compared in double precision (moagen_keep's p is a double)."""
from dataclasses import replace

from moagen import reference
from moagen.kernels import attention, attention_bwd, attention_cross
from moagen.kernels.attention import causal_mask, softmax_scale
# attention_gqa's arrays and loops: the same layout
from moagen.kernels.attention_gqa import DO, EXTENTS, K, LOOPS, LSE, O, Q, QUERY_HEADS, V
from moagen.kernels.cases import Bench, Check, references
from moagen.moa.expr import Scalar, dropout, lift, psi
from moagen.moa.grad import grad
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.names import loop_role
from moagen.philox import KEYS_PER_RUN
from moagen.steps.loop.unroll import UnrollDraws, tiled

P = Scalar("dropout_p")
# Z / (1 - p) for every query head's probabilities: query head g * group + r's, as SDPA's
# heads are numbered, so that its rows are those of (batch, heads, n, n)
FACTORS = dropout(EXTENTS + ("n", "n"), "seed", P)


def dropped(probs):
    """The kept probabilities scaled by 1 / (1 - p), the dropped ones 0."""
    return probs * psi(QUERY_HEADS, FACTORS)


def name(causal: bool, backward=False) -> str:
    return f"attention_dropout_{'bwd' if backward else 'fwd'}{'_causal' if causal else ''}"


def spec(causal: bool) -> KernelSpec:
    o, lse = attention.one_head(psi(QUERY_HEADS, Q), psi(LOOPS.heads, K), psi(LOOPS.heads, V),
                                causal, causal_mask, dropout=dropped)
    return KernelSpec(
        name=name(causal), inputs=(Q, K, V), scalars=("scale", "dropout_p"), given=("seed",),
        outputs=(Output("O", lift(QUERY_HEADS, EXTENTS, o), LOOPS.query + ("c",)),
                 Output("lse", lift(QUERY_HEADS, EXTENTS, lse), LOOPS.query)))


def backward_spec(causal: bool) -> KernelSpec:
    """The vector-Jacobian product of the forward: dO given for O, lse kept, the keep mask
    drawn again from the seed."""
    return grad(spec(causal), name=name(causal, backward=True),
                wrt={"Q": LOOPS.query + ("c",), "K": LOOPS.key + ("c",),
                     "V": LOOPS.key + ("c",)},
                cotangents=("O",), order=tuple(a.name for a in (Q, K, V, O, DO, LSE)),
                labels={"probs": "P", "dscores": "dS"})


# dnf: row by row, nothing of size n x n, as attention_cross's (the same loops). flash:
# attention_gqa's (FlashAttention's register tiles; the backward's key rows own dK and dV),
# the forward's factors applied to a block's row of probabilities once per key
# (OnlineSoftmax) by groups of 8 keys, one Philox run each (UnrollDraws). The backward's
# drawn inside its tiles of key rows, 8 on every CPU (AVX2's owner has 6 for its 16
# registers): a tile is then a group, one run for its keys (UnrollDraws checks), where 6
# drew a run per element (docs/journal/2026-12-07-dropout-speed.md). On a GPU the
# backward's keys pass names its blocks of P and dS t4 and t5 (the factors' values take t2
# and t3)
# float32's tiles 8 lanes wide, not 16: with the draws' code beside them gcc keeps only the
# narrower output tile in vector registers (docs/PERFORMANCE.md, "Other lengths, padding,
# dropout, masks")
FORWARD_DTYPES = {"float32": {"lanes": 8}}
# AVX-512, float32: 8 rows, not the plain forward's 12, beside the draws: rows 12, lanes 32
# took 24.8 / 52.0 ms against 17.1 / 34.0 (n 1024 / 2048 causal, 8 over 2 heads, d 64, 2
# threads, 512-bit code; journal 2026-12-07-wide-vectors.md)
FORWARD_AVX512 = {**attention.FLASH_AVX512, "float32": {"rows": 8, "lanes": 32, "block": 128}}
BACKWARD_SCRATCH = dict(attention_bwd.BWD_SCRATCH, P2="t4_block", dS2="t5_block")
# the key rows' pass's tiles (PartBuffers' loop over a part's keys, jammed)
KEY_TILES = tiled(loop_role("j", "in"), KEYS_PER_RUN)


# AVX-512: the rows stay Philox's groups (8 keys); the columns widen to a row in two
# 512-bit registers, as the owner's: 1.08-1.16x faster than 8 lanes (float64, 16) and
# 1.18-1.21x than 16 (float32, 32) once gcc wrote 512-bit vectors; with 256-bit code wider
# tiles had lost (journal 2026-12-07-dropout-speed.md, 2026-12-07-wide-vectors.md)
BACKWARD_AVX512 = {"float64": {"lanes": 16}, "float32": {"lanes": 32}}


def backward_variant(causal):
    """attention_bwd's flash over these loops. On a CPU (parts 1: the key rows' pass adds dQ
    too) its tiles are 8 key rows of one part, a group of keys each (UnrollDraws), by 8
    (float64) or 16 (float32) columns, on AVX-512 BACKWARD_AVX512's. The GPU schedule
    OpenACC takes (parts 0, 4 rows) draws a key at a time, as CUDA's."""
    variant = attention_bwd.flash_variant(causal, loops=LOOPS, scratch=BACKWARD_SCRATCH)

    def build(**params):
        then = (UnrollDraws(KEY_TILES, nest="keys"),) if params["parts"] else ()
        return variant.build(**params, then=then)
    return replace(variant, build=build, defaults={**variant.defaults, "rows": KEYS_PER_RUN},
                   space={**variant.space, "rows": (KEYS_PER_RUN,), "parts": (1,)},
                   avx512=BACKWARD_AVX512)


KERNELS = [kernel for causal in (False, True) for kernel in (
    (spec(causal), {"dnf": (frozenset(), attention_cross.FORWARD),
                    "flash": replace(attention.flash_variant(causal, loops=LOOPS.query,
                                                             then=(UnrollDraws("j"),)),
                                     dtypes=FORWARD_DTYPES, avx512=FORWARD_AVX512)}),
    (backward_spec(causal), {"dnf": (frozenset({"delta"}), attention_cross.BACKWARD),
                             "flash": backward_variant(causal)}))]
ALIASES = {f"{name(causal)}_vjp": name(causal, backward=True) for causal in (False, True)}


def dropout_scalars(sizes):
    """The softmax's scale and p = 5/16, which float32 holds exactly: both dtypes' kernels
    then compare their words with the references' threshold."""
    return dict(softmax_scale(sizes), dropout_p=0.3125)


# What verification runs these kernels on: one head at n = 1, 7 and 257 (d 3: the CUDA
# emulation stays quick), groups of 3 over 2 KV heads and a batch of 2, and two heads of 37
# at 130 rows (the flash variants' full tiles of keys and columns, and their remainders);
# seeds with both 32-bit words set
CHECK_SIZES = (dict(batch=1, kv_heads=1, group=1, n=1, d=3, seed=7),
               dict(batch=1, kv_heads=1, group=1, n=7, d=3, seed=2 ** 40 + 12345),
               dict(batch=1, kv_heads=1, group=1, n=257, d=3, seed=2 ** 62 + 3),
               dict(batch=2, kv_heads=2, group=3, n=7, d=5, seed=2 ** 33 + 1),
               dict(batch=1, kv_heads=1, group=2, n=130, d=37, seed=2 ** 31 + 11))
BENCH_ON = Bench(lambda n: dict(batch=1, kv_heads=2, group=4, n=n, d=64, seed=1),
                 quick=(128,), full=(512, 1024))


def forward_of(causal):
    """The backward's O and lse from its Q, K and V by the numpy forward, with the same
    p and seed."""
    def consistent(arrays, scalars):
        O, lse = reference.attention_dropout_fwd_numpy(arrays["Q"], arrays["K"], arrays["V"],
                                                       causal=causal, **scalars)
        return dict(arrays, O=O, lse=lse)
    return consistent


CHECKS, BENCH = {}, {}
for causal in (False, True):
    CHECKS[name(causal)] = Check(references(reference.attention_dropout_fwd_numpy,
                                            reference.attention_dropout_fwd_torch,
                                            causal=causal), CHECK_SIZES, dropout_scalars)
    CHECKS[name(causal, backward=True)] = Check(
        references(reference.attention_dropout_bwd_numpy, reference.attention_dropout_bwd_torch,
                   causal=causal), CHECK_SIZES, dropout_scalars, inputs=forward_of(causal))
    BENCH[name(causal)] = BENCH_ON.measured_against(
        "sdpa_gqa_dropout", "O by F.scaled_dot_product_attention(enable_gqa=True, dropout_p="
                            "p), SDPA's own random numbers; no lse (SDPA returns none)",
        outputs=(0,), causal=causal)
    BENCH[name(causal, backward=True)] = BENCH_ON.measured_against(
        "sdpa_gqa_dropout_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention("
                                "enable_gqa=True, dropout_p=p), the forward recomputed (O, lse "
                                "unused)", causal=causal)
