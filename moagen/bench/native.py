"""The benchmarks' own native helpers (templates/bench/stream.c), built and cached like a
kernel, with the same compiler and flags."""
import time
from functools import lru_cache

import cffi
import numpy as np

from moagen.targets.c.build import build_c
from moagen.targets.c.loader import dlopen
from moagen.templates import ROOT as TEMPLATES

SOURCE = TEMPLATES / "bench" / "stream.c"


@lru_cache(maxsize=None)
def _library():
    ffi = cffi.FFI()
    ffi.cdef("void triad(double *a, const double *b, const double *c, double s, int64_t n);"
             "void first_touch(unsigned char *a, int64_t nbytes);"
             "double multiply_add_peak_f64(int64_t iterations, double a, double b, double *sink);"
             "double multiply_add_peak_f32(int64_t iterations, float a, float b, double *sink);")
    return ffi, dlopen(ffi, build_c(SOURCE.read_text(), "bench_stream"))


def triad(a, b, c, s):
    ffi, lib = _library()
    lib.triad(*(ffi.from_buffer("double[]", x) for x in (a, b, c)), s, a.size)


def empty_touched(shape, dtype):
    """An array whose pages were first written by the OpenMP threads, each its own slice."""
    array = np.empty(shape, dtype)
    ffi, lib = _library()
    lib.first_touch(ffi.from_buffer("unsigned char[]", array.reshape(-1).view(np.uint8)), array.nbytes)
    return array


def multiply_add_peak(dtype, iterations, repeats) -> float:
    """The cores' multiply-add rate in GFLOP/s on the process's threads, the best of a few
    runs: independent chains of vector multiply-adds, no memory traffic (stream.c)."""
    ffi, lib = _library()
    run = getattr(lib, f"multiply_add_peak_{'f64' if dtype == 'float64' else 'f32'}")
    sink, best = ffi.new("double *"), 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        flops = run(iterations, 0.999999, 1e-6, sink)
        best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best
