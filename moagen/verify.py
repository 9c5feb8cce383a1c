"""Verification: every kernel, variant, language and dtype against numpy and PyTorch, on
sizes that divide nothing; each kernel's module declares its references, sizes and scalars
(its `check`, moagen.kernels.cases).

The error of an output is normwise: max |ours - reference| / max(max |reference|, 1), so that
it does not blow up on entries near zero. The inputs are unit normal and the outputs O(1);
the floor of 1 matters only where a whole reference is zero up to rounding, e.g. every
attention gradient when n = 1 (then P = 1 and dS = 0 exactly). float64 must agree to FLOAT64_TOL. float32 inputs
are compared with the float64 reference on the same (float32-rounded) inputs; its bound
comes from the unit roundoff u = 6e-8 times the longest sum in these kernels (n + d terms,
up to 337 here): 337 * 6e-8 = 2e-5. Observed float32 errors are 1e-7 to 1e-6.
"""
from dataclasses import dataclass
from functools import partial
from typing import Dict

import numpy as np

from moagen import runtime
from moagen.errors import DeviceUnavailable, EmulationCheckError
from moagen.kernels import KERNELS, get_kernel
from moagen.onf.signature import DTYPES
from moagen.request import resolve
from moagen.targets import LANGS, emulated, get_target

TOLERANCE = {"float64": 1e-12, "float32": 2e-5}


def default_langs():
    """The languages whose kernels run here: C and Fortran always; CUDA on a GPU where one
    is, and emulated on the host where none is."""
    chosen = (lang if get_target(lang).runs_here() else emulated(lang) for lang in LANGS)
    return tuple(name for name in chosen if get_target(name).runs_here())


@dataclass(frozen=True)
class Row:
    kernel: str
    variant: str
    lang: str
    dtype: str
    sizes: str
    errors: Dict[str, float]  # reference name -> normwise relative error
    status: str  # "pass", "FAIL", "FAIL: why" (a check of the CUDA emulation) or "skip: why"

    @property
    def failed(self):
        return self.status.startswith("FAIL")


# the inputs drawn at random, by element type: floats normal, bools (masks) true where the
# normal draw is above -0.5 (about seven in ten)
DRAWN = {"": lambda draw: draw, "bool": lambda draw: draw > -0.5}


def make_inputs(sig, sizes, scalars, check, rng):
    """The kernel's inputs at these sizes: its float ones in its dtype, random normal, then
    made consistent by its check (in float64) where inputs depend on each other; its
    integer ones (offsets) as its check's `integers` gives them at these sizes."""
    env = {s: sizes[s.name] for s in sig.sizes if s.name in sizes}  # a chosen one shapes no input
    drawn = [a for a in sig.inputs if a.element in DRAWN]
    arrays = {a.name: DRAWN[a.element](rng.standard_normal(tuple(int(dim.subs(env))
                                                                  for dim in a.shape)))
              for a in drawn}
    if len(drawn) < len(sig.inputs):
        if check.integers is None:
            raise ValueError(f"{sig.name}: its integer inputs need its Check's `integers`")
        arrays.update(check.integers(sizes))
    if check.inputs:  # with the offsets: a varlen backward's O and lse from its forward
        arrays = check.inputs(arrays, scalars)
    return [np.ascontiguousarray(arrays[a.name], dtype=a.dtype(sig.dtype)) for a in sig.inputs]


def normwise_error(ours, ref) -> float:
    """Equal entries agree, infinities too (a varlen row that sees no key: lse -inf); a NaN,
    or an infinity where the reference has another value, is an infinite error."""
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(ours == ref, 0.0, ours - ref))
    if not diff.size:
        return 0.0
    finite = np.abs(ref[np.isfinite(ref)])
    worst = np.inf if np.isnan(diff).any() else float(np.max(diff))
    return worst / max(float(np.max(finite)) if finite.size else 0.0, 1.0)


def call_scalars(kernel, sizes) -> dict:
    """A call's keyword arguments: the scalars, and the sizes no input shape determines (a
    KV cache's valid rows)."""
    given = {g: sizes[g] for g in get_kernel(kernel).given}
    return dict(get_kernel(kernel).check.scalars(sizes), **given)


def check_case(kernel, variant, lang, dtype, sizes, load, seed=0) -> Row:
    """Run one kernel variant on one set of sizes and compare with every reference."""
    label = " ".join(f"{k}={v}" for k, v in sizes.items())
    check = get_kernel(kernel).check
    sig = resolve(kernel, variant, lang, dtype, here=False).signature()  # its inputs
    try:
        fn = load(kernel, variant, lang, dtype)
    except DeviceUnavailable as why:
        return Row(kernel, variant, lang, dtype, label, {}, f"skip: {why}")
    scalars = call_scalars(kernel, sizes)
    inputs = make_inputs(sig, sizes, scalars, check, np.random.default_rng(seed))
    try:
        outputs = fn(*inputs, **scalars)
    except EmulationCheckError as why:  # the race check's: a row failed, the others run on
        return Row(kernel, variant, lang, dtype, label, {}, f"FAIL: {why}")
    outputs = () if outputs is None else outputs if isinstance(outputs, tuple) else (outputs,)
    # what a kernel updates in place is part of its result
    outputs += tuple(a for a, p in zip(inputs, sig.inputs) if p.intent == "inout")
    wide = [a if p.element else a.astype(np.float64) for a, p in zip(inputs, sig.inputs)]
    errors = {}
    for name, ref in check.references.items():
        expected = ref(*wide, **scalars)
        expected = expected if isinstance(expected, tuple) else (expected,)
        errors[name] = max(normwise_error(o, e) for o, e in zip(outputs, expected))
    ok = all(e <= TOLERANCE[dtype] for e in errors.values())
    return Row(kernel, variant, lang, dtype, label, errors, "pass" if ok else "FAIL")


def run(kernels=None, langs=None, variants=None, dtypes=DTYPES,
        load=partial(runtime.load, tuned=False)):
    """Yield a Row per kernel x variant x language (by default those that run here) x dtype
    x sizes; each variant at the defaults this machine loads (its AVX-512 tiles where the
    compiler targets AVX-512, generated/'s otherwise; not its tuning file's). Unnamed,
    the variants are those that run on the language's kind; a named one on a kind it does
    not run on is an error, before the kernel's first row."""
    kinds = {lang: get_target(lang).kind for lang in langs or default_langs()}
    for name in kernels or KERNELS:
        kernel = get_kernel(name)
        name = kernel.name  # an alias (attention_fwd_vjp) runs as the kernel it names
        for variant in variants or ():
            kernel.variant_on_each(variant, kinds.values())
        for lang, kind in kinds.items():
            for variant in variants or kernel.variants_on(kind):
                for dtype in dtypes:
                    for sizes in kernel.check.sizes:
                        yield check_case(name, variant, lang, dtype, sizes, load)


def format_row(row: Row) -> str:
    errs = "  ".join(f"{k} {v:.1e}" for k, v in row.errors.items()) or "-"
    return (f"{row.kernel:<22} {row.variant:<7} {row.lang:<13} {row.dtype:<8} {row.sizes:<34} "
            f"{errs:<28} {row.status}")


HEADER = (f"{'kernel':<22} {'variant':<7} {'lang':<13} {'dtype':<8} {'sizes':<34} "
          f"{'max relative error vs':<28} result")
