"""Attention whose queries and keys differ in number, n_q queries against n keys:
cross-attention, and a prefill's queries against a cache. Forward and backward, in
grouped-query attention's layout (moagen.kernels.attention_gqa: queries (batch, kv_heads,
group, n_q, d), keys and values (batch, kv_heads, n, d); MHA is a group of one), the
backward derived by moagen.moa.grad. n, as attention_decode's cache rows, is the length the
bench sweeps.

Causal: query i sees keys j <= i + offset, offset a size given at call time: 0 is SDPA's
is_causal (top-left), n - n_q a cache's (bottom-right, PyTorch's causal_lower_right).
The mask compares positions, query i's i + offset (iota(n_q + offset) past its first
offset) with key j's. offset is a size, so never negative: with offset < 0 rows
i < -offset would see no key, and SDPA gives them 0 where the softmax here gives 0 / 0; the
caller runs the rows that see a key (moagen.torch_ops.attention).

Masked (`_masked`, #54 item 1): an input M of shape (batch, kv_heads, group, n_q, n) added to
the scaled scores, as SDPA's float attn_mask (a boolean mask is 0 where a key is seen, -inf
where not); `_masked2d`: one M of shape (n_q, n) for every batch and head (SDPA's
attn_mask of shape (n_q, n) or (1, 1, n_q, n), never copied per head). A row M masks
wholly gives 0 / 0, as the softmax does; SDPA gives such rows zeros, which
moagen.torch_ops.attention gives them. `_bool2d`: M (n_q, n) of bools, shared as
`_masked2d`'s, read a byte an element (SDPA's boolean attn_mask as torch stores it): the
score kept where M is true, -inf where not; a row it hides wholly gets O = 0 and lse = -inf
itself (its softmax floored, FLOORED), no gradient. M takes no gradient. Their flash forms add M's
tile to the score tile, read in place; any block may hold none of a row's keys
(OnlineSoftmax's unseen), so none is skipped; on a CPU their exponentials, forward and
backward, are flushed (FlushExp), so that the masked keys' -inf keep the vector exp on its
fast path.

Padded (`_padded`): keys j <= last seen, last a size given at call time (a right-padded
batch's last valid key; moagen.torch calls the kernels a batch at a time, each with its
own). A size is never negative, so every row sees key 0: the flash forward's loops stop at
last's block (CausalBlocks, its row `last`), the padded blocks never visited. A batch with
no valid key is the caller's (SDPA's zeros). On the CPU the flash backward's key rows' pass
walks no query row for its tiles of keys past last (CausalRows: their dK and dV rows stored
as the zeros they start at), its dQ pass (parts 0; a GPU's too) stops at last's key block
(MaskedBlocks); a GPU's key rows' pass masks the padded keys, every query block walked."""
import numpy as np

from moagen import reference
from moagen.kernels import attention, attention_bwd
from moagen.kernels.attention import row_pass, softmax_scale
from moagen.kernels.attention_bwd import Rows, forward_of
from moagen.kernels.cases import Bench, Check, references
from moagen.kernels.layers import Layers, cpu
from moagen.moa.expr import array, dim, drop, flags, iota, lift, outer, psi, sym, where
from moagen.moa.grad import grad
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.flush_exp import FlushExp
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import Parallel

Q = array("Q", "batch", "kv_heads", "group", "n_q", "d")
K = array("K", "batch", "kv_heads", "n", "d")
V = array("V", "batch", "kv_heads", "n", "d")
M = array("M", "batch", "kv_heads", "group", "n_q", "n")
SHARED_M = array("M", "n_q", "n")
SHARED_FLAGS = flags("M", "n_q", "n")
O = array("O", "batch", "kv_heads", "group", "n_q", "d")
DO = array("dO", "batch", "kv_heads", "group", "n_q", "d")
LSE = array("lse", "batch", "kv_heads", "group", "n_q")
LOOPS = Rows(heads=("b", "g"), group="r")
QUERY_HEADS, EXTENTS = LOOPS.query[:-1], ("batch", "kv_heads", "group")


def shifted_mask(scores):
    """Keys past query i's position i + offset get -inf."""
    positions = drop("offset", iota(sym("n_q") + sym("offset")))
    return where(outer(">=", positions, iota("n")), scores, float("-inf"))


def padded_mask(scores):
    """Keys past the last valid one, `last`, get -inf (a right-padded batch's keys)."""
    lasts = lift(("query",), ("n_q",), dim("last"))  # each query row's last key
    return where(outer(">=", lasts, iota("n")), scores, float("-inf"))


def added_mask(scores):
    """M's bias added to the scores: -inf gives a key zero weight."""
    return scores + psi(QUERY_HEADS, M)


def shared_mask(scores):
    """One bias (n_q, n) added to every batch's and head's scores."""
    return scores + SHARED_M


def kept_mask(scores):
    """The scores kept where one bool mask (n_q, n), shared by every batch and head, is
    true; -inf where not."""
    return where(SHARED_FLAGS, scores, float("-inf"))


# the kinds of mask, by the suffix of their kernels' names
MASKS = {"": None, "causal": shifted_mask, "masked": added_mask,
         "masked2d": shared_mask, "bool2d": kept_mask, "padded": padded_mask}
# the masks read from an input, that input: added (floats) or kept (bools)
ADDED = {"masked": M, "masked2d": SHARED_M, "bool2d": SHARED_FLAGS}
# the masks that may hide every key of a row, whose softmax is floored (attention.one_head):
# such a row gets O = 0 and lse = -inf, SDPA's zeros. A bool mask's hidden key is -inf; an
# added float mask's may be finite (transformers' finfo.min), where SDPA averages the row
FLOORED = ("bool2d",)
# the sizes a mask's kernels are given at call time
GIVEN = {"causal": ("offset",), "padded": ("last",)}


def name(mask: str, backward=False) -> str:
    return f"attention_cross_{'bwd' if backward else 'fwd'}{'_' + mask if mask else ''}"


def _inputs(mask: str):
    return (Q, K, V, ADDED[mask]) if mask in ADDED else (Q, K, V)


def spec(mask: str) -> KernelSpec:
    o, lse = attention.one_head(psi(QUERY_HEADS, Q), psi(LOOPS.heads, K), psi(LOOPS.heads, V),
                                bool(mask), mask=MASKS[mask], floored=mask in FLOORED)
    return KernelSpec(
        name=name(mask),
        inputs=_inputs(mask),
        scalars=("scale",),
        given=GIVEN.get(mask, ()),
        outputs=(Output("O", lift(QUERY_HEADS, EXTENTS, o), LOOPS.query + ("c",)),
                 Output("lse", lift(QUERY_HEADS, EXTENTS, lse), LOOPS.query)))


def backward_spec(mask: str) -> KernelSpec:
    """The vector-Jacobian product of the forward: dO given for O, lse kept (M, an input
    left out of wrt, takes none)."""
    return grad(spec(mask), name=name(mask, backward=True),
                wrt={"Q": LOOPS.query + ("c",), "K": LOOPS.key + ("c",),
                     "V": LOOPS.key + ("c",)},
                cotangents=("O",), order=tuple(a.name for a in (*_inputs(mask), O, DO, LSE)),
                labels={"probs": "P", "dscores": "dS"})


# dnf: row by row, nothing of size n_q x n. The forward's rows (O and lse in one nest);
# the backward's dQ rows owned by query rows, dK and dV rows by key rows (summed over the
# group's query heads, then their rows), delta one number a query row
FORWARD = Layers(algorithm=row_pass(LOOPS.query), mapping=cpu(Parallel(LOOPS.query)))
BACKWARD = Layers(
    algorithm=(Accumulate("c", over="j", nest="dQ"),
               *(step for nest in ("dK", "dV") for step in (
                   Accumulate("c", over="r", nest=nest), Accumulate("c", over="i", nest=nest))),
               Hoist()),
    mapping=cpu(Parallel(LOOPS.query, nest="delta"), Parallel(LOOPS.query, nest="dQ"),
                Parallel(LOOPS.key, nest="dK"), Parallel(LOOPS.key, nest="dV")))

# flash: attention_gqa's FlashAttention form over these loops, plain, causal and padded (its
# key blocks bounded by the tile's last row plus offset, or by the last key, CausalBlocks);
# the padded backward skips its padded keys as owner's `padded` says; the added masks'
# blocks all visited, the forward's max 0 in a row's blocks before its first key seen (the
# backward's P from lse needs no max). (the forward's causal flag, the backward's)
FLASH = {"": (False, False), "causal": (True, True), "padded": (True, False),
         "masked": (False, False), "masked2d": (False, False), "bool2d": (False, False)}


# a GPU backward's block scratch (attention_bwd.BWD_SCRATCH) where the forward's max is
# floored: the keys pass's lse floored as the max was takes a name before its blocks
FLOORED_SCRATCH = dict(attention_bwd.BWD_SCRATCH, P2="t3_block", dS2="t4_block")


def _variants(mask, backward):
    dnf = (frozenset({"delta"}), BACKWARD) if backward else (frozenset(), FORWARD)
    flushed = (FlushExp(),) if mask in ADDED else ()  # a mask's -inf: exp's fast path
    scratch = FLOORED_SCRATCH if mask in FLOORED else None
    flash = attention_bwd.flash_variant(FLASH[mask][1], loops=LOOPS, then=flushed,
                                        padded=mask == "padded", scratch=scratch) if backward \
        else attention.flash_variant(FLASH[mask][0], loops=LOOPS.query, unseen=mask in ADDED,
                                     then=flushed)
    return {"dnf": dnf, "flash": flash}


KERNELS = [kernel for mask in MASKS for kernel in (
    (spec(mask), _variants(mask, backward=False)),
    (backward_spec(mask), _variants(mask, backward=True)))]
ALIASES = {f"{name(mask)}_vjp": name(mask, backward=True) for mask in MASKS}


def _sizes(n_q, n, **rest):
    return dict(batch=1, kv_heads=1, group=1, n_q=n_q, n=n, d=3, **rest)


# What verification runs these kernels on: n_q and n each 1, 7 and 257 in every pairing
# (one head of 3: the CUDA emulation stays quick), groups of 3 over 2 KV heads and a batch
# of 2 at one pairing; causal at offset 0 (top-left) and, where n > n_q, n - n_q
# (bottom-right), and past it: within the keys' last block, and past it (the flash variant's
# unmasked blocks stop at the keys' end)
PAIRS = [(n_q, n) for n_q in (1, 7, 257) for n in (1, 7, 257)]
PLAIN_SIZES = (*(_sizes(n_q, n) for n_q, n in PAIRS),
               dict(batch=2, kv_heads=2, group=3, n_q=7, n=11, d=5))
CAUSAL_SIZES = (*(_sizes(n_q, n, offset=offset) for n_q, n in PAIRS
                  for offset in sorted({0, max(n - n_q, 0)})),
                _sizes(7, 11, offset=9), _sizes(7, 11, offset=130),
                dict(batch=2, kv_heads=2, group=3, n_q=7, n=11, d=5, offset=4))


# the bench: a prefill of n / 4 queries against n keys, 8 query heads over 2 KV heads of 64;
# causal bottom-right (a cache's)
def _bench(causal):
    return Bench(lambda n: dict(batch=1, kv_heads=2, group=4, n_q=n // 4, n=n, d=64,
                                **({"offset": n - n // 4} if causal else {})),
                 quick=(512,), full=(1024, 4096))


def _grouped(M, Q, K):
    """An added mask as the references take it, of the grouped scores' shape (batch,
    kv_heads, group, n_q, n): a shared one broadcast."""
    return np.broadcast_to(M, (*Q.shape[:-1], K.shape[2])).copy()


def _with_mask(reference_function):
    """A grouped reference taking the mask by keyword, called in the masked kernels' order
    (M after Q, K and V); a bool M as its float bias."""
    return lambda Q, K, V, M, *rest, **scalars: reference_function(
        Q, K, V, *rest, mask=_grouped(bias(M) if M.dtype == bool else M, Q, K), **scalars)


def masked_inputs(backward: bool):
    """M as a float mask: -inf (a key not seen) where the random bias is below -0.5 (about
    three keys in ten), the bias elsewhere; each row's largest entry stays, so that every
    row sees a key (a row seeing none is the caller's, above); the last query row sees its
    last key alone (the flash forms' blocks before it hold none of its keys). The
    backward's O and lse from the numpy forward under that mask."""
    def consistent(arrays, scalars):
        M = arrays["M"]
        M = np.where(M < np.minimum(-0.5, M.max(axis=-1, keepdims=True)), -np.inf, M)
        M[..., -1, :] = np.where(np.arange(M.shape[-1]) < M.shape[-1] - 1, -np.inf, 0.0)
        if backward:
            Q, K, V = (arrays[a] for a in "QKV")
            arrays = dict(arrays, **dict(zip(("O", "lse"), reference.attention_gqa_fwd_numpy(
                Q, K, V, mask=_grouped(M, Q, K), **scalars))))
        return dict(arrays, M=M)
    return consistent


def kept_inputs(backward: bool):
    """M as a bool mask (about seven keys in ten seen, as verify draws it) under the float
    masks' rules (masked_inputs): every row sees a key (row i key i mod n), the last query
    row its last key alone. The backward's O and lse from the numpy forward under it."""
    def consistent(arrays, scalars):
        M = arrays["M"].copy()
        n_q, n = M.shape
        M |= np.arange(n) == (np.arange(n_q) % n)[:, None]
        M[-1] = np.arange(n) == n - 1
        if backward:
            Q, K, V = (arrays[a] for a in "QKV")
            arrays = dict(arrays, **dict(zip(("O", "lse"), reference.attention_gqa_fwd_numpy(
                Q, K, V, mask=_grouped(bias(M), Q, K), **scalars))))
        return dict(arrays, M=M)
    return consistent


def bias(M):
    """A bool mask as the float one the references add: 0 where seen, -inf where not."""
    return np.where(M, 0.0, -np.inf)


def padding_mask(Q, K, last):
    """A grouped float mask: 0 for the keys j <= last, -inf past it."""
    seen = np.arange(K.shape[2]) <= last
    return np.broadcast_to(np.where(seen, 0.0, -np.inf), (*Q.shape[:-1], K.shape[2])).copy()


def _with_padding(reference_function):
    """A grouped reference under the key-padding mask of the kernel's given `last`."""
    return lambda Q, K, V, *rest, last, **scalars: reference_function(
        Q, K, V, *rest, mask=padding_mask(Q, K, last), **scalars)


def _padded_forward(arrays, scalars):
    """The backward's O and lse from the numpy forward under the padding mask."""
    O, lse = _with_padding(reference.attention_gqa_fwd_numpy)(
        arrays["Q"], arrays["K"], arrays["V"], **scalars)
    return dict(arrays, O=O, lse=lse)


# keys 0 to last seen: one key, a block's first or last key, past the keys' end; the row's
# keys within one block, across blocks, all
PADDED_SIZES = (_sizes(1, 1, last=0), _sizes(7, 7, last=0), _sizes(7, 257, last=0),
                _sizes(7, 257, last=63), _sizes(7, 257, last=64), _sizes(257, 257, last=200),
                _sizes(257, 7, last=3), _sizes(1, 257, last=256), _sizes(7, 11, last=30),
                dict(batch=2, kv_heads=2, group=3, n_q=7, n=11, d=5, last=6))

CHECKS, BENCH = {}, {}
for mask, sizes in (("", PLAIN_SIZES), ("causal", CAUSAL_SIZES)):
    causal = mask == "causal"
    CHECKS[name(mask)] = Check(references(reference.attention_gqa_fwd_numpy,
                                          reference.attention_gqa_fwd_torch, causal=causal),
                               sizes, softmax_scale)
    CHECKS[name(mask, backward=True)] = Check(
        references(reference.attention_gqa_bwd_numpy, reference.attention_gqa_bwd_torch,
                   causal=causal), sizes, softmax_scale,
        inputs=forward_of(causal, reference.attention_gqa_fwd_numpy))
    BENCH[name(mask)] = _bench(causal).measured_against(
        "sdpa_gqa", "O by F.scaled_dot_product_attention(enable_gqa=True), causal by its "
                    "boolean mask; no lse (SDPA returns none)", outputs=(0,), causal=causal)
    BENCH[name(mask, backward=True)] = _bench(causal).measured_against(
        "sdpa_gqa_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention("
                        "enable_gqa=True), the forward recomputed (O, lse unused)",
        causal=causal)
for mask in ADDED:
    made = kept_inputs if ADDED[mask].element == "bool" else masked_inputs
    CHECKS[name(mask)] = Check(
        {key: _with_mask(f) for key, f in references(reference.attention_gqa_fwd_numpy,
                                                     reference.attention_gqa_fwd_torch).items()},
        PLAIN_SIZES, softmax_scale, inputs=made(backward=False))
    CHECKS[name(mask, backward=True)] = Check(
        {key: _with_mask(f) for key, f in references(reference.attention_gqa_bwd_numpy,
                                                     reference.attention_gqa_bwd_torch).items()},
        PLAIN_SIZES, softmax_scale, inputs=made(backward=True))
    BENCH[name(mask)] = _bench(False).measured_against(
        "sdpa_gqa_masked", "O by F.scaled_dot_product_attention(enable_gqa=True, "
                           "attn_mask=M); no lse (SDPA returns none)", outputs=(0,))
    BENCH[name(mask, backward=True)] = _bench(False).measured_against(
        "sdpa_gqa_masked_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention("
                               "enable_gqa=True, attn_mask=M), the forward recomputed (O, lse "
                               "unused)")
CHECKS[name("padded")] = Check(
    {key: _with_padding(f) for key, f in references(reference.attention_gqa_fwd_numpy,
                                                    reference.attention_gqa_fwd_torch).items()},
    PADDED_SIZES, softmax_scale)
CHECKS[name("padded", backward=True)] = Check(
    {key: _with_padding(f) for key, f in references(reference.attention_gqa_bwd_numpy,
                                                    reference.attention_gqa_bwd_torch).items()},
    PADDED_SIZES, softmax_scale, inputs=_padded_forward)
# the padded bench: as the others, the last half of the keys padded out
PADDED_BENCH = Bench(lambda n: dict(batch=1, kv_heads=2, group=4, n_q=n // 4, n=n, d=64,
                                    last=max(n // 2 - 1, 0)), quick=(512,), full=(1024, 4096))
BENCH[name("padded")] = PADDED_BENCH.measured_against(
    "sdpa_gqa_padded", "O by F.scaled_dot_product_attention(enable_gqa=True) with a boolean "
                       "key-padding attn_mask; no lse (SDPA returns none)", outputs=(0,))
BENCH[name("padded", backward=True)] = PADDED_BENCH.measured_against(
    "sdpa_gqa_padded_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention("
                           "enable_gqa=True) with a boolean key-padding attn_mask, the forward "
                           "recomputed (O, lse unused)")
