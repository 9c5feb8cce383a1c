"""The machine's own roofs, measured: memory bandwidth by a STREAM triad (a = b + s*c,
24 bytes an element, arrays far larger than the caches); the flops a library reaches by a
BLAS GEMM (numpy's matmul) in each dtype a kernel runs in (float32 about twice float64
where vectors hold twice the numbers); and the cores' multiply-add peak in each dtype,
which no kernel passes (numpy's BLAS may reach half of it: a register-tiled kernel can run
above the GEMM, never above the peak). All at the process's thread count. The best of a
few runs counts, as in STREAM. The GEMMs and the peak run first: OpenMP threads left
spinning after the triad slow them.
On a device (a GPU), its copy bandwidth: a device-to-device copy, by the device's clock."""

import numpy as np

from moagen.bench import native
from moagen.bench.timing import wall_clock


def _best(fn, repeats):
    return min(wall_clock(fn) for _ in range(repeats))


def triad_elements(quick=False) -> int:
    return 1 << (22 if quick else 24)  # 32 (128) MiB an array


def triad_call(n):
    """A callable running one triad over arrays of n elements, their pages already touched,
    and the bytes a triad counts (24 an element)."""
    a, b, c = np.empty(n), np.ones(n), np.ones(n)
    native.triad(a, b, c, 3.0)  # first touch, outside the timing
    return (lambda: native.triad(a, b, c, 3.0)), 24 * n


DTYPES = ("float64", "float32")


def gemm_gflops(m, dtype, repeats) -> float:
    x, y = np.ones((m, m), dtype), np.ones((m, m), dtype)
    x @ y  # BLAS starts its threads
    return 2 * m ** 3 / _best(lambda: x @ y, repeats) / 1e9


def measure(quick=False) -> dict:
    """gemm_gflops: float64's (the roofline's); gemm_gflops_by_dtype: each dtype's;
    peak_gflops_by_dtype: the multiply-add peak of each."""
    m = 1024 if quick else 2048
    gemm = {dtype: gemm_gflops(m, dtype, 2 if quick else 4) for dtype in DTYPES}
    peak = {dtype: native.multiply_add_peak(dtype, 2_000_000 if quick else 20_000_000, 3)
            for dtype in DTYPES}
    n = triad_elements(quick)
    triad, triad_bytes = triad_call(n)
    triad_s = _best(triad, 5 if quick else 10)
    return dict(triad_gbs=triad_bytes / triad_s / 1e9, gemm_gflops=gemm["float64"],
                gemm_gflops_by_dtype=gemm, peak_gflops_by_dtype=peak, triad_elements=n,
                gemm_n=m)


def device_copy(device, quick=False) -> dict:
    """A device's memory bandwidth, as a copy within it moves bytes (each byte read and
    written: twice the array), far larger than its caches; the best of a few copies."""
    from moagen.targets.cuda.arrays import DeviceArray
    nbytes = 1 << (26 if quick else 31)  # 64 MiB (2 GiB) an array; an H200's L2: 60 MB
    source, destination = (DeviceArray(device, (nbytes,), np.uint8) for _ in range(2))
    device.copy(destination, source)  # first touch, outside the timing
    seconds = min(device.elapsed(lambda: device.copy(destination, source))
                  for _ in range(3 if quick else 10))
    return dict(copy_gbs=2 * nbytes / seconds / 1e9, copy_bytes=nbytes)
