"""The benchmarks' own native helpers (templates/bench/stream.c), built and cached like a
kernel, with the same compiler and flags."""
from functools import lru_cache

import cffi
import numpy as np

from moagen import build
from moagen.bind.c import dlopen

SOURCE = build.PROJECT_ROOT / "templates" / "bench" / "stream.c"


@lru_cache(maxsize=None)
def _library():
    ffi = cffi.FFI()
    ffi.cdef("void triad(double *a, const double *b, const double *c, double s, int64_t n);"
             "void first_touch(unsigned char *a, int64_t nbytes);")
    return ffi, dlopen(ffi, build.build_c(SOURCE.read_text(), "bench_stream"))


def triad(a, b, c, s):
    ffi, lib = _library()
    lib.triad(*(ffi.from_buffer("double[]", x) for x in (a, b, c)), s, a.size)


def empty_touched(shape, dtype):
    """An array whose pages were first written by the OpenMP threads, each its own slice."""
    array = np.empty(shape, dtype)
    ffi, lib = _library()
    lib.first_touch(ffi.from_buffer("unsigned char[]", array.reshape(-1).view(np.uint8)), array.nbytes)
    return array
