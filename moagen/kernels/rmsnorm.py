"""RMSNorm over the feature axis of every (batch, position) row:

    forward   r = 1 / sqrt(mean(x^2) + eps),  z = weight * x * r
    backward  dx = dz * r * weight - x * r^3 * sum(dz * weight * x) / d
                 (= r * (g - xhat * mean(g * xhat)),  xhat = x * r,  g = dz * weight)
              dweight = sum over rows of dz * r * x

The forward keeps the per-row statistic r (inv_rms) for the backward, never x / r. The
backward is derived from the forward's spec (moagen.moa.grad), not written by hand."""
from dataclasses import replace
from functools import partial

import numpy as np

from moagen import reference_block
from moagen.cuda_archs import WARP
from moagen.kernels.cases import Bench, Check, references
from moagen.kernels.chain import backward
from moagen.kernels.layers import Layers, cpu
from moagen.kernels.tunable import Tunable
from moagen.moa.expr import Scalar, array, dim, lift, named, psi, reduce, rsqrt
from moagen.moa.grad import grad
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.algebra.partials import PartialSums
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.gpu_blocks import GpuBlocks
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import GpuThreads, Parallel
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.unroll import rows_together, tiled

X = array("x", "batch", "n", "d")
WEIGHT = array("weight", "d")
INV_RMS = array("inv_rms", "batch", "n")
ROWS, EXTENTS = ("b", "i"), ("batch", "n")


def _inv_rms(row):
    mean_sq = reduce("+", row * row, axis=0, var="c", name="sum_sq") / dim("d")
    return named("inv_rms", rsqrt(mean_sq + Scalar("eps")), index=())


FORWARD = KernelSpec(
    name="rmsnorm_fwd",
    inputs=(X, WEIGHT),
    scalars=("eps",),
    outputs=(Output("z", lift(ROWS, EXTENTS, WEIGHT * psi(ROWS, X) * _inv_rms(psi(ROWS, X))),
                    index=("b", "i", "c")),
             Output("inv_rms", lift(ROWS, EXTENTS, _inv_rms(psi(ROWS, X))), index=ROWS)),
)


# how the backward is derived (moagen.moa.grad; `moagen grad rmsnorm_fwd`): dz given for z,
# inv_rms the kept statistic, x * r recomputed from it
VJP = {"rmsnorm_fwd": dict(wrt={"x": ROWS + ("c",), "weight": ("c",)}, cotangents=("z",))}


def _backward(name):
    return grad(FORWARD, name=name, **VJP["rmsnorm_fwd"])


def positive_eps(kernel):
    """A validate hook: 1 / sqrt(mean(x^2) + eps) needs eps > 0 (a zero row would divide by
    zero). Sizes alone (the cost model's check) pass."""
    def validate(sizes, scalars):
        if "eps" in scalars and not scalars["eps"] > 0:
            raise ValueError(f"{kernel}: eps must be positive, got {scalars['eps']}")
    return validate


ROW_SPACE = {"rows": (1, 2, 4)}
ROW_THREADS = 256  # a row's block on a GPU: a row of 1024 features is 4 a thread


def _one_pass(rows):
    """One pass per row: the statistic is stored and used while the row is in cache (rows >
    1: a few rows at a time, their sums of squares independent chains of adds). On a GPU a
    thread block per row, its threads sharing the row's features: the sum of squares a
    block-wide reduction (one thread a row would leave most of a GPU idle at batch * n rows
    and read a row's features a thread apart, uncoalesced)."""
    return Layers(algorithm=(FuseNests(("inv_rms", "z"), over=ROWS, name="rows"), Hoist()),
                  schedule=(LowerReductions(), *rows_together("rows", "i", rows)),
                  mapping={"cpu": (Parallel(ROWS[:-1] + (tiled("i", rows),), nest="rows"),),
                           "cuda": (GpuBlocks(ROWS, nest="rows", block=ROW_THREADS, across="c"),)})


FORWARD_VARIANTS = {
    # as a framework does it: the statistic is a pass of its own, then a second pass scales
    "naive": (frozenset(), Layers(algorithm=(Hoist(),),
                                  mapping=cpu(Parallel(ROWS, nest="z"),
                                              Parallel(ROWS, nest="inv_rms")))),
    "dnf": Tunable(frozenset(), _one_pass, defaults={"rows": 1}, space=ROW_SPACE),
}
PARTS = 16  # dweight's partial sums: fixed, so the result does not depend on the threads
# on a GPU a block a part: 528 blocks are two full waves of an H200's 132 SMs at 2 blocks of
# 1024 threads an SM (moagen.cost.gpu), every part 2 rows at the bench's 1024 (16 at 8192)
GPU_PARTS, PART_THREADS = 528, 1024
# the merge's thread a feature: blocks of a warp, so that a row of 1024 features is spread
# over 32 SMs (each thread's part-by-part loads the whole merge's traffic)
MERGE_THREADS = WARP
DWEIGHT_PARTS = PartialSums("dweight", "i", PARTS)


def _one_pass_backward(parts):
    """One pass over the rows: each part's rows compute their dx and add to the part's
    dweight while the row is in cache; then dweight the parts' sums, merged in part order.
    On a GPU a block a part, its threads sharing the features (a row's sum(dz * weight * x)
    a block reduction, a thread's dweight partial its own features'), then a thread a
    feature merging the parts: no atomics, the same bits on every run."""
    partials = replace(DWEIGHT_PARTS, parts=parts, rows="dx")
    merge = GpuThreads(("c",), nest=partials.nest, block=MERGE_THREADS)
    # the GPU's row sums as loops, for the block's threads to share
    return Layers(algorithm=(partials, Hoist()),
                  schedule={"cpu": (), "cuda": (LowerReductions(),)},
                  mapping={"cpu": (Parallel((partials.part,), nest=partials.partial),),
                           "cuda": (GpuBlocks((partials.part,), nest=partials.partial,
                                              block=PART_THREADS, across="c"), merge),
                           # CUDA's parts (OpenACC takes its defaults), a vector lane each
                           "openacc": (GpuThreads((partials.part,), nest=partials.partial),
                                       merge)})


BACKWARD_VARIANTS = {
    # dx row by row, then dweight's partial sums: x and dz are read twice
    "naive": (frozenset(), Layers(algorithm=(DWEIGHT_PARTS, Hoist()),
                                  mapping=cpu(Parallel(ROWS, nest="dx"),
                                              Parallel((DWEIGHT_PARTS.part,),
                                                       nest=DWEIGHT_PARTS.partial)))),
    "dnf": Tunable(frozenset(), _one_pass_backward, defaults={"parts": PARTS}, space={},
                   cuda={"parts": GPU_PARTS}),
}

# the forward's scaling alone, from a kept statistic: how a backward recomputes x / r
APPLY = KernelSpec(
    name="rmsnorm_apply",
    inputs=(X, WEIGHT, INV_RMS),
    scalars=(),
    outputs=(Output("z", lift(ROWS, EXTENTS, WEIGHT * psi(ROWS, X) * psi(ROWS, INV_RMS)),
                    ("b", "i", "c")),),
)

BACKWARD = _backward("rmsnorm_bwd")
KERNELS = [(FORWARD, FORWARD_VARIANTS, positive_eps("rmsnorm_fwd")),
           (BACKWARD, BACKWARD_VARIANTS),
           # on a GPU a block a row, as the forward's (a thread a row reads a row's features
           # a thread apart, uncoalesced)
           (APPLY, {"dnf": (frozenset(), Layers(mapping={
               "cpu": (Parallel(ROWS),),
               "cuda": (GpuBlocks(ROWS, block=ROW_THREADS, across="c"),)}))})]

# What verification and the benchmarks run these kernels on (moagen.kernels.cases).
EPS = 1e-5  # the eps of the checks, and of the statistics a backward is given
CHECK_SIZES = (dict(batch=1, n=1, d=3), dict(batch=2, n=7, d=80), dict(batch=3, n=257, d=5))


def kept_statistic(arrays, scalars):
    """The backward's inv_rms is the forward's, with eps = EPS."""
    x = arrays["x"]
    return dict(arrays, inv_rms=1 / np.sqrt(np.mean(x * x, axis=-1) + EPS))


def recomputing(numpy, torch, **keywords):
    """The references of a backward given kept statistics, both given `keywords`: PyTorch's
    autograd recomputes the statistics, with eps = EPS."""
    return references(numpy, partial(torch, eps=EPS), **keywords)


CHECKS = {
    "rmsnorm_fwd": Check(references(reference_block.rmsnorm_fwd_numpy,
                                    reference_block.rmsnorm_fwd_torch), CHECK_SIZES,
                         lambda sizes: {"eps": EPS}),
    # n past the 16 partial sums, uneven
    "rmsnorm_bwd": Check(recomputing(reference_block.rmsnorm_bwd_numpy,
                                     reference_block.rmsnorm_bwd_torch),
                         CHECK_SIZES + (dict(batch=2, n=40, d=33),), inputs=kept_statistic),
    "rmsnorm_apply": Check(references(reference_block.rmsnorm_apply_numpy,
                                      reference_block.rmsnorm_apply_torch), CHECK_SIZES,
                           inputs=kept_statistic),
}
ROWS_OF_1024 = Bench(lambda n: dict(batch=1, n=n, d=1024), quick=(1024,), full=(1024, 8192))
BENCH = {"rmsnorm_fwd": ROWS_OF_1024.measured_against(
             "rmsnorm", "z and inv_rms (the backward's) in the operators F.rms_norm runs on "
                        "a CPU: pow, mean, rsqrt, two products"),
         "rmsnorm_bwd": ROWS_OF_1024.measured_against(
             "rmsnorm_bwd", "dx, dweight by autograd of F.rms_norm, the statistic recomputed "
                            "(inv_rms unused)", eps=EPS),
         "rmsnorm_apply": ROWS_OF_1024.measured_against(
             "rmsnorm_apply", "z = x * inv_rms * weight, two products")}
# the name a derived backward has (moagen.kernels.ALIASES)
ALIASES = {"rmsnorm_fwd_vjp": "rmsnorm_bwd"}
# a stage's backward in a composite (moagen.kernels.chain): z recomputed from the kept
# statistic rather than kept
CHAIN = {"rmsnorm_fwd": backward(FORWARD, BACKWARD, "dnf", recompute=(APPLY, "dnf"))}
