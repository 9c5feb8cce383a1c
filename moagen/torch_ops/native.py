"""Calling moagen's kernels on torch tensors: the checks a PyTorch user expects (device,
dtype, shapes, by the names of the torch-level arguments), then the kernel on numpy views
of the tensors' memory (no copy of a contiguous tensor), its outputs handed back as
tensors over the arrays the kernel wrote (no copy either).

The checks run in the operators' fake implementations too, so that torch.compile reports
a bad call while it traces, not later in native code."""
from functools import lru_cache

import torch

import moagen

LANGS = ("c", "fortran")
DTYPES = {torch.float64: "float64", torch.float32: "float32"}
# moagen's CUDA binding takes device arrays (__cuda_array_interface__) but launches on the
# default stream, and no CUDA kernel has yet run on a GPU: the operators do not offer it
CUDA_MISSING = ("CUDA tensors are not supported yet: moagen's CUDA kernels take device arrays "
                "but launch on the default stream, not PyTorch's current one, and have not "
                "been run on a GPU; move the tensors to the CPU (.cpu())")


def check_lang(op, lang):
    if lang == "cuda":
        raise ValueError(f"{op}: lang='cuda': {CUDA_MISSING}")
    if lang not in LANGS:
        raise ValueError(f"{op}: lang must be one of {', '.join(map(repr, LANGS))}, got {lang!r}")


def check_tensors(op, **tensors):
    """Every tensor on the CPU, float32 or float64, all of one dtype; returns that dtype's
    name."""
    dtypes = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.is_cpu or t.is_meta):  # meta: shape-only tracing
            if t.is_cuda:
                raise ValueError(f"{op}: {name} is on {t.device}: {CUDA_MISSING}")
            raise ValueError(f"{op}: {name} is on {t.device}; moagen's kernels run on CPU tensors")
        if t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; moagen's kernels take "
                             "torch.float32 or torch.float64 (no implicit casting)")
        dtypes[name] = t.dtype
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise ValueError(f"{op}: the tensors must share one dtype, got {listed}")
    return DTYPES[next(iter(dtypes.values()))]


def check_dims(op, name, t, ndim, meaning):
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions {meaning}, got shape "
                         f"{tuple(t.shape)}")


def check_size(op, what, got, expected):
    if got != expected:
        raise ValueError(f"{op}: {what} must be {expected}, got {got}")


@lru_cache(maxsize=None)
def kernel(name, variant, lang, dtype, params=()):
    """A loaded kernel, once per process (moagen.load builds and binds); params: schedule
    parameters as (name, value) pairs, () for the defaults (or this machine's tuning)."""
    return moagen.load(name, variant, lang=lang, dtype=dtype, params=dict(params) or None)


def host_array(t):
    """The numpy view of a CPU tensor's memory, made contiguous first (a copy only then)."""
    return t.detach().contiguous().numpy()


def call(name, variant, lang, *tensors, params=(), **scalars):
    """The kernel on the tensors; its outputs as tensors sharing the arrays' memory (a tuple
    when it has several). params: as kernel's."""
    fn = kernel(name, variant, lang, DTYPES[tensors[0].dtype], tuple(sorted(params)))
    result = fn(*(host_array(t) for t in tensors), **scalars)
    if result is None:
        return None
    if isinstance(result, tuple):
        return tuple(torch.from_numpy(a) for a in result)
    return torch.from_numpy(result)


def causal_name(kernel: str, causal: bool) -> str:
    """The kernel's causal twin's name where causal (attention_fwd -> attention_fwd_causal)."""
    return kernel + "_causal" if causal else kernel
