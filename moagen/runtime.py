"""Kernels by request, ready to call: emit the source, build it (cached), load it, bind it.

    attention = moagen.load("attention_fwd", variant="dnf", lang="fortran")
    O = attention(Q, K, V, scale=0.125)
"""
from functools import lru_cache

from moagen.emit import source, stem
from moagen.kernels import get_kernel
from moagen.onf.signature import DTYPES
from moagen.request import Request, resolve
from moagen.targets.abi import KernelCallable


def load(kernel: str, variant: str = None, lang: str = "c", dtype: str = "float64",
         params=None, tuned: bool = True) -> KernelCallable:
    """params: schedule parameters over the defaults of the language's target and the dtype;
    None: this machine's choice (moagen.request): its `moagen tune` choice where tuned and
    the tuning file (bench-results/tuning.json in the working directory) records one, else
    its AVX-512 defaults where they apply, else the portable ones."""
    return load_request(resolve(kernel, variant, lang, dtype, params, tuned))


def load_request(request: Request) -> KernelCallable:
    return request.target.bind(library(request), request.signature(),
                               get_kernel(request.kernel).validate)


def library(request: Request):
    """The built and loaded library of a request. At generated/'s parameters it holds every
    dtype's function (what `moagen build` builds); at parameters chosen over them this
    dtype's only: another's, at these parameters, would be compiled for nothing."""
    return _library(request.kernel, request.variant, request.target.name, request.chosen,
                    DTYPES if not request.chosen else (request.dtype,))


@lru_cache(maxsize=None)
def _library(kernel, variant, lang, chosen, dtypes):
    """One build and one load per kernel variant, language, parameters and dtypes a process."""
    request = resolve(kernel, variant, lang, dtypes[0], chosen, here=False)
    return request.target.library(source(request, dtypes), stem(kernel, variant))

