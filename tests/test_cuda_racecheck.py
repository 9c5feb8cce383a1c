"""The CUDA host emulation's execution model beyond 1-D blocks (3-D grids and blocks, warp
shuffles, dynamic shared memory) and its race check over shared memory (-DMOAGEN_RACECHECK):
hand-written kernels built as build_cuda_emulated builds generated ones, and a generated
kernel with one of its barriers deleted."""
import re
import shutil
import subprocess

import cffi
import numpy as np
import pytest

from moagen import runtime, verify
from moagen.cli import main
from moagen.emit import emit
from moagen.errors import EmulationCheckError
from moagen.kernels import get_kernel
from moagen.request import resolve
from moagen.targets.c.loader import dlopen
from moagen.targets.cuda import emulated
from moagen.targets.cuda.build import build_cuda_emulated
from moagen.targets.cuda.loader import EMULATION_ERROR, check_launch, emulation_error

# the launch and shared-memory macros as the generated files define them for nvcc
PREAMBLE = """
#include <stdint.h>
#include <cuda_runtime.h>

#ifndef MOAGEN_LAUNCH
#define MOAGEN_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \\
    kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)
#endif
#ifndef MOAGEN_SHARED
extern __shared__ __align__(16) unsigned char moagen_dynamic_shared[];
#define MOAGEN_SHARED(T, name, count) __shared__ T name[count]
#define MOAGEN_SHARED_AT(T, name, byte_offset, count) \\
    T *const name = reinterpret_cast<T *>(moagen_dynamic_shared + (byte_offset))
#endif
"""

SOURCE = PREAMBLE + r"""
// every thread of a 3-D grid of 3-D blocks writes its indices at its linear place
__global__ void where(int *out)
{
    const int64_t block = blockIdx.x + (int64_t)gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int64_t thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int *at = out + 6 * (block * blockDim.x * blockDim.y * blockDim.z + thread);
    at[0] = threadIdx.x; at[1] = threadIdx.y; at[2] = threadIdx.z;
    at[3] = blockIdx.x; at[4] = blockIdx.y; at[5] = blockIdx.z;
}

extern "C" int where_all(int *out, int gx, int gy, int gz, int bx, int by, int bz)
{
    MOAGEN_LAUNCH(where, dim3(gx, gy, gz), dim3(bx, by, bz), 0, 0, out);
    return (int)cudaGetLastError();
}

// each shuffle of each type, a row of out a shuffle; then a warp's sum by xor butterfly
template <typename T>
__global__ void shuffles(T *out, int width)
{
    const unsigned int t = threadIdx.x + blockDim.x * threadIdx.y, n = blockDim.x * blockDim.y;
    const T v = (T)(t * t % 97);
    out[0 * n + t] = __shfl_sync(0xffffffffu, v, 5, width);
    out[1 * n + t] = __shfl_xor_sync(0xffffffffu, v, 3, width);
    out[2 * n + t] = __shfl_down_sync(0xffffffffu, v, 2, width);
    out[3 * n + t] = __shfl_up_sync(0xffffffffu, v, 2, width);
    T sum = v;
    for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, lane_mask);
    __syncwarp();
    out[4 * n + t] = sum;
}

extern "C" int shuffle_f64(double *out, int bx, int by, int width)
{
    MOAGEN_LAUNCH(shuffles<double>, dim3(1), dim3(bx, by), 0, 0, out, width);
    return (int)cudaGetLastError();
}
extern "C" int shuffle_f32(float *out, int bx, int by, int width)
{
    MOAGEN_LAUNCH(shuffles<float>, dim3(1), dim3(bx, by), 0, 0, out, width);
    return (int)cudaGetLastError();
}
extern "C" int shuffle_i32(int *out, int bx, int by, int width)
{
    MOAGEN_LAUNCH(shuffles<int>, dim3(1), dim3(bx, by), 0, 0, out, width);
    return (int)cudaGetLastError();
}

__global__ void half_warp(double *out)
{
    out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, (double)threadIdx.x, 1);
}

extern "C" int half_mask(double *out)
{
    MOAGEN_LAUNCH(half_warp, dim3(1), dim3(32), 0, 0, out);
    return (int)cudaGetLastError();
}

// two views of the dynamic buffer, doubles then ints: a block rotates x through them;
// `fresh` reads what no thread wrote (the buffer's fill)
__global__ void rotate_dynamic(const double *x, double *y, double *fresh, int64_t n)
{
    MOAGEN_SHARED_AT(double, tile, 0, n);
    MOAGEN_SHARED_AT(int, count, n * sizeof(double), n + 1);
    const unsigned int t = threadIdx.x;
    tile[t] = x[blockIdx.x * n + t];
    count[t] = (int)t;
    count[t] += 1;
    __syncthreads();
    y[blockIdx.x * n + t] = fmax(tile[(t + 1) % n], -1e300) + (count[(t + 1) % n] - ((t + 1) % n + 1));
    if (t == 0) fresh[blockIdx.x] = count[n] == -1 ? 1.0 : 0.0;
}

extern "C" int rotate_dynamic_blocks(const double *x, double *y, double *fresh, int64_t blocks,
                                     int64_t n, int64_t bytes, int64_t allow)
{
    if (allow && cudaFuncSetAttribute(rotate_dynamic, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)allow) != cudaSuccess)
        return -1;
    MOAGEN_LAUNCH(rotate_dynamic, dim3(blocks), dim3(n), bytes, 0, x, y, fresh, n);
    return (int)cudaGetLastError();
}

// shared-memory patterns for the race check: how 0 rotates with the barrier, 1 without it,
// 2 has two threads write one element, 3 reads past the end, 4 adds atomically, 5 is a
// block-wide tree sum (a barrier a level), 6 the same with one missing, 7 swaps neighbours
// with __syncwarp between (one warp: no race), 8 swaps halves of the block so (two warps)
__global__ void patterns(const double *x, double *y, int how)
{
    MOAGEN_SHARED(double, tile, 64);
    const unsigned int t = threadIdx.x + blockDim.x * threadIdx.y, n = blockDim.x * blockDim.y;
    if (how == 0 || how == 1) {
        tile[t] = x[t];
        if (how == 0) __syncthreads();
        y[t] = tile[(t + 1) % n];
    } else if (how == 2) {
        tile[t / 2] = x[t];
    } else if (how == 3) {
        tile[t] = x[t];
        __syncthreads();
        y[t] = tile[t + 64 - n + 1];
    } else if (how == 4) {
        if (t == 0) tile[0] = 0.0;
        __syncthreads();
        atomicAdd(&tile[0], x[t]);
        __syncthreads();
        y[t] = tile[0];
    } else if (how == 7 || how == 8) {
        tile[t] = x[t];
        __syncwarp();
        y[t] = tile[how == 7 ? t ^ 1 : (t + n / 2) % n];
    } else {
        tile[t] = x[t];
        __syncthreads();
        for (unsigned int half = n / 2; half > 0; half /= 2) {
            if (t < half) tile[t] += tile[t + half];
            if (how == 5 || half != 4) __syncthreads();
        }
        y[t] = tile[0];
    }
    __syncthreads();
}

// two views of one stretch of the dynamic buffer: b[k] is a[16 + k]
__global__ void aliased(const float *x, float *y, int barrier)
{
    MOAGEN_SHARED_AT(float, a, 0, 32);
    MOAGEN_SHARED_AT(float, b, 16 * sizeof(float), 16);
    const unsigned int t = threadIdx.x;
    a[t] = x[t];
    if (barrier) __syncthreads();
    y[t] = b[(t + 1) % 16];
}

extern "C" int alias(const float *x, float *y, int barrier)
{
    MOAGEN_LAUNCH(aliased, dim3(1), dim3(32), 32 * sizeof(float), 0, x, y, barrier);
    return (int)cudaGetLastError();
}

// shared elements in C's expressions: assigned from another array's, updated, passed to
// math functions and compared
__global__ void expressions(const float *x, float *y)
{
    MOAGEN_SHARED(float, a, 32);
    MOAGEN_SHARED(float, b, 32);
    const unsigned int t = threadIdx.x;
    a[t] = x[t];
    __syncthreads();
    b[t] = a[(t + 1) % 32];
    __syncthreads();
    a[t] *= 2.0f;
    a[t] -= b[t];
    const float e = exp(b[t]) - expf(b[t]);
    y[t] = fmax(a[t], b[t]) + fmaxf(a[t], 0.0f) + (a[t] < b[t] ? 1.0f : 0.0f) + e;
}

extern "C" int expression(const float *x, float *y)
{
    MOAGEN_LAUNCH(expressions, dim3(1), dim3(32), 0, 0, x, y);
    return (int)cudaGetLastError();
}

extern "C" int pattern(const double *x, double *y, int bx, int by, int how)
{
    MOAGEN_LAUNCH(patterns, dim3(2), dim3(bx, by), 0, 0, x, y, how);
    return (int)cudaGetLastError();
}
"""

DECLARATIONS = """
int where_all(int *, int, int, int, int, int, int);
int shuffle_f64(double *, int, int, int);
int shuffle_f32(float *, int, int, int);
int shuffle_i32(int *, int, int, int);
int half_mask(double *);
int rotate_dynamic_blocks(const double *, double *, double *, int64_t, int64_t, int64_t, int64_t);
int pattern(const double *, double *, int, int, int);
int expression(const float *, float *);
int alias(const float *, float *, int);
""" + EMULATION_ERROR

CTYPES = {np.float64: "double[]", np.float32: "float[]", np.int32: "int[]"}


def _library(racecheck):
    ffi = cffi.FFI()
    ffi.cdef(DECLARATIONS)
    lib = dlopen(ffi, build_cuda_emulated(SOURCE, "emulation_model", racecheck=racecheck))

    def call(name, *args):
        code = getattr(lib, name)(*(ffi.from_buffer(CTYPES[a.dtype.type], a)
                                    if isinstance(a, np.ndarray) else a for a in args))
        check_launch(name, code, lambda: emulation_error(ffi, lib))
        return code
    return call


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "racecheck"])
def lib(request):
    return _library(request.param)


@pytest.fixture(scope="module")
def checked():
    return _library(True)


@pytest.mark.parametrize("grid, block", [((2, 3, 2), (4, 3, 2)), ((1, 1, 1), (32, 32, 1)),
                                         ((3, 1, 1), (5, 1, 7)), ((1, 2, 3), (1, 1, 64))])
def test_3d_grids_and_blocks_cover_every_thread_once_x_fastest(lib, grid, block):
    total = np.prod(grid) * np.prod(block)
    out = np.full(6 * total, -1, np.int32)
    assert lib("where_all", out, *grid, *block) == 0
    # linear thread id x + X*(y + Y*z) within the block, blocks likewise
    bz, by, bx, tz, ty, tx = np.meshgrid(*(np.arange(n) for n in (*grid[::-1], *block[::-1])),
                                         indexing="ij")
    expected = np.stack([tx, ty, tz, bx, by, bz], axis=-1).reshape(-1)
    assert (out == expected).all()


@pytest.mark.parametrize("grid, block", [((1, 1, 1), (1024, 2, 1)), ((1, 1, 1), (1, 1, 65)),
                                         ((0, 1, 1), (32, 1, 1)), ((1, 1, 1), (4, 0, 1)),
                                         ((1, 65536, 1), (1, 1, 1))])
def test_a_geometry_a_gpu_refuses_is_an_invalid_configuration(lib, grid, block):
    with pytest.raises(RuntimeError, match="cudaError_t 9$"):
        lib("where_all", np.zeros(6, np.int32), *grid, *block)


def _shuffled(v, width):
    """The shuffles of `shuffles` in numpy, each lane of each warp."""
    n = v.size
    lane = np.arange(n) % 32
    warp = np.arange(n) // 32 * 32
    base = lane & ~(width - 1)
    src = warp + base + 5 % width
    xor = lane ^ 3
    down = lane + 2
    up = lane - 2
    rows = [v[src],
            np.where(xor >= base + width, v, v[np.minimum(warp + xor, n - 1)]),
            np.where((lane & (width - 1)) + 2 >= width, v, v[np.minimum(warp + down, n - 1)]),
            np.where((lane & (width - 1)) < 2, v, v[np.maximum(warp + up, 0)]),
            np.repeat(v.reshape(-1, 32).sum(axis=1), 32)]
    return np.concatenate(rows)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32])
@pytest.mark.parametrize("block, width", [((32, 1), 32), ((16, 4), 32), ((64, 2), 8)])
def test_warp_shuffles_read_the_lanes_cuda_names(lib, dtype, block, width):
    n = block[0] * block[1]
    out = np.zeros(5 * n, dtype)
    name = {np.float64: "shuffle_f64", np.float32: "shuffle_f32", np.int32: "shuffle_i32"}[dtype]
    assert lib(name, out, *block, width) == 0
    v = (np.arange(n) ** 2 % 97).astype(dtype)
    assert (out == _shuffled(v, width)).all()


def test_a_shuffle_whose_mask_leaves_out_lanes_fails_the_launch(lib):
    with pytest.raises(EmulationCheckError,
                       match=r"half_mask: kernel half_warp: __shfl_xor_sync: thread \(\d+,0,0\)'s "
                             r"mask 0xffff leaves out lanes"):
        lib("half_mask", np.zeros(32))


def test_dynamic_shared_memory_is_a_blocks_filled_with_0xff(lib):
    blocks, n = 3, 40
    x = np.random.default_rng(0).standard_normal(blocks * n)
    y, fresh = np.zeros_like(x), np.zeros(blocks)
    assert lib("rotate_dynamic_blocks", x, y, fresh, blocks, n, n * 12 + 4, 0) == 0
    assert (y.reshape(blocks, n) == np.roll(x.reshape(blocks, n), -1, axis=1)).all()
    assert (fresh == 1).all()  # count[n], never written: 0xffffffff, -1


def test_dynamic_shared_memory_is_limited_as_on_a_gpu(lib):
    x, y, fresh = np.zeros(40), np.zeros(40), np.zeros(1)
    with pytest.raises(EmulationCheckError, match=r"dynamic shared `count`: 41 elements of 4 "
                                                  r"bytes at byte 320 do not fit in the launch's "
                                                  r"480 bytes"):
        lib("rotate_dynamic_blocks", x, y, fresh, 1, 40, 40 * 12, 0)
    big = 64 * 1024
    with pytest.raises(RuntimeError, match="cudaError_t 1$"):  # over 48 KB, not asked for
        lib("rotate_dynamic_blocks", x, y, fresh, 1, 40, big, 0)
    assert lib("rotate_dynamic_blocks", x, y, fresh, 1, 40, big, big) == 0
    with pytest.raises(RuntimeError, match="cudaError_t 1$"):  # over what was asked for
        lib("rotate_dynamic_blocks", x, y, fresh, 1, 40, big + 16, 0)
    with pytest.raises(RuntimeError, match="cudaError_t -1$"):  # cudaFuncSetAttribute over 227 KB
        lib("rotate_dynamic_blocks", x, y, fresh, 1, 40, 40 * 12 + 4, 228 * 1024)


def test_shared_elements_read_and_write_in_expressions_as_values(lib):
    x = np.random.default_rng(2).standard_normal(32).astype(np.float32)
    y = np.zeros_like(x)
    assert lib("expression", x, y) == 0
    b = np.roll(x, -1)
    a = 2 * x - b
    assert (y == np.maximum(a, b) + np.maximum(a, 0) + (a < b)).all()


@pytest.mark.parametrize("block", [(64, 1), (8, 4)])
def test_shared_patterns_compute_what_they_should_where_no_race(lib, block):
    n = block[0] * block[1]
    x = np.arange(1.0, n + 1)
    y = np.zeros(n)
    assert lib("pattern", x, y, *block, 0) == 0
    assert (y == np.roll(x, -1)).all()
    for how in (4, 5):
        assert lib("pattern", x, y, *block, how) == 0
        assert (y == x.sum()).all()


RACE = (r"race on shared `tile`\[(\d+)\] in block \(0,0,0\): thread \((\d+),(\d+),0\) "
        r"(wrote|read) `tile`\[\1\] and thread \((\d+),(\d+),0\) (writes|reads) it with no "
        r"__syncthreads between$")


def _race(checked, block, how):
    """The element and the two threads (linear) of the race the check reports."""
    x, y = np.arange(1.0, 65), np.zeros(64)
    with pytest.raises(EmulationCheckError, match=r"^pattern: kernel patterns: " + RACE) as raised:
        checked("pattern", x, y, *block, how)
    element, x1, y1, did, x2, y2, does = re.search(RACE, str(raised.value)).groups()
    assert "writes" in (does,) or did == "wrote"  # one of the two writes
    return int(element), int(x1) + block[0] * int(y1), int(x2) + block[0] * int(y2)


@pytest.mark.parametrize("block", [(32, 1), (8, 4)])
def test_the_race_check_catches_a_read_of_another_threads_write_with_no_barrier(checked, block):
    n = block[0] * block[1]
    element, one, two = _race(checked, block, 1)  # thread t writes t and reads t + 1
    assert {one, two} == {element, (element - 1) % n}


@pytest.mark.parametrize("block", [(32, 1), (8, 4)])
def test_the_race_check_catches_two_threads_writing_one_element(checked, block):
    element, one, two = _race(checked, block, 2)  # threads 2k and 2k + 1 write k
    assert {one, two} == {2 * element, 2 * element + 1}


def test_the_race_check_catches_a_missing_barrier_in_a_tree_sum(checked):
    element, one, two = _race(checked, (32, 1), 6)  # no barrier after the level of 4
    assert element < 4 and {one, two} <= set(range(8))


def test_syncwarp_orders_a_warps_lanes_only(checked):
    x, y = np.arange(1.0, 65), np.zeros(64)
    assert checked("pattern", x, y, 32, 1, 7) == 0
    assert (y[:32] == x[np.arange(32) ^ 1]).all()
    element, one, two = _race(checked, (64, 1), 8)
    assert {one, two} == {element, (element + 32) % 64}


def test_the_race_check_sees_views_of_the_dynamic_buffer_alias(checked):
    x, y = np.arange(1.0, 33, dtype=np.float32), np.zeros(32, np.float32)
    assert checked("alias", x, y, 1) == 0
    assert (y == x[16 + (np.arange(32) + 1) % 16]).all()
    with pytest.raises(EmulationCheckError,
                       match=r"race on shared `(a|b)`\[(\d+)\] in block \(0,0,0\): thread "
                             r"\(\d+,0,0\) (wrote|read) `(a|b)`\[\d+\]") as raised:
        checked("alias", x, y, 0)
    assert "`a`[" in str(raised.value) and "`b`[" in str(raised.value)


def test_the_race_check_refuses_an_index_out_of_bounds(checked):
    x, y = np.arange(1.0, 33), np.zeros(32)
    with pytest.raises(EmulationCheckError,
                       match=r"^pattern: kernel patterns: shared `tile`: index 64 is out of bounds "
                             r"\(64 elements\), thread \(31,0,0\) of block \(0,0,0\)$"):
        checked("pattern", x, y, 32, 1, 3)


# ---- a generated kernel with barriers, one deleted -----------------------------------------

KERNEL, VARIANT = "rmsnorm_fwd", "dnf"  # a block per row, moagen_block_reduce
SIZES = dict(batch=1, n=2, d=77)


def _run_generated(source, stem, racecheck=True):
    request = resolve(KERNEL, VARIANT, "cuda-emulated", "float64", here=False)
    fn = emulated.bind(build_cuda_emulated(source, stem, racecheck=racecheck),
                       request.signature(), get_kernel(KERNEL).validate)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((SIZES["batch"], SIZES["n"], SIZES["d"]))
    weight = rng.standard_normal(SIZES["d"])
    return fn(x, weight, eps=1e-6)


def test_a_generated_kernel_passes_the_race_check_and_fails_it_with_a_barrier_deleted():
    source = emit(KERNEL, VARIANT, "cuda-emulated")
    assert "MOAGEN_SHARED(T, warp_total, 32);" in source
    _run_generated(source, "racecheck_rmsnorm")  # no race: returns
    write = "    if (threadIdx.x % 32 == 0) warp_total[threadIdx.x / 32] = value;\n"
    barrier = write + "    __syncthreads();\n"
    assert source.count(barrier) == 1
    broken = source.replace(barrier, write)
    with pytest.raises(EmulationCheckError,
                       match=r"rmsnorm_fwd_dnf_f64: kernel rmsnorm_fwd_dnf_f64_rows: race on "
                             r"shared `warp_total`\[\d+\] in block \(0,0,0\): thread \(\d+,0,0\) "
                             r"(wrote|read) `warp_total`\[\d+\] and thread \(\d+,0,0\) "
                             r"(reads|writes) it"):
        _run_generated(broken, "racecheck_rmsnorm_broken")


def test_verify_racecheck_passes(capsys, monkeypatch):
    monkeypatch.setenv("MOAGEN_RACECHECK", "0")  # restored after: the command sets it
    monkeypatch.setattr(runtime, "_LIBRARIES", {})  # none loaded without the check
    assert main(["verify", "--emulate", "--racecheck", "rmsnorm_fwd", "--variant", "naive",
                 "--dtype", "float32"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert rows and all(" cuda-emulated " in r and r.endswith(" pass") for r in rows)


def test_verify_racecheck_needs_the_emulation(capsys):
    assert main(["verify", "--racecheck", "rmsnorm_fwd", "--lang", "cuda"]) == 2
    assert "--racecheck checks the CUDA emulation: add --emulate" in capsys.readouterr().err


def test_verify_reports_a_failed_check_as_a_failed_row():
    def load(kernel, variant, lang, dtype):
        def fn(*args, **scalars):
            raise EmulationCheckError("k_f64: kernel k_rows: race on shared `partial`[3]")
        return fn
    sizes = get_kernel(KERNEL).check.sizes[0]
    row = verify.check_case(KERNEL, VARIANT, "cuda-emulated", "float64", sizes, load)
    assert row.failed and row.status == "FAIL: k_f64: kernel k_rows: race on shared `partial`[3]"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_nvcc_compiles_the_macros_as_cuda(tmp_path):
    """The nvcc side of the contract: the same source, compiled for a GPU."""
    src = tmp_path / "model.cu"
    src.write_text(SOURCE)
    done = subprocess.run(["nvcc", "-arch=sm_80", "-c", "-o", str(tmp_path / "model.o"), str(src)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout
    assert not re.search(r"warning", done.stdout), done.stdout
