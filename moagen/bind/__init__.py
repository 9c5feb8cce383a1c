"""Loaders: build a kernel source, load the artifact, wrap each exported function in the one
KernelCallable interface.

    library = load_library(source, "c", "scale_rows")
    scale_rows = bind(library, signature, "c")
"""
from .. import build
from ..errors import UnknownNameError
from . import c, cuda, fortran
from .abi import KernelCallable

LANGS = ("c", "fortran", "cuda")
_LOADERS = {"c": c, "fortran": fortran, "cuda": cuda}


def load_library(source, lang, stem, module=None, toolchain=None):
    """Build `source` (cached) and load it. Fortran sources define the module `module`,
    by default moagen_<stem>. CUDA raises DeviceUnavailable without pycuda or a GPU."""
    _check(lang)
    if lang == "c":
        return c.load(build.build_c(source, stem, toolchain))
    if lang == "fortran":
        module = module or f"moagen_{stem}"
        return fortran.load(build.build_fortran(source, stem, module, toolchain), module)
    return cuda.load(build.build_cuda(source, stem, toolchain))


def bind(library, signature, lang, validate=None) -> KernelCallable:
    """The kernel `signature.name` of a loaded library, as a KernelCallable."""
    _check(lang)
    return _LOADERS[lang].bind(library, signature, validate)


def _check(lang):
    if lang not in LANGS:
        raise UnknownNameError(f"unknown language {lang!r}; expected one of {', '.join(LANGS)}")
