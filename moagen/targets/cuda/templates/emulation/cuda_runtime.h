/* CUDA's execution model on the host, for running generated .cu files without a GPU.
 *
 * A stand-in for the CUDA runtime header: moagen.targets.cuda.build.build_cuda_emulated compiles a .cu
 * file with g++ -x c++ -fopenmp and this folder first on the include path, so the file's
 * own `#include <cuda_runtime.h>` brings this in and its text stays as nvcc sees it. Only
 * the launch differs, behind the MOAGEN_LAUNCH macro the .cu file defines unless this
 * header has.
 *
 * A launch runs the grid's blocks one after another and each block's threads at once, as
 * an OpenMP team of blockDim.x threads: a race between a block's threads (a += that
 * should be atomicAdd, a read before the __syncthreads that orders it) can happen here
 * too. Blocks running one at a time make `static` storage per-block storage: that is
 * __shared__ (fixed size; no `extern __shared__`, and one launch at a time per process).
 * Launches are synchronous (a launcher's stream is ignored); 1-D grids and blocks only, as
 * the generated kernels use.
 */
#ifndef MOAGEN_CUDA_EMULATION_H
#define MOAGEN_CUDA_EMULATION_H

#include <math.h>
#include <omp.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
    unsigned int x, y, z;
};

/* each OpenMP thread is one CUDA thread: its indices are its own */
static thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __syncthreads() _Pragma("omp barrier")

/* the codes moagen's launchers return, with the CUDA runtime's numbers */
enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorLaunchOutOfResources = 701,
};

static thread_local cudaError_t moagen_last_error = cudaSuccess;

static inline cudaError_t cudaGetLastError(void)
{
    const cudaError_t err = moagen_last_error;
    moagen_last_error = cudaSuccess;
    return err;
}

/* launches run as they are made: a stream orders nothing more */
typedef struct moagen_stream *cudaStream_t;

template <typename T>
static inline T atomicAdd(T *address, T value)
{
    T old;
#pragma omp atomic capture
    { old = *address; *address += value; }
    return old;
}

/* CUDA's math that glibc lacks */
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

template <typename Body>
static void moagen_launch(unsigned int blocks, unsigned int threads, const Body &body)
{
    if (blocks == 0 || threads == 0 || threads > 1024) {  /* what a GPU refuses */
        moagen_last_error = cudaErrorInvalidConfiguration;
        return;
    }
    bool short_team = false;
    for (unsigned int block = 0; block < blocks; ++block) {
#pragma omp parallel num_threads(threads) reduction(||: short_team)
        {
            /* fewer threads than asked (OMP_THREAD_LIMIT, nested in a parallel region)
             * would leave iterations undone and barriers unmatched: run nothing */
            if ((unsigned int)omp_get_num_threads() != threads) {
                short_team = true;
            } else {
                threadIdx = {(unsigned int)omp_get_thread_num(), 0, 0};
                blockIdx = {block, 0, 0};
                blockDim = {threads, 1, 1};
                gridDim = {blocks, 1, 1};
                body();
            }
        }
        if (short_team) {
            moagen_last_error = cudaErrorLaunchOutOfResources;
            return;
        }
    }
}

#define MOAGEN_LAUNCH(kernel, blocks, threads, stream, ...) \
    ((void)(stream), moagen_launch((blocks), (threads), [&] { kernel(__VA_ARGS__); }))

#endif
