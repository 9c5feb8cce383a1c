"""The pipeline driver: a kernel's name to its final ONF for one target kind, cached.

kernels/ (the specs and their variants) and codegen/ (the printers) both depend on this
module, never on each other."""
from functools import lru_cache

from moagen.kernels import CompositeKernel, get_kernel
from moagen.onf.loops import ONF

# what a variant's mapping layer is written for: a CPU (OpenMP), a CUDA GPU, or a GPU
# through OpenACC
TARGET_KINDS = ("cpu", "cuda", "openacc")


def param_pairs(params) -> tuple:
    """Schedule parameters (a mapping, pairs or None) as sorted pairs: hashable, one order."""
    return tuple(sorted(dict(params or {}).items()))


def onf_of(kernel: str, variant: str = None, layout: str = "row", params=None,
           target: str = "cpu", dtype: str = "float64") -> ONF:
    """The kernel's final ONF for a target kind; params: schedule parameters over the
    variant's defaults for that kind and dtype."""
    k = get_kernel(kernel)
    chosen = k.variant(variant).params(params, target, dtype)
    # A kernel's ONF depends on the dtype through its parameters only (the dtypes share one
    # ONF where their defaults agree); a composite's through its stages' parameters.
    return _onf(kernel, variant, layout, param_pairs(chosen), target,
                dtype if isinstance(k, CompositeKernel) else None)


@lru_cache(maxsize=None)
def _onf(kernel, variant, layout, params, target, dtype):
    return get_kernel(kernel).onf(variant, layout, dict(params), target=target,
                                  dtype=dtype or "float64")
