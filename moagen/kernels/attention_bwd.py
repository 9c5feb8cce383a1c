"""Attention backward, given Q, K, V, the forward's output O and per-row logsumexp lse, and
the output gradient dO (per batch and head; optionally causal):

    P  = exp(scale * Q K^T - lse)          the softmax, recomputed from lse
    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - delta),  delta = rowsum(dO * O)  (== rowsum(dP * P))
    dQ = scale * dS K,      dK = scale * dS^T Q
"""
from moagen import reference
from moagen.kernels import attention
from moagen.kernels.attention import (CHECK_SIZES, ON_HEADS, K, Q, V, causal_mask,
                                      softmax_scale)
from moagen.kernels.cases import Check, references
from moagen.kernels.layers import Layers, cpu
from moagen.moa.expr import Scalar, array, exp, inner, lift, named, omega, psi, reduce, transpose
from moagen.moa.grad import grad
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.fusion import FuseNests, Scatter
from moagen.onf.schedule import Accumulate, Hoist, Parallel

O = array("O", "batch", "heads", "n", "d")
DO = array("dO", "batch", "heads", "n", "d")
LSE = array("lse", "batch", "heads", "n")
BH, EXTENTS = ("b", "h"), ("batch", "heads")


def gradients(q, k, v, o, do, lse, causal):
    """dQ, dK, dV of one head as MoA expressions."""
    scores = Scalar("scale") * inner(q, transpose(k), var="c", name="qk")
    probs = named("P", exp(omega("-", causal_mask(scores) if causal else scores, lse)),
                  index=("i", "j"))
    dprobs = inner(do, transpose(v), var="c", name="dov")
    delta = named("delta", reduce("+", do * o, axis=1, var="c", name="rowdot"), index=("i",))
    dscores = named("dS", Scalar("scale") * (probs * omega("-", dprobs, delta)), index=("i", "j"))
    return (inner(dscores, k, var="j", name="acc"),
            inner(transpose(dscores), q, var="i", name="acc"),
            inner(transpose(probs), do, var="i", name="acc"))


def spec(causal: bool) -> KernelSpec:
    heads = [psi(BH, a) for a in (Q, K, V, O, DO, LSE)]
    dq, dk, dv = gradients(*heads, causal)
    return KernelSpec(
        name="attention_bwd_causal" if causal else "attention_bwd",
        inputs=(Q, K, V, O, DO, LSE),
        scalars=("scale",),
        outputs=(Output("dQ", lift(BH, EXTENTS, dq), ("b", "h", "i", "c")),
                 Output("dK", lift(BH, EXTENTS, dk), ("b", "h", "j", "c")),
                 Output("dV", lift(BH, EXTENTS, dv), ("b", "h", "j", "c"))),
    )


# dQ rows belong to query rows, dK and dV rows to key rows: each nest is parallel over the
# rows it owns, so no thread writes another's output and no atomics are needed
QUERY_ROWS, KEY_ROWS = ("b", "h", "i"), ("b", "h", "j")
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

KERNELS = [(spec(False), VARIANTS), (spec(True), VARIANTS)]

# the backward derived from the forward (moagen.moa.grad), with the hand-written one's inputs
# in its order; its intermediates are named after the forward's: probs, and dscores the
# cotangent of the scores (dS / scale)
WRT = {"Q": QUERY_ROWS + ("c",), "K": KEY_ROWS + ("c",), "V": KEY_ROWS + ("c",)}


def derived(causal: bool, name=None) -> KernelSpec:
    return grad(attention.spec(causal), wrt=WRT, cotangents=("O",), name=name,
                order=[a.name for a in (Q, K, V, O, DO, LSE)])


DERIVED_VARIANTS = dict(VARIANTS, naive=(frozenset({"probs", "dscores", "delta"}), Layers(
    algorithm=(Hoist(),),
    mapping=cpu(*(Parallel(QUERY_ROWS, nest=n) for n in ("probs", "dscores", "delta")),
                *OWNERS))))
KERNELS += [(derived(False), DERIVED_VARIANTS), (derived(True), DERIVED_VARIANTS)]


def _forward_of(causal):
    """The backward's O and lse, computed from its Q, K and V in float64."""
    def consistent(arrays, scalars):
        Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
        O, lse = reference.attention_fwd_numpy(Q, K, V, scalars["scale"], causal)
        return dict(arrays, O=O, lse=lse)
    return consistent


# what verification and the benchmarks run these kernels on (moagen.kernels.cases)
CHECKS = {name: Check(references(reference.attention_bwd_numpy, reference.attention_bwd_torch,
                                 causal=causal), CHECK_SIZES, softmax_scale,
                      inputs=_forward_of(causal))
          for name, causal in (("attention_bwd", False), ("attention_bwd_causal", True))}
BENCH = {name: ON_HEADS.measured_against(
             "sdpa_bwd", "dQ, dK, dV by autograd of F.scaled_dot_product_attention, the "
                         "forward recomputed (O, lse unused)", causal=causal)
         for name, causal in (("attention_bwd", False), ("attention_bwd_causal", True))}
# the derived kernels take the same inputs, in the same order
for _causal in ("", "_causal"):
    CHECKS[f"attention_fwd{_causal}_vjp"] = CHECKS[f"attention_bwd{_causal}"]
    BENCH[f"attention_fwd{_causal}_vjp"] = BENCH[f"attention_bwd{_causal}"]
