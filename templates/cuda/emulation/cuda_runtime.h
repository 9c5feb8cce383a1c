/* CUDA's execution model on the host, for running generated .cu files without a GPU.
 *
 * A stand-in for the CUDA runtime header: moagen.targets.cuda.build.build_cuda_emulated compiles a .cu
 * file with g++ -x c++ -fopenmp and this folder first on the include path, so the file's
 * own `#include <cuda_runtime.h>` brings this in and its text stays as nvcc sees it. The
 * launch (MOAGEN_LAUNCH) and shared memory (MOAGEN_SHARED, MOAGEN_SHARED_AT) are macros the
 * .cu file defines for nvcc unless this header has.
 *
 * Launches. MOAGEN_LAUNCH(kernel, grid, block, shared_bytes, stream, args...), grid and
 * block dim3 values, runs the grid's blocks one after another (blockIdx x fastest, then y,
 * then z) and each block's threads at once, as an OpenMP team of block.x * block.y * block.z
 * threads: team thread t is threadIdx (t % X, t / X % Y, t / (X * Y)), warp t / 32, lane
 * t % 32. A race between a block's threads (a += that should be atomicAdd, a read before the
 * __syncthreads that orders it) can happen here too. What a GPU refuses is refused, with its
 * cudaError_t: a zero dimension, more than 1024 threads a block (1024 x, 1024 y, 64 z),
 * grid y or z over 65535 (cudaErrorInvalidConfiguration); dynamic shared memory over the
 * architecture's opt-in limit a block, or over 48 KB without cudaFuncSetAttribute(kernel,
 * cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) first (cudaErrorInvalidValue). The
 * architecture is sm_90 (227 KB), or the one MOAGEN_EMULATED_ARCH names (sm_80: 163 KB;
 * sm_86, sm_89: 99 KB), as cudaDeviceGetAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)
 * reports it. Launches are synchronous (the stream is ignored), one
 * at a time per process.
 *
 * Shared memory. Blocks running one at a time make `static` storage per-block storage: that
 * is `__shared__` and MOAGEN_SHARED(T, name, count) (a static array; it keeps what the last
 * block left). MOAGEN_SHARED_AT(T, name, byte_offset, count) is `count` T at `byte_offset`
 * in the block's dynamic shared memory: a buffer of the launch's shared_bytes, 32-byte
 * aligned (as a tensor-core kernel declares it), filled with 0xff bytes before each block (a NaN in every float and double, -1 in
 * every int), so that reading what no thread of the block wrote shows. A view that does not
 * fit in the buffer, or is misaligned for T, fails the launch.
 *
 * Warps. __shfl_sync, __shfl_xor_sync, __shfl_down_sync, __shfl_up_sync (any type of up to 8
 * bytes; width a power of two up to 32) exchange through barriers over the caller's warp, so
 * they must be convergent over the warp: every lane of a warp calls the same shuffles in the
 * same order (a lane that has returned, or skipped one in a branch, deadlocks the warp or
 * fails the launch); warps may run different numbers of them (a warp's own slice of keys).
 * __syncwarp is a barrier over the whole team. Their mask must name every lane of the
 * calling warp that exists (0xffffffff for full warps): partial-warp shuffles are not
 * emulated, and reading a lane beyond the block fails the launch.
 *
 * The race check (g++ -DMOAGEN_RACECHECK; `moagen verify --emulate --racecheck`). Every
 * access through MOAGEN_SHARED and MOAGEN_SHARED_AT arrays, `name[i]` a proxy that converts
 * to T and assigns from it, is recorded per 4-byte word and barrier interval: two threads
 * of a block touching one word between two __syncthreads (or, both in one warp, between two
 * __syncwarp), at least one writing, is a race, and an index outside the array (or a view
 * outside the dynamic buffer) an error. The first one fails the launch with
 * moagenErrorCheckFailed and a message naming the kernel, the array, the element and both
 * threads, which moagen_emulation_error() returns (moagen.targets.cuda.loader raises it).
 * Not checked: plain `__shared__` arrays, global memory, atomics (`atomicAdd(&name[i], v)`
 * is bounds-checked, not recorded), accesses through a pointer taken from an array, races
 * between blocks. With the proxy, take a read's value as T (`const double v = name[i]`,
 * not `auto`; `T(name[i])` where a template deduces its argument's type).
 */
#ifndef MOAGEN_CUDA_EMULATION_H
#define MOAGEN_CUDA_EMULATION_H

#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x = 1, unsigned int y = 1, unsigned int z = 1) : x(x), y(y), z(z) {}
};

/* each OpenMP thread is one CUDA thread: its indices are its own */
static thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
static constexpr int warpSize = 32;

/* the codes moagen's launchers return, with the CUDA runtime's numbers, and moagen's own:
 * a check of the emulation failed (moagen_emulation_error() says which) */
enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorLaunchOutOfResources = 701,
    moagenErrorCheckFailed = 9999,
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

/* ---- the launch's state, and its first failed check ------------------------------------ */

static const char *moagen_kernel = "";       /* the kernel running */
static unsigned int moagen_block_serial = 0;  /* counts blocks run: stamps the race check's records */
static thread_local unsigned int moagen_thread;  /* the team thread: threadIdx, linear */
static thread_local unsigned int moagen_syncs, moagen_warp_syncs;  /* barriers passed in this block */
static char moagen_error_text[1024];
static bool moagen_failed = false;

/* The first failed check of the launch (later ones are dropped); the kernel runs on. */
static void moagen_fail(const char *format, ...) __attribute__((format(printf, 1, 2)));
static void moagen_fail(const char *format, ...)
{
    va_list args;
    va_start(args, format);
#pragma omp critical(moagen_error)
    if (!moagen_failed) {
        int used = snprintf(moagen_error_text, sizeof moagen_error_text, "kernel %s: ", moagen_kernel);
        vsnprintf(moagen_error_text + used, sizeof moagen_error_text - used, format, args);
        moagen_failed = true;
    }
    va_end(args);
}

/* ---- vector loads: the types, and moagen_load4 checking the alignment a GPU needs ------ */

struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(16))) double2 { double x, y; };

/* The generated file's moagen_load4 (4 elements by 16-byte loads), failing the launch where
 * `from` is not 16-byte aligned: on a GPU a misaligned vector load faults. */
#define MOAGEN_LOAD4
template <typename T>
static inline void moagen_load4(T *to, const T *from)
{
    if ((uintptr_t)from % 16)
        moagen_fail("a vector load from %p, not 16-byte aligned", (const void *)from);
    memcpy(to, from, 4 * sizeof(T));
}

/* What failed the last launch that returned moagenErrorCheckFailed. */
extern "C" __attribute__((weak, visibility("default"))) const char *moagen_emulation_error(void)
{
    return moagen_error_text;
}

/* "(x,y,z)" of a team thread, in `text` */
static const char *moagen_thread_name(unsigned int t, char text[48])
{
    snprintf(text, 48, "(%u,%u,%u)", t % blockDim.x, t / blockDim.x % blockDim.y,
             t / (blockDim.x * blockDim.y));
    return text;
}

static inline void __syncthreads(void)
{
    ++moagen_syncs;
    ++moagen_warp_syncs;
#pragma omp barrier
}

/* the whole team's barrier: a warp's lanes synchronized (and the block's, which the race
 * check does not count) */
static inline void __syncwarp(unsigned int mask = 0xffffffffu)
{
    (void)mask;
    ++moagen_warp_syncs;
#pragma omp barrier
}

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
template <typename T> static inline T __ldg(const T *p) { return *p; }

/* ---- warp shuffles: through the warp, all of its lanes at each call -------------------- */

static unsigned char moagen_lanes[1024][8];  /* a value a thread */
static unsigned int moagen_lane_calls[1024];  /* which shuffle each thread is at */
static thread_local unsigned int moagen_shuffles;  /* shuffles this thread has made in this block */
static unsigned int moagen_warp_arrived[32], moagen_warp_generation[32];  /* a warp's barrier */

/* Waits for the `lanes` lanes of `warp`: the last to arrive opens the next generation. */
static void moagen_warp_barrier(unsigned int warp, unsigned int lanes)
{
    const unsigned int generation = __atomic_load_n(&moagen_warp_generation[warp], __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&moagen_warp_arrived[warp], 1u, __ATOMIC_ACQ_REL) == lanes) {
        __atomic_store_n(&moagen_warp_arrived[warp], 0u, __ATOMIC_RELAXED);
        __atomic_store_n(&moagen_warp_generation[warp], generation + 1, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&moagen_warp_generation[warp], __ATOMIC_ACQUIRE) == generation)
            sched_yield();
    }
}

/* `value` of the lane `source` of the caller's warp (or its own where source < 0) */
template <typename T>
static T moagen_shuffle(const char *what, unsigned int mask, T value, int source)
{
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    const unsigned int t = moagen_thread, threads = blockDim.x * blockDim.y * blockDim.z;
    const unsigned int warp = t / 32, lanes = threads - warp * 32 < 32 ? threads - warp * 32 : 32;
    const unsigned int present = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    char name[48];
    if ((mask & present) != present)
        moagen_fail("%s: thread %s's mask %#x leaves out lanes of its warp (lanes present %#x): "
                    "the emulation runs full-warp shuffles only", what, moagen_thread_name(t, name),
                    mask, present);
    else if (source >= (int)lanes)
        moagen_fail("%s: thread %s reads lane %d, beyond the block's threads", what,
                    moagen_thread_name(t, name), source);
    const unsigned int call = ++moagen_shuffles;
    memcpy(moagen_lanes[t], &value, sizeof(T));
    moagen_lane_calls[t] = call;
    moagen_warp_barrier(warp, lanes);
    T result = value;
    if (source >= 0 && source < (int)lanes) {
        const unsigned int from = warp * 32 + source;
        if (moagen_lane_calls[from] != call)
            moagen_fail("%s: thread %s is at its shuffle %u, the lane it reads at its shuffle %u: "
                        "shuffles must be convergent over the warp", what,
                        moagen_thread_name(t, name), call, moagen_lane_calls[from]);
        memcpy(&result, moagen_lanes[from], sizeof(T));
    }
    moagen_warp_barrier(warp, lanes);
    return result;
}

static inline unsigned int moagen_lane(void) { return moagen_thread % 32; }

template <typename T>
static inline T __shfl_sync(unsigned int mask, T value, int src_lane, int width = warpSize)
{
    const int lane = moagen_lane(), base = lane & ~(width - 1);
    return moagen_shuffle("__shfl_sync", mask, value, base + (src_lane & (width - 1)));
}

template <typename T>
static inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = warpSize)
{
    const int lane = moagen_lane(), source = lane ^ lane_mask;
    /* a later group's lane: the thread's own value */
    return moagen_shuffle("__shfl_xor_sync", mask, value,
                          source >= (lane & ~(width - 1)) + width ? -1 : source);
}

template <typename T>
static inline T __shfl_down_sync(unsigned int mask, T value, unsigned int delta, int width = warpSize)
{
    const int lane = moagen_lane();
    return moagen_shuffle("__shfl_down_sync", mask, value,
                          (lane & (width - 1)) + (int)delta >= width ? -1 : lane + (int)delta);
}

template <typename T>
static inline T __shfl_up_sync(unsigned int mask, T value, unsigned int delta, int width = warpSize)
{
    const int lane = moagen_lane();
    return moagen_shuffle("__shfl_up_sync", mask, value,
                          (lane & (width - 1)) < (int)delta ? -1 : lane - (int)delta);
}

/* ---- dynamic shared memory ------------------------------------------------------------- */

static std::vector<unsigned char> moagen_dynamic_memory;  /* the block's, 32 bytes spare to align */
static unsigned char *moagen_dynamic_shared = nullptr;
static size_t moagen_dynamic_bytes = 0;

/* the start of `count` T at `offset` in the dynamic buffer, or of scratch where they do not
 * fit (the launch has failed) */
template <typename T>
static T *moagen_dynamic_at(const char *name, long long offset, long long count)
{
    if (offset < 0 || count < 0 || offset % alignof(T) != 0
        || (unsigned long long)(offset + count * (long long)sizeof(T)) > moagen_dynamic_bytes) {
        char who[48];
        moagen_fail("dynamic shared `%s`: %lld elements of %zu bytes at byte %lld do not fit in "
                    "the launch's %zu bytes, %zu-byte aligned (thread %s)", name, count, sizeof(T),
                    offset, moagen_dynamic_bytes, alignof(T), moagen_thread_name(moagen_thread, who));
        static thread_local std::vector<T> scratch;
        scratch.resize(count > 0 ? count : 1);
        return scratch.data();
    }
    return reinterpret_cast<T *>(moagen_dynamic_shared + offset);
}

/* ---- the race check -------------------------------------------------------------------- */

#ifdef MOAGEN_RACECHECK
struct moagen_access {  /* one access to a word, by a team thread */
    unsigned int block = 0;  /* moagen_block_serial when made; 0: none */
    unsigned int syncs, warp_syncs, thread;
    const char *name;
    long long index;
};

/* what a word saw since: its last writer, and two of its readers (distinct threads) */
struct moagen_word {
    moagen_access writer, reader, other;
};

/* the records of one shared array, or of the dynamic buffer */
struct moagen_shadow {
    std::vector<moagen_word> words;
    omp_lock_t lock;
    explicit moagen_shadow(size_t bytes) : words((bytes + 3) / 4) { omp_init_lock(&lock); }
    moagen_shadow(const moagen_shadow &) = delete;
    moagen_shadow &operator=(const moagen_shadow &) = delete;
    ~moagen_shadow() { omp_destroy_lock(&lock); }
};

static inline moagen_access moagen_now(const char *name, long long index)
{
    moagen_access a;
    a.block = moagen_block_serial;
    a.syncs = moagen_syncs;
    a.warp_syncs = moagen_warp_syncs;
    a.thread = moagen_thread;
    a.name = name;
    a.index = index;
    return a;
}

/* whether `before` happened before `now` (a barrier between them, or one thread), or was
 * made in another block */
static inline bool moagen_ordered(const moagen_access &before, const moagen_access &now)
{
    return before.block != now.block || before.thread == now.thread || before.syncs < now.syncs
           || (before.thread / 32 == now.thread / 32 && before.warp_syncs < now.warp_syncs);
}

static void moagen_race(const moagen_access &before, const char *did, const moagen_access &now,
                        const char *does)
{
    char one[48], two[48];
    moagen_fail("race on shared `%s`[%lld] in block (%u,%u,%u): thread %s %s `%s`[%lld] and "
                "thread %s %s it with no __syncthreads between", now.name, now.index, blockIdx.x,
                blockIdx.y, blockIdx.z, moagen_thread_name(before.thread, one), did, before.name,
                before.index, moagen_thread_name(now.thread, two), does);
}

static void moagen_record(moagen_shadow &shadow, size_t first, size_t last, const moagen_access &now,
                          bool write)
{
    omp_set_lock(&shadow.lock);
    for (size_t w = first; w <= last; ++w) {
        moagen_word &word = shadow.words[w];
        if (word.writer.block && !moagen_ordered(word.writer, now))
            moagen_race(word.writer, "wrote", now, write ? "writes" : "reads");
        if (write) {
            for (const moagen_access *r : {&word.reader, &word.other})
                if (r->block && !moagen_ordered(*r, now))
                    moagen_race(*r, "read", now, "writes");
            word.writer = now;
            word.reader.block = word.other.block = 0;
        } else if (!word.reader.block || word.reader.thread == now.thread) {
            word.reader = now;
        } else {
            word.other = word.reader;
            word.reader = now;
        }
    }
    omp_unset_lock(&shadow.lock);
}

/* an array of shared memory as the race check sees it: `name[i]` records the access */
template <typename T>
struct moagen_shared {
    const char *name;
    T *data;
    long long count;
    moagen_shadow *shadow;
    size_t base;  /* its first byte in the shadow's memory */
    long long first = 0;  /* a view's (`name + first`) first element in the array */

    enum use { READ, WRITE, ADDRESS };

    T *at(long long i, use how) const
    {
        if (i < 0 || i >= count) {
            char who[48];
            moagen_fail("shared `%s`: index %lld is out of bounds (%lld elements), thread %s of "
                        "block (%u,%u,%u)", name, i + first, count + first,
                        moagen_thread_name(moagen_thread, who), blockIdx.x, blockIdx.y, blockIdx.z);
            static thread_local T dummy;
            return &dummy;
        }
        if (how != ADDRESS && shadow) {  /* no shadow: scratch, the launch has failed */
            const size_t byte = base + (size_t)i * sizeof(T);
            moagen_record(*shadow, byte / 4, (byte + sizeof(T) - 1) / 4,
                          moagen_now(name, i + first), how == WRITE);
        }
        return data + i;
    }

    struct ref {
        const moagen_shared *array;
        long long i;
        operator T() const { return *array->at(i, READ); }
        ref &operator=(T value) { *array->at(i, WRITE) = value; return *this; }
        ref &operator=(const ref &other) { return *this = T(other); }
        ref &operator+=(T value) { *array->at(i, WRITE) += value; return *this; }
        ref &operator-=(T value) { *array->at(i, WRITE) -= value; return *this; }
        ref &operator*=(T value) { *array->at(i, WRITE) *= value; return *this; }
        ref &operator/=(T value) { *array->at(i, WRITE) /= value; return *this; }
        T *operator&() const { return array->at(i, ADDRESS); }  /* for atomics: not recorded */
    };

    template <typename I>
    ref operator[](I i) const { return ref{this, (long long)i}; }

    /* `name + i`: a view from element i on (a WMMA load's or store's first element),
     * whose accesses are recorded as the array's */
    moagen_shared operator+(long long i) const
    {
        at(i < count ? i : count - 1, ADDRESS);  /* bounds-checked */
        moagen_shared view = *this;
        view.data += i;
        view.count -= i;
        view.base += (size_t)i * sizeof(T);
        view.first += i;
        return view;
    }
};

/* a static shared array with its records */
template <typename T, long long N>
struct moagen_static_shared : moagen_shared<T> {
    T storage[N];
    moagen_shadow records{N * sizeof(T)};
    explicit moagen_static_shared(const char *name)
        : moagen_shared<T>{name, storage, N, &records, 0} {}
};

static moagen_shadow *moagen_dynamic_shadow = nullptr;

template <typename T>
static moagen_shared<T> moagen_dynamic_array(const char *name, long long offset, long long count)
{
    T *data = moagen_dynamic_at<T>(name, offset, count);
    if ((unsigned char *)data != moagen_dynamic_shared + offset)  /* does not fit: scratch, unchecked */
        return moagen_shared<T>{name, data, count, nullptr, 0};
    return moagen_shared<T>{name, data, count, moagen_dynamic_shadow, (size_t)offset};
}

#define MOAGEN_SHARED(T, name, count) \
    static moagen_static_shared<T, (count)> name(#name)
#define MOAGEN_SHARED_AT(T, name, byte_offset, count) \
    const moagen_shared<T> name = moagen_dynamic_array<T>(#name, (byte_offset), (count))
#else
#define MOAGEN_SHARED(T, name, count) static T name[count]
#define MOAGEN_SHARED_AT(T, name, byte_offset, count) \
    T *const name = moagen_dynamic_at<T>(#name, (byte_offset), (count))
#endif

/* ---- kernel attributes and the launch -------------------------------------------------- */

enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

enum cudaDeviceAttr {
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

static const size_t MOAGEN_DEFAULT_DYNAMIC_SHARED = 48 * 1024;

/* The opt-in dynamic shared memory a block of the emulated architecture (the header's
 * comment); 0 for a name it does not know, with why in moagen_emulation_error(). */
static size_t moagen_max_dynamic_shared(void)
{
    static const struct { const char *arch; size_t bytes; } limits[] = {
        {"sm_80", 163 * 1024}, {"sm_86", 99 * 1024}, {"sm_89", 99 * 1024}, {"sm_90", 227 * 1024}};
    const char *arch = getenv("MOAGEN_EMULATED_ARCH");
    if (arch == nullptr || *arch == 0) arch = "sm_90";
    for (const auto &limit : limits)
        if (strcmp(limit.arch, arch) == 0) return limit.bytes;
    snprintf(moagen_error_text, sizeof moagen_error_text,
             "MOAGEN_EMULATED_ARCH=%s: the emulation knows sm_80, sm_86, sm_89 and sm_90", arch);
    return 0;
}

static inline cudaError_t cudaGetDevice(int *device)
{
    *device = 0;  /* the emulation's one device */
    return cudaSuccess;
}

static cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attribute, int device)
{
    if (attribute != cudaDevAttrMaxSharedMemoryPerBlockOptin || device != 0)
        return cudaErrorInvalidValue;
    *value = (int)moagen_max_dynamic_shared();
    return *value ? cudaSuccess : moagenErrorCheckFailed;
}

struct moagen_kernel_limit {
    const void *kernel;
    size_t dynamic_shared;
};
static std::vector<moagen_kernel_limit> moagen_kernel_limits;

static size_t moagen_dynamic_limit(const void *kernel)
{
    for (const moagen_kernel_limit &k : moagen_kernel_limits)
        if (k.kernel == kernel) return k.dynamic_shared;
    return MOAGEN_DEFAULT_DYNAMIC_SHARED;
}

/* the dynamic shared memory a kernel may be launched with, as a GPU records it */
template <typename Kernel>
static cudaError_t cudaFuncSetAttribute(Kernel *kernel, cudaFuncAttribute attribute, int value)
{
    if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value < 0 || (size_t)value > moagen_max_dynamic_shared()) return cudaErrorInvalidValue;
        const void *key = reinterpret_cast<const void *>(kernel);
        for (moagen_kernel_limit &k : moagen_kernel_limits)
            if (k.kernel == key) { k.dynamic_shared = value; return cudaSuccess; }
        moagen_kernel_limits.push_back({key, (size_t)value});
    }
    return cudaSuccess;
}

template <typename Body>
static void moagen_launch(const char *name, const void *kernel, dim3 grid, dim3 block,
                          size_t shared_bytes, const Body &body)
{
    const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z || threads > 1024
        || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.y > 65535 || grid.z > 65535) {
        moagen_last_error = cudaErrorInvalidConfiguration;  /* what a GPU refuses */
        return;
    }
    if (shared_bytes > moagen_dynamic_limit(kernel)) {
        moagen_last_error = cudaErrorInvalidValue;
        return;
    }
    moagen_kernel = name;
    moagen_failed = false;
    moagen_dynamic_memory.assign(shared_bytes + 32, 0xff);
    moagen_dynamic_shared = moagen_dynamic_memory.data()
                            + (32 - (uintptr_t)moagen_dynamic_memory.data() % 32) % 32;
    moagen_dynamic_bytes = shared_bytes;
#ifdef MOAGEN_RACECHECK
    moagen_shadow dynamic_records(shared_bytes);
    moagen_dynamic_shadow = &dynamic_records;
#endif
    bool short_team = false;
    const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    for (unsigned long long serial = 0; serial < blocks && !moagen_failed; ++serial) {
        ++moagen_block_serial;
        memset(moagen_dynamic_shared, 0xff, shared_bytes);
        const dim3 at((unsigned int)(serial % grid.x), (unsigned int)(serial / grid.x % grid.y),
                      (unsigned int)(serial / ((unsigned long long)grid.x * grid.y)));
#pragma omp parallel num_threads(threads) reduction(||: short_team)
        {
            /* fewer threads than asked (OMP_THREAD_LIMIT, nested in a parallel region)
             * would leave iterations undone and barriers unmatched: run nothing */
            if ((unsigned long long)omp_get_num_threads() != threads) {
                short_team = true;
            } else {
                const unsigned int t = (unsigned int)omp_get_thread_num();
                moagen_thread = t;
                moagen_syncs = moagen_warp_syncs = moagen_shuffles = 0;
                threadIdx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
                blockIdx = at;
                blockDim = block;
                gridDim = grid;
                body();
            }
        }
        if (short_team) {
            moagen_last_error = cudaErrorLaunchOutOfResources;
            break;
        }
    }
#ifdef MOAGEN_RACECHECK
    moagen_dynamic_shadow = nullptr;
#endif
    if (moagen_failed && !short_team) moagen_last_error = moagenErrorCheckFailed;
}

#define MOAGEN_LAUNCH(kernel, grid, block, shared_bytes, stream, ...)                          \
    ((void)(stream), moagen_launch(#kernel, reinterpret_cast<const void *>(&kernel), (grid),   \
                                   (block), (shared_bytes), [&] { kernel(__VA_ARGS__); }))

#endif
