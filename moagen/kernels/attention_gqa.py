"""Grouped-query attention for training, forward and backward: the query heads in groups
that share one KV head (GQA; MQA is kv_heads = 1), K and V read by indexing, never copied
per query head, and dK and dV summed over each group inside the backward.

The queries are (batch, kv_heads, group, n, d): PyTorch's contiguous (batch, heads, n, d),
viewed so, query head h = g * group + r being the r-th of KV head g's group (as SDPA's
enable_gqa pairs them). Every input is then indexed by the lift variables (b, g, r), K and V
by (b, g) alone, so the backward is derived by moagen.moa.grad like attention_bwd's: an
input not indexed by a lift axis has its gradient summed over it, dK and dV over the group
r as over the query rows i. The variants are attention's and attention_bwd's `flash` over
these loops (the key rows' pass sums over r, then over i)."""
from moagen import reference
from moagen.kernels import attention, attention_bwd
from moagen.kernels.attention import softmax_scale
from moagen.kernels.attention_bwd import Rows, forward_of
from moagen.kernels.cases import Bench, Check, references
from moagen.moa.expr import array, lift, psi
from moagen.moa.grad import grad
from moagen.moa.spec import KernelSpec, Output

Q = array("Q", "batch", "kv_heads", "group", "n", "d")
K = array("K", "batch", "kv_heads", "n", "d")
V = array("V", "batch", "kv_heads", "n", "d")
O = array("O", "batch", "kv_heads", "group", "n", "d")
DO = array("dO", "batch", "kv_heads", "group", "n", "d")
LSE = array("lse", "batch", "kv_heads", "group", "n")
LOOPS = Rows(heads=("b", "g"), group="r")
QUERY_HEADS, EXTENTS = LOOPS.query[:-1], ("batch", "kv_heads", "group")


def spec(causal: bool) -> KernelSpec:
    o, lse = attention.one_head(psi(QUERY_HEADS, Q), psi(LOOPS.heads, K), psi(LOOPS.heads, V),
                                causal)
    return KernelSpec(
        name="attention_gqa_fwd_causal" if causal else "attention_gqa_fwd",
        inputs=(Q, K, V),
        scalars=("scale",),
        outputs=(Output("O", lift(QUERY_HEADS, EXTENTS, o), LOOPS.query + ("c",)),
                 Output("lse", lift(QUERY_HEADS, EXTENTS, lse), LOOPS.query)))


# how the backward is derived (moagen.moa.grad; `moagen grad attention_gqa_fwd`): dO given for
# O, lse kept; the inputs in the order of the kernels' callers
VJP = {forward: dict(wrt={"Q": LOOPS.query + ("c",), "K": LOOPS.key + ("c",),
                          "V": LOOPS.key + ("c",)},
                     cotangents=("O",), order=tuple(a.name for a in (Q, K, V, O, DO, LSE)),
                     labels={"probs": "P", "dscores": "dS"})
       for forward in ("attention_gqa_fwd", "attention_gqa_fwd_causal")}


def backward_spec(causal: bool) -> KernelSpec:
    """The vector-Jacobian product of the forward."""
    forward = spec(causal)
    return grad(forward, name="attention_gqa_bwd_causal" if causal else "attention_gqa_bwd",
                **VJP[forward.name])


KERNELS = [kernel for causal in (False, True) for kernel in (
    (spec(causal), {"flash": attention.flash_variant(causal, loops=LOOPS.query),
                    # flash with CUDA's two products on tensor cores (attention_fwd's)
                    "tensor": attention.flash_variant(causal, loops=LOOPS.query,
                                                      tensor=True)}),
    (backward_spec(causal), {"flash": attention_bwd.flash_variant(causal, loops=LOOPS)}))]
# CUDA's variant where none is named: attention_fwd's (moagen.kernels.attention)
DEVICE_DEFAULTS = {name: attention.DEVICE_DEFAULTS["attention_fwd"]
                   for name in ("attention_gqa_fwd", "attention_gqa_fwd_causal")}
# the names a derived backward has (moagen.kernels.ALIASES)
ALIASES = {"attention_gqa_fwd_vjp": "attention_gqa_bwd",
           "attention_gqa_fwd_causal_vjp": "attention_gqa_bwd_causal"}

# What verification and the benchmarks run these kernels on (moagen.kernels.cases): one
# head (a group of one), groups of 3 over 2 KV heads at sizes that divide nothing, MQA past
# a block of keys; the bench on 8 query heads over 2 KV heads of 64.
CHECK_SIZES = (dict(batch=1, kv_heads=1, group=1, n=1, d=3),
               dict(batch=2, kv_heads=2, group=3, n=7, d=5),
               dict(batch=1, kv_heads=1, group=2, n=257, d=80))
ON_GROUPS = Bench(lambda n: dict(batch=1, kv_heads=2, group=4, n=n, d=64), quick=(128,),
                  full=(256, 512, 1024))
FORWARDS = (("attention_gqa_fwd", False), ("attention_gqa_fwd_causal", True))
BACKWARDS = (("attention_gqa_bwd", False), ("attention_gqa_bwd_causal", True))
CHECKS = {
    **{name: Check(references(reference.attention_gqa_fwd_numpy,
                              reference.attention_gqa_fwd_torch, causal=causal),
                   CHECK_SIZES, softmax_scale) for name, causal in FORWARDS},
    **{name: Check(references(reference.attention_gqa_bwd_numpy,
                              reference.attention_gqa_bwd_torch, causal=causal),
                   CHECK_SIZES, softmax_scale,
                   inputs=forward_of(causal, reference.attention_gqa_fwd_numpy))
       for name, causal in BACKWARDS}}
BENCH = {
    **{name: ON_GROUPS.measured_against(
        "sdpa_gqa", "O by F.scaled_dot_product_attention(enable_gqa=True); no lse (SDPA "
                    "returns none)", outputs=(0,), causal=causal) for name, causal in FORWARDS},
    **{name: ON_GROUPS.measured_against(
        "sdpa_gqa_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention("
                        "enable_gqa=True), the forward recomputed (O, lse unused)",
        causal=causal) for name, causal in BACKWARDS}}
