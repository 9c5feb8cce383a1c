"""Verification: every kernel, variant, language and dtype against numpy and PyTorch, on
sizes that divide nothing.

The error of an output is normwise: max |ours - reference| / max(max |reference|, 1), so that
it does not blow up on entries near zero. The inputs are unit normal and the outputs O(1);
the floor of 1 matters only where a whole reference is zero up to rounding, e.g. every
attention gradient when n = 1 (then P = 1 and dS = 0 exactly). float64 must agree to FLOAT64_TOL. float32 inputs
are compared with the float64 reference on the same (float32-rounded) inputs; its bound
comes from the unit roundoff u = 6e-8 times the longest sum in these kernels (n + d terms,
up to 337 here): 337 * 6e-8 = 2e-5. Observed float32 errors are 1e-7 to 1e-6.
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from moagen import reference, reference_block, runtime
from moagen.pipeline import onf_of
from moagen.codegen.printer import signature
from moagen.errors import DeviceUnavailable, UnknownNameError
from moagen.kernels import KERNELS, get_kernel
from moagen.kernels.block import FORWARD as BLOCK_FORWARD
from moagen.onf.signature import DTYPES

TOLERANCE = {"float64": 1e-12, "float32": 2e-5}
CPU_LANGS = ("c", "fortran")


def default_langs():
    """C and Fortran always; CUDA where a GPU is there to run it."""
    from moagen.bind import cuda
    return CPU_LANGS + (("cuda",) if cuda.available() else ())


@dataclass(frozen=True)
class Check:
    scalars: Callable[[dict], dict]  # the scalar arguments for given sizes
    references: Dict[str, Callable]  # name -> f(*inputs as float64, **scalars) -> output(s)
    sizes: Tuple[dict, ...]  # n = 1, primes, sizes that divide no tile
    # inputs that depend on each other (a backward's O and lse come from its forward);
    # by default every input is random normal
    inputs: Optional[Callable] = None  # f(random inputs as float64 by name, scalars) -> dict


ATTENTION_SIZES = (dict(batch=1, heads=1, n=1, d=3), dict(batch=2, heads=3, n=7, d=5),
                   dict(batch=1, heads=2, n=257, d=80))


def _attention_scale(sizes):
    return {"scale": 1 / math.sqrt(sizes["d"])}


def _forward_of(causal):
    """The backward's O and lse, computed from its Q, K and V in float64."""
    def consistent(arrays, scalars):
        Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
        O, lse = reference.attention_fwd_numpy(Q, K, V, scalars["scale"], causal)
        return dict(arrays, O=O, lse=lse)
    return consistent


RMSNORM_EPS = 1e-5
RMSNORM_SIZES = (dict(batch=1, n=1, d=3), dict(batch=2, n=7, d=80), dict(batch=3, n=257, d=5))


def _rmsnorm_forward(arrays, scalars):
    """The backward's inv_rms is the forward's, with eps = RMSNORM_EPS."""
    x = arrays["x"]
    return dict(arrays, inv_rms=1 / np.sqrt(np.mean(x * x, axis=-1) + RMSNORM_EPS))


# tiles are 4 rows x 8 columns: one row, a partial row tile, widths below and past a tile
MLP_SIZES = (dict(batch=1, n=1, dm=3, dff=5), dict(batch=2, n=7, dm=13, dff=19),
             dict(batch=1, n=37, dm=80, dff=203))


PROJECTION_SIZES = (dict(batch=1, n=1, dm=3, heads=1, dh=2),
                    dict(batch=2, n=7, dm=13, heads=3, dh=5),
                    dict(batch=1, n=37, dm=80, heads=2, dh=19))


# one row, a partial row tile and widths below a tile; sizes that divide nothing
BLOCK_SIZES = (dict(batch=1, n=1, dm=3, heads=1, dh=2, dff=5),
               dict(batch=2, n=7, dm=13, heads=3, dh=5, dff=19),
               dict(batch=1, n=37, dm=40, heads=2, dh=19, dff=101))
BLOCK_WEIGHTS = ("Wq", "Wk", "Wv", "Wo", "Wg", "Wu", "Wd")


def _block_scalars(sizes):
    return {"eps": RMSNORM_EPS, "scale": 1 / math.sqrt(sizes["dh"])}


def _block_weights(arrays, scalars):
    """Weights scaled by 1/sqrt(fan-in), as a model is initialized, so that activations
    stay O(1) through the block."""
    fan_in = lambda w: math.prod(arrays[w].shape[:2 if w == "Wo" else 1])  # Wo: heads x dh
    return dict(arrays, **{w: arrays[w] / math.sqrt(fan_in(w)) for w in BLOCK_WEIGHTS})


def _block_forward(arrays, scalars):
    """The backward's kept activations, from the forward on the same x and weights."""
    arrays = _block_weights(arrays, scalars)
    kept = reference_block.block_fwd_numpy(*(arrays[a.name] for a in BLOCK_FORWARD.inputs),
                                           eps=RMSNORM_EPS, scale=scalars["scale"])[1:]
    return dict(arrays, **dict(zip(BLOCK_FORWARD.kept(), kept)))


def _mlp_forward(arrays, scalars):
    """The backward's U is the forward's X Wg."""
    return dict(arrays, U=arrays["X"] @ arrays["Wg"])


def _block_check(name, sizes, inputs=None, scalars=lambda s: {}, torch_eps=False) -> Check:
    """A block-family kernel against moagen.reference_block's <name>_numpy and
    <name>_torch (given the eps its kept statistics were computed with, where it needs it)."""
    torch = getattr(reference_block, f"{name}_torch")
    return Check(scalars=scalars,
                 references={"numpy": getattr(reference_block, f"{name}_numpy"),
                             "torch": partial(torch, eps=RMSNORM_EPS) if torch_eps else torch},
                 sizes=sizes, inputs=inputs)


CHECKS = {
    "attention_fwd": Check(
        scalars=_attention_scale,
        references={"numpy": reference.attention_fwd_numpy, "torch": reference.attention_fwd_torch},
        sizes=ATTENTION_SIZES,
    ),
    "attention_fwd_causal": Check(
        scalars=_attention_scale,
        references={"numpy": partial(reference.attention_fwd_numpy, causal=True),
                    "torch": partial(reference.attention_fwd_torch, causal=True)},
        sizes=ATTENTION_SIZES,
    ),
    **{name: Check(
        scalars=_attention_scale,
        references={"numpy": partial(reference.attention_bwd_numpy, causal=causal),
                    "torch": partial(reference.attention_bwd_torch, causal=causal)},
        sizes=ATTENTION_SIZES,
        inputs=_forward_of(causal),
    ) for name, causal in (("attention_bwd", False), ("attention_bwd_causal", True))},
    **{name: Check(
        scalars=_attention_scale,
        references={"numpy": partial(reference.attention_fwdbwd_numpy, causal=causal),
                    "torch": partial(reference.attention_fwdbwd_torch, causal=causal)},
        sizes=ATTENTION_SIZES,
    ) for name, causal in (("attention_fwdbwd", False), ("attention_fwdbwd_causal", True))},
    "attention_decode": Check(
        scalars=_attention_scale,
        references={"numpy": reference.attention_decode_numpy,
                    "torch": reference.attention_decode_torch},
        # MHA, GQA (3 query heads a KV head), MQA; n = cap and n < cap
        sizes=(dict(batch=1, q_heads=1, kv_heads=1, cap=1, d=3, n=1),
               dict(batch=2, q_heads=6, kv_heads=2, cap=11, d=5, n=7),
               dict(batch=1, q_heads=8, kv_heads=1, cap=300, d=80, n=257)),
    ),
    "kv_append": Check(
        scalars=lambda sizes: {},
        references={"numpy": reference.kv_append_numpy, "torch": reference.kv_append_torch},
        # into an empty cache, the middle, the last row
        sizes=(dict(batch=1, kv_heads=1, cap=1, d=3, n=0), dict(batch=2, kv_heads=3, cap=7, d=5, n=4),
               dict(batch=1, kv_heads=2, cap=257, d=80, n=256)),
    ),
    "rmsnorm_fwd": _block_check("rmsnorm_fwd", RMSNORM_SIZES,
                                scalars=lambda s: {"eps": RMSNORM_EPS}),
    # n past the 16 partial sums, uneven
    "rmsnorm_bwd": _block_check("rmsnorm_bwd", RMSNORM_SIZES + (dict(batch=2, n=40, d=33),),
                                _rmsnorm_forward, torch_eps=True),
    "rmsnorm_apply": _block_check("rmsnorm_apply", RMSNORM_SIZES, _rmsnorm_forward),
    **{name: _block_check(name, PROJECTION_SIZES)
       for name in ("qkv_proj", "qkv_proj_bwd", "out_proj", "out_proj_bwd")},
    "residual_add": _block_check("residual_add", tuple({k: s[k] for k in ("batch", "n", "dm")}
                                                       for s in PROJECTION_SIZES)),
    "block_fwd": _block_check("block_fwd", BLOCK_SIZES, _block_weights, scalars=_block_scalars),
    "block_bwd": _block_check("block_bwd", BLOCK_SIZES, _block_forward, torch_eps=True,
                              scalars=lambda s: {"scale": _block_scalars(s)["scale"]}),
    "mlp_fwd": _block_check("mlp_fwd", MLP_SIZES),
    "mlp_bwd": _block_check("mlp_bwd", MLP_SIZES, _mlp_forward),
}


@dataclass(frozen=True)
class Row:
    kernel: str
    variant: str
    lang: str
    dtype: str
    sizes: str
    errors: Dict[str, float]  # reference name -> normwise relative error
    status: str  # "pass", "FAIL" or "skip: why"

    @property
    def failed(self):
        return self.status == "FAIL"


def make_inputs(sig, sizes, scalars, check, rng):
    """The kernel's inputs at these sizes, in its dtype: random normal, then made
    consistent by the check (in float64) where inputs depend on each other."""
    env = {s: sizes[s.name] for s in sig.sizes}
    arrays = {a.name: rng.standard_normal(tuple(int(dim.subs(env)) for dim in a.shape))
              for a in sig.inputs}
    if check.inputs:
        arrays = check.inputs(arrays, scalars)
    return [np.ascontiguousarray(arrays[a.name], dtype=sig.dtype) for a in sig.inputs]


def normwise_error(ours, ref) -> float:
    return float(np.max(np.abs(ours - ref))) / max(float(np.max(np.abs(ref))), 1.0)


def call_scalars(kernel, sizes) -> dict:
    """A call's keyword arguments: the scalars, and the sizes no input shape determines (a
    KV cache's valid rows)."""
    given = {g: sizes[g] for g in get_kernel(kernel).given}
    return dict(CHECKS[kernel].scalars(sizes), **given)


def check_case(kernel, variant, lang, dtype, sizes, load, seed=0) -> Row:
    """Run one kernel variant on one set of sizes and compare with every reference."""
    label = " ".join(f"{k}={v}" for k, v in sizes.items())
    check = CHECKS[kernel]
    sig = signature(onf_of(kernel, variant), dtype)
    try:
        fn = load(kernel, variant, lang, dtype)
    except DeviceUnavailable as why:
        return Row(kernel, variant, lang, dtype, label, {}, f"skip: {why}")
    scalars = call_scalars(kernel, sizes)
    inputs = make_inputs(sig, sizes, scalars, check, np.random.default_rng(seed))
    outputs = fn(*inputs, **scalars)
    outputs = () if outputs is None else outputs if isinstance(outputs, tuple) else (outputs,)
    # what a kernel updates in place is part of its result
    outputs += tuple(a for a, p in zip(inputs, sig.inputs) if p.intent == "inout")
    wide = [a.astype(np.float64) for a in inputs]
    errors = {}
    for name, ref in check.references.items():
        expected = ref(*wide, **scalars)
        expected = expected if isinstance(expected, tuple) else (expected,)
        errors[name] = max(normwise_error(o, e) for o, e in zip(outputs, expected))
    ok = all(e <= TOLERANCE[dtype] for e in errors.values())
    return Row(kernel, variant, lang, dtype, label, errors, "pass" if ok else "FAIL")


def run(kernels=None, langs=CPU_LANGS, variants=None, dtypes=DTYPES,
        load=partial(runtime.load, tuned=False)):
    """Yield a Row per kernel x variant x language x dtype x sizes."""
    for name in kernels or KERNELS:
        kernel = get_kernel(name)
        if name not in CHECKS:
            raise UnknownNameError(f"kernel {name} has no verification cases")
        for variant in variants or kernel.variants:
            kernel.variant(variant)
            for lang in langs:
                for dtype in dtypes:
                    for sizes in CHECKS[name].sizes:
                        yield check_case(name, variant, lang, dtype, sizes, load)


def format_row(row: Row) -> str:
    errs = "  ".join(f"{k} {v:.1e}" for k, v in row.errors.items()) or "-"
    return (f"{row.kernel:<22} {row.variant:<7} {row.lang:<8} {row.dtype:<8} {row.sizes:<34} "
            f"{errs:<28} {row.status}")


HEADER = (f"{'kernel':<22} {'variant':<7} {'lang':<8} {'dtype':<8} {'sizes':<34} "
          f"{'max relative error vs':<28} result")
