"""The transformer block, composed from the kernels above (moagen.kernels.compose): no
block code is written by hand.

    forward   xn1 = rmsnorm(x)            Q, K, V = xn1 Wq, xn1 Wk, xn1 Wv (per head)
              attn, lse = attention(Q, K, V)   (block_fwd_causal: causal attention)
              resid = x + attn Wo         xn2 = rmsnorm(resid)
              y = resid + mlp(xn2)
    backward  derived: the chain rule through the same stages in reverse, each stage's
              backward as its kernel declares it (moagen.kernels.chain); xn1 and xn2 are
              recomputed from x, resid and the kept per-row statistics, the MLP's H
              from its kept U and V; the residuals' cotangents summed.

What the forward returns besides y is derived too: the intermediates the backward reads.
"""
import math
from dataclasses import replace

from moagen import reference_block
from moagen.kernels.cases import Check, on_model, references
from moagen.kernels import attention_bwd, mlp, projections, rmsnorm
from moagen.kernels.chain import vjp
from moagen.kernels.compose import Composite, Stage
from moagen.kernels.rmsnorm import EPS, positive_eps, recomputing
from moagen.moa.expr import array

X = array("x", "batch", "n", "dm")
NORM1, NORM2 = array("norm1", "dm"), array("norm2", "dm")
WQ, WK, WV = (array(w, "dm", "heads", "dh") for w in ("Wq", "Wk", "Wv"))
WO = array("Wo", "heads", "dh", "dm")
WG, WU = array("Wg", "dm", "dff"), array("Wu", "dm", "dff")
WD = array("Wd", "dff", "dm")
WEIGHTS = (NORM1, WQ, WK, WV, WO, NORM2, WG, WU, WD)
ON_MODEL = {"d": "dm"}  # RMSNorm's feature axis is the model axis
ON_HEAD = {"d": "dh"}  # attention's feature axis is a head's


def _same(*names):
    return {name: name for name in names}


def _forward(causal: bool) -> Composite:
    return Composite(
        name="block_fwd_causal" if causal else "block_fwd",
        inputs=(X,) + WEIGHTS,
        scalars=("eps", "scale"),
        stages=(
            Stage("norm1", "rmsnorm_fwd", "dnf",
                  {"x": "x", "weight": "norm1", "z": "xn1", "inv_rms": "inv_rms1"}, ON_MODEL),
            Stage("qkv", "qkv_proj", "tiled",
                  {"X": "xn1", **_same("Wq", "Wk", "Wv", "Q", "K", "V")}),
            Stage("attn", "attention_fwd_causal" if causal else "attention_fwd", "flash",
                  {"O": "attn", **_same("Q", "K", "V", "lse")}, ON_HEAD),
            Stage("out", "out_proj", "tiled", {"O": "attn", "Wo": "Wo", "R": "x", "Y": "resid"}),
            Stage("norm2", "rmsnorm_fwd", "dnf",
                  {"x": "resid", "weight": "norm2", "z": "xn2", "inv_rms": "inv_rms2"},
                  ON_MODEL),
            Stage("mlp", "mlp_fwd", "tiled",
                  {"X": "xn2", "F": "mlp_out", **_same("Wg", "Wu", "Wd", "U"), "V": "Vu"}),
            Stage("add", "residual_add", "dnf", {"x": "resid", "R": "mlp_out", "y": "y"}),
        ),
        outputs=("y",),
    )


# each stage's backward as its kernel declares it (CHAIN: the derived backward, the
# pass-throughs, what is recomputed)
STAGE_BACKWARDS = {**rmsnorm.CHAIN, **projections.CHAIN, **attention_bwd.CHAIN, **mlp.CHAIN}


def _with_backward(causal: bool):
    """(the forward, keeping what its backward reads; the backward, derived)."""
    forward = _forward(causal)
    backward = vjp(forward, STAGE_BACKWARDS, projections.SUM,
                   name=forward.name.replace("_fwd", "_bwd"))
    return replace(forward, keep_for=backward), backward


(FORWARD, BACKWARD), (CAUSAL_FORWARD, CAUSAL_BACKWARD) = _with_backward(False), _with_backward(True)
# the derived backward's name as the kernels' (moagen.kernels.ALIASES)
ALIASES = {"block_fwd_vjp": "block_bwd", "block_fwd_causal_vjp": "block_bwd_causal"}


KERNELS = [(FORWARD, None, positive_eps("block_fwd")), (BACKWARD, None),
           (CAUSAL_FORWARD, None, positive_eps("block_fwd_causal")), (CAUSAL_BACKWARD, None)]

# What verification and the benchmarks run these kernels on (moagen.kernels.cases): one
# row, a partial row tile and widths below a tile; sizes that divide nothing.
CHECK_SIZES = (dict(batch=1, n=1, dm=3, heads=1, dh=2, dff=5),
               dict(batch=2, n=7, dm=13, heads=3, dh=5, dff=19),
               dict(batch=1, n=37, dm=40, heads=2, dh=19, dff=101))
MATRICES = tuple(w.name for w in (WQ, WK, WV, WO, WG, WU, WD))


def _scalars(sizes):
    return {"eps": EPS, "scale": 1 / math.sqrt(sizes["dh"])}


def _initialized(arrays, scalars):
    """Weights scaled by 1/sqrt(fan-in), as a model is initialized, so that activations
    stay O(1) through the block."""
    fan_in = lambda w: math.prod(arrays[w].shape[:2 if w == "Wo" else 1])  # Wo: heads x dh
    return dict(arrays, **{w: arrays[w] / math.sqrt(fan_in(w)) for w in MATRICES})


def _kept(causal):
    def with_activations(arrays, scalars):
        """The backward's kept activations, from the forward on the same x and weights."""
        arrays = _initialized(arrays, scalars)
        activations = reference_block.block_fwd_numpy(
            *(arrays[a.name] for a in FORWARD.inputs), eps=EPS, scale=scalars["scale"],
            causal=causal)[1:]
        return dict(arrays, **dict(zip(FORWARD.kept(), activations)))
    return with_activations


def _checks(causal):
    suffix = "_causal" if causal else ""
    return {
        f"block_fwd{suffix}": Check(references(reference_block.block_fwd_numpy,
                                               reference_block.block_fwd_torch, causal=causal),
                                    CHECK_SIZES, _scalars, inputs=_initialized),
        f"block_bwd{suffix}": Check(
            recomputing(reference_block.block_bwd_numpy, reference_block.block_bwd_torch,
                        causal=causal),
            CHECK_SIZES, lambda sizes: {"scale": _scalars(sizes)["scale"]},
            inputs=_kept(causal)),
    }


def _benches(causal):
    suffix = "_causal" if causal else ""
    return {
        f"block_fwd{suffix}": _ON_MODEL.measured_against(
            "block", "y and the kept activations by the stages' baselines; no lse (SDPA "
                     "returns none)", outputs=(0, 1, 2, 3, 4, 5, 7, 8, 9, 10), causal=causal),
        f"block_bwd{suffix}": _ON_MODEL.measured_against(
            "block_bwd", "the ten gradients by autograd of the block, the forward recomputed "
                         "(the kept activations unused)", eps=EPS, causal=causal),
    }


_ON_MODEL = on_model("dm", "heads", "dh", "dff")
CHECKS = {**_checks(False), **_checks(True)}
BENCH = {**_benches(False), **_benches(True)}
