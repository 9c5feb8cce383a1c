"""Kernels by name, ready to call: emit the source, build it (cached), load it, bind it.

    attention = moagen.load("attention_fwd", variant="dnf", lang="fortran")
    O = attention(Q, K, V, scale=0.125)
"""
from functools import lru_cache

from moagen.bind.abi import KernelCallable
from moagen.codegen.emit import check_dtype, emit, stem
from moagen.codegen.printer import signature
from moagen.kernels import get_kernel
from moagen.pipeline import onf_of, param_pairs
from moagen.targets import get_target


@lru_cache(maxsize=None)
def library(kernel: str, variant: str, lang: str, params=()):
    """One build and one load per kernel variant, language and schedule parameters (pairs)
    per process."""
    return get_target(lang).library(emit(kernel, variant, lang, params=dict(params)),
                                    stem(kernel, variant))


def load(kernel: str, variant: str = None, lang: str = "c", dtype: str = "float64",
         params=None, tuned: bool = True) -> KernelCallable:
    """params: schedule parameters over the defaults of the language's target (a CPU's for
    C and Fortran) and the dtype. None and tuned: on a CPU, this machine's `moagen tune` choice
    for the dtype where the tuning file (bench-results/tuning.json in the working directory)
    records one; it replaces every default."""
    target = get_target(lang)
    if params is None and tuned and target.kind == "cpu":
        params = _tuned(kernel, get_kernel(kernel).variant(variant).name, lang, dtype)
    onf = onf_of(kernel, variant, params=params, target=target.kind, dtype=check_dtype(dtype))
    return target.bind(library(kernel, onf.variant, lang, param_pairs(params)),
                       signature(onf, dtype), get_kernel(kernel).validate)


def _tuned(kernel, variant, lang, dtype):
    from moagen.bench.tune import chosen, load_choices
    return chosen(load_choices(), kernel, variant, lang, dtype)
