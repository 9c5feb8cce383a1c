"""RMSNorm forward: z = weight * x / sqrt(mean(x^2) + eps) over the feature axis of every
(batch, position) row."""
from moagen.moa.expr import Scalar, array, dim, lift, named, psi, reduce, rsqrt
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.schedule import Hoist, Parallel

X = array("x", "batch", "n", "d")
WEIGHT = array("weight", "d")


def _one_row(row):
    mean_sq = reduce("+", row * row, axis=0, var="c", name="sum_sq") / dim("d")
    return WEIGHT * row * named("inv_rms", rsqrt(mean_sq + Scalar("eps")))


SPEC = KernelSpec(
    name="rmsnorm_fwd",
    inputs=(X, WEIGHT),
    scalars=("eps",),
    outputs=(Output("z", lift(("b", "i"), ("batch", "n"), _one_row(psi(("b", "i"), X))),
                    index=("b", "i", "c")),),
)

ROWS = Parallel(("b", "i"))
VARIANTS = {
    # as a framework does it: the per-row 1/rms goes to memory, then a second pass scales
    "naive": (frozenset({"inv_rms"}), (Hoist(), ROWS)),
    # one pass per row: the statistic stays in a register
    "dnf": (frozenset(), (Hoist(), ROWS)),
}

KERNELS = [(SPEC, VARIANTS)]
