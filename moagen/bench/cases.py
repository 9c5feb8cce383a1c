"""What a sweep runs: each kernel's sizes as a function of one length n, and the callables
timed on the same inputs: generated kernels per language and the numpy and PyTorch
references, which compute the same outputs. Each kernel's module declares its sizes,
lengths and references (its `bench` and `check`, moagen.kernels.cases)."""
import numpy as np

from moagen.errors import DeviceUnavailable, UnknownNameError

BASELINES = ("numpy", "torch")
NO_RESTRICT = "c-norestrict"  # C printed without `restrict` (the c-vs-fortran ablation)
KERNEL_LANGS = ("c", "fortran", "cuda", NO_RESTRICT)


def _bench(kernel: str):
    from moagen.kernels import get_kernel
    return get_kernel(kernel).bench


def sizes(kernel: str, n: int, overrides=None) -> dict:
    """Sizes of a transformer layer's shape, at sequence (or cache) length n; overrides
    replace the kernel's other sizes of the same names (n is never overridden)."""
    base = _bench(kernel).sizes(n)
    bad = {k for k in overrides or {} if k == "n" or not isinstance(overrides[k], int)
           or overrides[k] < 1}
    if bad:
        raise UnknownNameError(f"cannot set {', '.join(sorted(bad))}: give other sizes than n "
                               "as positive integers (n with --n)")
    return {k: (overrides or {}).get(k, v) for k, v in base.items()}


def overridden(kernel: str, overrides) -> dict:
    """The overrides of sizes this kernel has (--size heads=8 means nothing to RMSNorm)."""
    return {k: v for k, v in (overrides or {}).items() if k in _bench(kernel).sizes(1)}


def lengths(kernel: str, quick: bool):
    return _bench(kernel).lengths(quick)


def targets(items):
    """KERNEL[:VARIANT] -> [(kernel, variant)], every variant when none is named."""
    from moagen.kernels import get_kernel
    out = []
    for item in items:
        name, _, variant = item.partition(":")
        kernel = get_kernel(name)
        out += [(kernel.name, kernel.variant(variant).name)] if variant else \
            [(kernel.name, v) for v in kernel.variants]
    return out


def check_impl(lang: str):
    if lang not in KERNEL_LANGS:  # the baselines run next to every language anyway
        raise UnknownNameError(f"unknown language {lang!r}; expected one of {', '.join(KERNEL_LANGS)}")
    if lang == "cuda":
        from moagen.bind import cuda
        if not cuda.available():
            raise DeviceUnavailable("CUDA requested but no GPU (or no pycuda) is available here")
    return lang


def scalars(kernel: str, sizes: dict) -> dict:
    """The call's scalars, and the sizes no input shape determines (a cache's valid rows)."""
    from moagen.verify import call_scalars
    return call_scalars(kernel, sizes)


def inputs(kernel: str, sizes: dict, dtype: str, seed=0, empty=np.empty):
    """The kernel's inputs, consistent where they depend on each other (a backward's O, lse),
    copied into arrays from `empty` (which decides where their pages are first touched)."""
    from moagen.pipeline import onf_of
    from moagen.codegen.printer import signature
    from moagen.kernels import get_kernel
    from moagen.verify import make_inputs
    sig = signature(onf_of(kernel), dtype)
    arrays = make_inputs(sig, sizes, scalars(kernel, sizes), get_kernel(kernel).check,
                         np.random.default_rng(seed))
    placed = [empty(a.shape, a.dtype) for a in arrays]
    for dst, src in zip(placed, arrays):
        np.copyto(dst, src)
    return placed


def kernel_callable(kernel: str, variant: str, lang: str, dtype: str, params=None):
    """A callable(*inputs, out=None, **scalars) for a generated kernel (params: schedule
    parameters over the variant's defaults) or a baseline."""
    from moagen import runtime
    from moagen.kernels import get_kernel
    if lang in BASELINES:
        reference = get_kernel(kernel).check.references[lang]
        return lambda *args, out=None, **kw: reference(*args, **kw)
    if lang == NO_RESTRICT:
        return _load_without_restrict(kernel, variant, dtype)
    return runtime.load(kernel, variant, lang, dtype, params)


def source_without_restrict(kernel, variant, dtypes=("float64", "float32")):
    """The kernel's C, printed with plain pointers: the compiler must assume they alias."""
    from moagen.codegen.c import CPrinter, emit_c
    from moagen.pipeline import onf_of

    class Plain(CPrinter):
        restrict = ""

    onf = onf_of(kernel, variant)
    return emit_c([(dtype, onf) for dtype in dtypes],
                  [f"{onf.name} {onf.variant}, printed without restrict"], printer=Plain)


def _load_without_restrict(kernel, variant, dtype):
    from moagen.bind import bind, load_library
    from moagen.codegen.emit import stem
    from moagen.pipeline import onf_of
    from moagen.codegen.printer import signature
    from moagen.kernels import get_kernel

    onf = onf_of(kernel, variant)
    library = load_library(source_without_restrict(kernel, onf.variant), "c",
                           stem(kernel, onf.variant) + "_norestrict")
    return bind(library, signature(onf, dtype), "c", validate=get_kernel(kernel).validate)


def outputs(fn, sizes):
    """Preallocated outputs of a generated kernel (None for baselines and in-place kernels),
    so that timed calls allocate nothing."""
    sig = getattr(fn, "signature", None)
    if sig is None or not sig.outputs:
        return None
    env = {s: sizes[s.name] for s in sig.sizes}
    outs = tuple(np.empty(tuple(int(d.subs(env)) for d in p.shape), sig.dtype) for p in sig.outputs)
    return outs if len(outs) > 1 else outs[0]
