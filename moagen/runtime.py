"""Kernels by request, ready to call: emit the source, build it (cached), load it, bind it.

    attention = moagen.load("attention_fwd", variant="dnf", lang="fortran")
    O = attention(Q, K, V, scale=0.125)
"""
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
    """The built and loaded library of a request, once a process. At generated/'s parameters
    it holds every dtype's function (what `moagen build` builds); at parameters chosen over
    them this dtype's only: another's, at these parameters, would be compiled for nothing."""
    dtypes = DTYPES if not request.chosen else (request.dtype,)
    key = (request.kernel, request.variant, request.lang, request.chosen, dtypes)
    if key not in _LIBRARIES:
        _LIBRARIES[key] = request.target.library(source(request, dtypes),
                                                 stem(request.kernel, request.variant))
    return _LIBRARIES[key]


_LIBRARIES = {}  # library()'s, by what decides their source
