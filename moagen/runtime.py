"""Kernels by name, ready to call: emit the source, build it (cached), load it, bind it.

    attention = moagen.load("attention_fwd", variant="dnf", lang="fortran")
    O = attention(Q, K, V, scale=0.125)
"""
from functools import lru_cache

from moagen import build
from moagen.bind.abi import KernelCallable
from moagen.codegen.emit import check_dtype, emit, stem
from moagen.codegen.printer import signature
from moagen.onf.signature import DTYPES
from moagen.kernels import CompositeKernel, get_kernel
from moagen.pipeline import onf_of, param_pairs
from moagen.targets import get_target


@lru_cache(maxsize=None)
def library(kernel: str, variant: str, lang: str, params=(), dtypes=DTYPES):
    """One build and one load per kernel variant, language, schedule parameters (pairs) and
    dtypes per process."""
    return get_target(lang).library(emit(kernel, variant, lang, dtypes, params=dict(params)),
                                    stem(kernel, variant))


def load(kernel: str, variant: str = None, lang: str = "c", dtype: str = "float64",
         params=None, tuned: bool = True) -> KernelCallable:
    """params: schedule parameters over the defaults of the language's target (a CPU's for
    C and Fortran) and the dtype. None: on a CPU, where tuned, this machine's `moagen tune`
    choice for the dtype if the tuning file (bench-results/tuning.json in the working
    directory) records one (it replaces every default), else this machine's defaults
    (host_defaults)."""
    target, dtype = get_target(lang), check_dtype(dtype)
    params = chosen_params(kernel, variant, lang, dtype, params, tuned)
    onf = onf_of(kernel, variant, params=params, target=target.kind, dtype=dtype)
    # at generated/'s parameters the library holds every dtype's function (what `moagen
    # build` builds); at parameters chosen for this dtype (the caller's, a tuning's, this
    # machine's defaults) this dtype's only: another's, at these parameters, would be
    # compiled for nothing (a flash kernel's function takes seconds to compile)
    dtypes = DTYPES if params is None else (dtype,)
    return target.bind(library(kernel, onf.variant, lang, param_pairs(params), dtypes),
                       signature(onf, dtype), get_kernel(kernel).validate)


def chosen_params(kernel: str, variant: str, lang: str, dtype: str, params=None,
                  tuned: bool = True):
    """The parameters load takes over the variant's defaults (load's docstring says which);
    None where it takes the defaults. A composite's: each stage's, as its own kernel would
    load on this machine."""
    if params is None and get_target(lang).kind == "cpu":
        k = get_kernel(kernel)
        if isinstance(k, CompositeKernel):
            return k.stage_params(lambda st: chosen_params(st.kernel, st.variant, lang, dtype,
                                                           tuned=tuned)) or None
        return ((tuned and _tuned(kernel, k.variant(variant).name, lang, dtype))
                or host_defaults(kernel, variant, lang, dtype))
    return params


def schedule_params(kernel: str, variant: str, lang: str, dtype: str, params=None,
                    tuned: bool = True) -> dict:
    """Every schedule parameter a load with these arguments runs: the variant's defaults for
    the language's target and the dtype, with chosen_params over them."""
    return get_kernel(kernel).variant(variant).params(
        chosen_params(kernel, variant, lang, dtype, params, tuned), get_target(lang).kind, dtype)


def host_defaults(kernel: str, variant: str, lang: str, dtype: str):
    """The variant's defaults that differ on this machine from generated/'s (a CPU's): the
    AVX-512 ones (Tunable.avx512) where the language's compiler targets AVX-512; None where
    none differ."""
    target = get_target(lang)
    overrides = get_kernel(kernel).variant(variant).avx512.get(dtype)
    if target.kind == "cpu" and overrides and build.Toolchain().targets_avx512(target.toolchain):
        return dict(overrides)
    return None


def _tuned(kernel, variant, lang, dtype):
    from moagen.bench.tune import chosen, load_choices
    return chosen(load_choices(), kernel, variant, lang, dtype)
