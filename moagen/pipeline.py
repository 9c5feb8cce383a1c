"""The pipeline driver: a kernel's name to its final ONF for one target kind, cached; a
composite's ONF is its stages' ONFs composed (moagen.kernels.compose).

kernels/ (the specs and their variants) and the targets (the printers) both depend on this
module, never on each other."""
from functools import lru_cache

from moagen.errors import UnknownNameError
from moagen.kernels import CompositeKernel, get_kernel, stage_variant
from moagen.kernels.compose import compose
from moagen.kinds import KINDS
from moagen.onf.loops import ONF
from moagen.onf.signature import DTYPE_BYTES

# what a variant's mapping layer is written for (moagen.kinds)
TARGET_KINDS = tuple(KINDS)


def param_pairs(params) -> tuple:
    """Schedule parameters (a mapping, pairs or None) as sorted pairs: hashable, one order."""
    return tuple(sorted(dict(params or {}).items()))


def onf_of(kernel: str, variant: str = None, layout: str = "row", params=None,
           target: str = "cpu", dtype: str = "float64", upto: int = None) -> ONF:
    """The kernel's final ONF for a target kind; params: schedule parameters over the
    variant's defaults for that kind and dtype; upto = K: the ONF after its first K steps."""
    k = get_kernel(kernel)
    variant = k.variant(variant, target, dtype).name  # None: the target's default
    chosen = k.variant(variant).params(params, target, dtype)
    if isinstance(k, CompositeKernel):
        return _composed(k, chosen, layout, target, dtype, upto)
    if upto is not None:
        return k.onf(variant, layout, chosen, target, upto, dtype)
    # A kernel's ONF depends on the dtype through its parameters and, on a GPU, the size of
    # its elements (a tiled nest's shared memory is laid out and checked at it) only: a CPU
    # ONF whose dtypes share their parameters is realized once
    element_bytes = DTYPE_BYTES[dtype] if target == "cuda" else None
    return _onf(kernel, variant, layout, param_pairs(chosen), target, element_bytes)


@lru_cache(maxsize=None)
def _onf(kernel, variant, layout, params, target, element_bytes):
    """element_bytes: None for a target kind with no tiled nests (nothing laid out)."""
    return get_kernel(kernel).onf(variant, layout, dict(params), target=target,
                                  element_bytes=element_bytes and (element_bytes,))


def _composed(kernel: CompositeKernel, params: dict, layout, target, dtype, upto) -> ONF:
    if upto is not None:
        raise UnknownNameError(f"{kernel.name}: a composite's steps are its stages'; show "
                               "a stage kernel's steps instead")
    if layout != "row":
        raise UnknownNameError(f"{kernel.name}: composites are emitted row-major only")
    return _compose(kernel.name, param_pairs(params), target, dtype)


@lru_cache(maxsize=None)
def _compose(name, params, target, dtype):
    """The stages' ONFs composed, each at its parameters among `params` (named
    `<stage label>.<parameter>`) for the target and dtype."""
    by_stage = stage_params(name, params)
    return compose(get_kernel(name).composite,
                   lambda st: onf_of(st.kernel, stage_variant(st, target, dtype), params=by_stage[st.label],
                                     target=target, dtype=dtype))


def stage_params(composite: str, params) -> dict:
    """stage label -> its parameters, from a composite's (`<stage label>.<parameter>`)."""
    by_stage = {st.label: {} for st in get_kernel(composite).composite.stages}
    for param, value in dict(params).items():
        label, stage_param = param.split(".", 1)
        by_stage[label][stage_param] = value
    return by_stage
