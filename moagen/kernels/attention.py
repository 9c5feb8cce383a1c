"""Attention forward, O = softmax(scale * Q K^T) V per (batch, head), softmax made stable by
subtracting the row maximum. Written once; the variants differ only in what they
materialize and in their schedule."""
from moagen.moa.expr import Scalar, array, exp, inner, lift, named, omega, psi, reduce, transpose
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.schedule import Accumulate, Hoist, Parallel

Q = array("Q", "batch", "heads", "n", "d")
K = array("K", "batch", "heads", "n", "d")
V = array("V", "batch", "heads", "n", "d")


def _one_head(q, k, v):
    scores = named("scores", Scalar("scale") * inner(q, transpose(k), var="c", name="qk"),
                   index=("i", "j"))
    row_max = reduce("max", scores, axis=1, var="j", name="row_max")
    weights = exp(omega("-", scores, row_max))
    row_sum = reduce("+", weights, axis=1, var="j", name="row_sum")
    probs = named("probs", omega("/", weights, row_sum), index=("i", "j"))
    return inner(probs, v, var="j", name="acc")


SPEC = KernelSpec(
    name="attention_fwd",
    inputs=(Q, K, V),
    scalars=("scale",),
    outputs=(Output("O", lift(("b", "h"), ("batch", "heads"),
                              _one_head(psi(("b", "h"), Q), psi(("b", "h"), K),
                                        psi(("b", "h"), V))),
                    index=("b", "h", "i", "c")),),
)

ROWS = Parallel(("b", "h", "i"))
VARIANTS = {
    # the standard implementation: the n x n scores and probabilities live in memory
    "naive": (frozenset({"scores", "probs"}), (Hoist(), ROWS)),
    # row-wise: nothing of size n x n; each row's max and sum are computed once, and each
    # probability once per key, then spread over the output row
    "dnf": (frozenset(), (Accumulate("c", over="j"), Hoist(), ROWS)),
}
