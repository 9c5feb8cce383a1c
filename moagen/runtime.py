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
         params=None) -> KernelCallable:
    """params: schedule parameters over the variant's defaults (moagen tune's choice)."""
    target = get_target(lang)
    onf = onf_of(kernel, variant, params=params, target=target.kind)
    return target.bind(library(kernel, onf.variant, lang, param_pairs(params)),
                       signature(onf, check_dtype(dtype)), get_kernel(kernel).validate)
