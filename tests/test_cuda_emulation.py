"""CUDA run on the host (the cuda-emulated target): every kernel family's CUDA agrees with
numpy and PyTorch on the verification sizes, and the emulation is CUDA's execution model
where it matters for correctness: every iteration runs once, a block's threads run at once
(an unguarded += loses updates that atomicAdd keeps), __syncthreads orders them."""
import cffi
import numpy as np
import pytest

from moagen import runtime, verify
from moagen.targets.c.loader import dlopen
from moagen.targets.cuda.loader import check_launch
from moagen.targets.cuda.build import build_cuda_emulated
from moagen.targets.toolchain import Toolchain
from moagen.cli import main
from moagen.emit import emit
from moagen.errors import CompilerNotFound
from moagen.kernels import get_kernel
from moagen.onf.signature import DTYPES
from moagen.targets import get_target

# every family once; atomic and owner both, since only the one adds with atomicAdd
KERNELS = [("attention_fwd", "online"), ("attention_fwd_causal", "dnf"),
           ("attention_bwd", "atomic"), ("attention_fwdbwd", "atomic"),
           ("attention_fwdbwd", "owner"), ("attention_decode", "split"),
           ("attention_dropout_bwd_causal", "flash"), ("attention_varlen_fwd_causal", "dnf"),
           ("attention_varlen_bwd_causal", "dnf"),
           ("kv_append", "dnf"), ("rmsnorm_fwd", "dnf"), ("rmsnorm_bwd", "dnf"),
           ("mlp_fwd", "tiled"), ("qkv_proj_bwd", "tiled"), ("block_fwd", "composed")]
# A thread block per row or per slice of keys (GpuBlocks) runs blocks of 128 or 256 threads
# whose barriers cost a few ms each on 2 cores (every thread must run once): the declared
# sizes' hundreds of blocks take 30-40 s a case, left to `make verify-cuda-emulated`. Here
# few blocks, and rows longer than a block, so that threads take several features each; the
# backward's 528 blocks of 1024 threads (a block a part, whatever the rows) at one size.
FEW_BLOCKS = {("rmsnorm_fwd", "dnf"): (dict(batch=1, n=3, d=517),),
              ("rmsnorm_bwd", "dnf"): (dict(batch=2, n=40, d=33),),
              ("attention_decode", "split"): (dict(batch=1, q_heads=2, kv_heads=1, cap=40,
                                                   d=131, n=37),)}
CASES = [(kernel, variant, "cuda-emulated", dtype, sizes) for kernel, variant in KERNELS
         for dtype in DTYPES
         for sizes in FEW_BLOCKS.get((kernel, variant), get_kernel(kernel).check.sizes)]


def _id(case):
    kernel, variant, _, dtype, sizes = case
    return f"{kernel}-{variant}-{dtype}-" + "-".join(map(str, sizes.values()))


@pytest.mark.parametrize("kernel, variant", KERNELS)
def test_the_emulation_builds_the_cuda_source(kernel, variant):
    """The text generated/ holds, but for the banner's command that regenerates it."""
    source = emit(kernel, variant, "cuda-emulated")
    assert source.replace("--lang cuda-emulated ", "--lang cuda ") == emit(kernel, variant, "cuda")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_cuda_kernel_run_on_the_host_matches_references(case):
    row = verify.check_case(*case, load=runtime.load)
    assert row.status == "pass", verify.format_row(row)
    assert set(row.errors) == {"numpy", "torch"}


def test_verify_runs_cuda_emulated_where_no_gpu_is():
    cuda = "cuda" if get_target("cuda").runs_here() else "cuda-emulated"
    assert verify.default_langs() == ("c", "fortran", cuda)


def test_verify_emulate_runs_cuda_as_cuda_emulated(capsys):
    # naive: a thread per row (dnf's blocks of 256 threads take 20 s at the declared sizes)
    assert main(["verify", "--emulate", "rmsnorm_fwd", "--variant", "naive", "--dtype", "float64"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert rows and all(" cuda-emulated " in r and r.endswith(" pass") for r in rows)


# Hand-written kernels, launched as the generated launchers launch theirs.
SOURCE = """
#include <stdint.h>
#include <cuda_runtime.h>

#ifndef MOAGEN_LAUNCH
#define MOAGEN_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
    kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)
#endif

__global__ void cover_kernel(double *hits, int64_t count)
{
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (tid >= count) return;
    atomicAdd(&hits[tid], 1.0);
    hits[count + tid] = gridDim.x * blockDim.x;  // threads in the grid, seen by each
}

// Every thread adds x[t] to total[0], `reps` times; a barrier between the read and the
// write, as a warp's lanes all load before any stores.
__global__ void add_plain(double *total, const double *x, int64_t reps)
{
    for (int64_t r = 0; r < reps; ++r) {
        const double sum = total[0];
        __syncthreads();
        total[0] = sum + x[threadIdx.x];  // a race: all but one thread's update is lost
        __syncthreads();
    }
}

__global__ void add_atomic(double *total, const double *x, int64_t reps)
{
    for (int64_t r = 0; r < reps; ++r) {
        __syncthreads();
        atomicAdd(&total[0], x[threadIdx.x]);
        __syncthreads();
    }
}

__global__ void rotate(const double *x, double *y)
{
    __shared__ double tile[1024];
    const unsigned int t = threadIdx.x;
    tile[t] = x[blockIdx.x * blockDim.x + t];
    __syncthreads();  // every thread of the block has written its element
    y[blockIdx.x * blockDim.x + t] = tile[(t + 1) % blockDim.x];
}

extern "C" int cover(double *hits, int64_t count, int64_t threads)
{
    MOAGEN_LAUNCH(cover_kernel, dim3((unsigned int)((count + threads - 1) / threads)),
                  dim3((unsigned int)threads), 0, 0, hits, count);
    return (int)cudaGetLastError();
}

extern "C" int add(double *total, const double *x, int64_t threads, int64_t reps, int atomic)
{
    if (atomic)
        MOAGEN_LAUNCH(add_atomic, dim3(1), dim3((unsigned int)threads), 0, 0, total, x, reps);
    else
        MOAGEN_LAUNCH(add_plain, dim3(1), dim3((unsigned int)threads), 0, 0, total, x, reps);
    return (int)cudaGetLastError();
}

extern "C" int rotate_blocks(const double *x, double *y, int64_t blocks, int64_t threads)
{
    MOAGEN_LAUNCH(rotate, dim3((unsigned int)blocks), dim3((unsigned int)threads), 0, 0, x, y);
    return (int)cudaGetLastError();
}
"""


@pytest.fixture(scope="module")
def lib():
    ffi = cffi.FFI()
    ffi.cdef("int cover(double *, int64_t, int64_t);"
             "int add(double *, const double *, int64_t, int64_t, int);"
             "int rotate_blocks(const double *, double *, int64_t, int64_t);")
    library = dlopen(ffi, build_cuda_emulated(SOURCE, "emulation_checks"))
    return lambda name, *args: getattr(library, name)(
        *(ffi.from_buffer("double[]", a) if isinstance(a, np.ndarray) else a for a in args))


@pytest.mark.parametrize("count, threads", [(1, 128), (7, 3), (257, 128), (1000, 96), (64, 64)])
def test_thread_indices_cover_every_iteration_once(lib, count, threads):
    hits = np.zeros(2 * count)
    assert lib("cover", hits, count, threads) == 0
    assert (hits[:count] == 1).all()
    blocks = -(-count // threads)
    assert (hits[count:] == blocks * threads).all()


def test_a_race_between_a_blocks_threads_loses_updates_that_atomics_keep(lib):
    threads, reps = 96, 50
    x = np.arange(1.0, threads + 1)  # integers: every order of the sums is exact
    atomic, plain = np.zeros(1), np.zeros(1)
    assert lib("add", atomic, x, threads, reps, 1) == 0
    assert atomic[0] == x.sum() * reps
    assert lib("add", plain, x, threads, reps, 0) == 0
    # each round keeps one thread's update: the threads run at once, as on a GPU
    assert x.min() * reps <= plain[0] <= x.max() * reps


def test_syncthreads_orders_a_blocks_shared_memory(lib):
    blocks, threads = 5, 96
    x = np.arange(blocks * threads, dtype=float)
    y = np.zeros_like(x)
    assert lib("rotate_blocks", x, y, blocks, threads) == 0
    assert (y.reshape(blocks, threads) == np.roll(x.reshape(blocks, threads), -1, axis=1)).all()


@pytest.mark.parametrize("count, threads", [(0, 128), (1, 1025)])  # no blocks; too many threads
def test_a_launch_a_gpu_refuses_is_refused(lib, count, threads):
    assert lib("cover", np.zeros(2), count, threads) == 9  # cudaErrorInvalidConfiguration
    assert lib("cover", np.zeros(2), 1, 1) == 0  # the error is reported once


def test_a_launchers_error_is_raised_with_its_code():
    check_launch("k_f64", 0)
    with pytest.raises(RuntimeError, match=r"k_f64: the CUDA launcher returned cudaError_t 9"):
        check_launch("k_f64", 9)


def test_missing_cxx_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("MOAGEN_BUILD_DIR", str(tmp_path))  # nothing cached: the compiler is asked for
    with pytest.raises(CompilerNotFound, match=r"'moagen-no-such-compiler'.*apt-get install g\+\+"):
        build_cuda_emulated(SOURCE, "emulation_checks", Toolchain(cxx="moagen-no-such-compiler"))
