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
from moagen import reference
from moagen.kernels import attention
from moagen.kernels.attention import CHECK_SIZES, ON_HEADS, K, Q, V, softmax_scale
from moagen.kernels.cases import Check, references
from moagen.kernels.chain import backward
from moagen.kernels.layers import Layers, cpu
from moagen.moa.expr import array, psi
from moagen.moa.grad import grad
from moagen.moa.rewrites import substitute
from moagen.moa.spec import KernelSpec
from moagen.onf.fusion import FuseNests, Scatter
from moagen.onf.schedule import Accumulate, Hoist, Parallel

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
VARIANTS = {
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
    "atomic": (frozenset({"delta"}), Layers(
        algorithm=(Accumulate("c", over="j", nest="dQ"), Accumulate("c", over="i", nest="dV"),
                   SCATTER_DK, FuseNests(("dQ", "dK"), over=QUERY_ROWS, name="rows"), Hoist()),
        mapping=cpu(Parallel(QUERY_ROWS, nest="delta"), Parallel(QUERY_ROWS, nest="rows"),
                    Parallel(KEY_ROWS, nest=SCATTER_DK.zero), Parallel(KEY_ROWS, nest="dV")))),
}

SPECS = (spec(False), spec(True))
KERNELS = [(s, VARIANTS) for s in SPECS]
# the names a derived backward has (moagen.kernels.ALIASES)
ALIASES = {"attention_fwd_vjp": "attention_bwd",
           "attention_fwd_causal_vjp": "attention_bwd_causal"}
# a stage's backward in a composite (moagen.kernels.chain)
CHAIN = {attention.spec(causal).name: backward(attention.spec(causal), by, "dnf")
         for causal, by in zip((False, True), SPECS)}


def _forward_of(causal):
    """The backward's O and lse, computed from its Q, K and V in float64."""
    def consistent(arrays, scalars):
        Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
        O, lse = reference.attention_fwd_numpy(Q, K, V, scalars["scale"], causal)
        return dict(arrays, O=O, lse=lse)
    return consistent


# what verification and the benchmarks run these kernels on (moagen.kernels.cases)
CASES = (("attention_bwd", False), ("attention_bwd_causal", True))
CHECKS = {name: Check(references(reference.attention_bwd_numpy, reference.attention_bwd_torch,
                                 causal=causal), CHECK_SIZES, softmax_scale,
                      inputs=_forward_of(causal))
          for name, causal in CASES}
BENCH = {name: ON_HEADS.measured_against(
             "sdpa_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention, the "
                         "forward recomputed (O, lse unused)", causal=causal)
         for name, causal in CASES}
