/* Helpers for benchmarks: a STREAM triad (the machine's memory bandwidth roof), the
 * cores' multiply-add peak (the flop roof a kernel cannot pass), and a parallel first touch
 * (pages land on the NUMA node of the thread that writes them first). Built with the
 * kernels' own compiler and flags. */
#include <stdint.h>

void triad(double *restrict a, const double *restrict b, const double *restrict c,
           double s, int64_t n)
{
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
        a[i] = b[i] + s * c[i];
}

void first_touch(unsigned char *a, int64_t nbytes)
{
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nbytes; ++i)
        a[i] = 0;
}

/* The multiply-add peak: every thread runs CHAINS independent chains x = x * a + b, each
 * value a vector as wide as the target's vector registers (GCC's vector extension), so
 * that enough multiply-adds are in flight to fill every port (latency 4 x 2 ports on the
 * x86 cores we run on; 12 chains and the two constants fit AVX2's 16 registers). a and b
 * keep x finite and normal. Returns the flops done; *sink keeps the chains live. */
#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#elif defined(__AVX__)
#define VECTOR_BYTES 32
#else
#define VECTOR_BYTES 16
#endif
#define CHAINS 12

typedef double f64_vector __attribute__((vector_size(VECTOR_BYTES)));
typedef float f32_vector __attribute__((vector_size(VECTOR_BYTES)));

#define MULTIPLY_ADD_PEAK(NAME, VECTOR, SCALAR)                                       \
double NAME(int64_t iterations, SCALAR a, SCALAR b, double *sink)                   \
{                                                                                   \
    double total = 0.0, flops = 0.0;                                                \
    _Pragma("omp parallel reduction(+: total, flops)")                              \
    {                                                                               \
        const VECTOR va = (VECTOR){0} + a, vb = (VECTOR){0} + b;                    \
        VECTOR x[CHAINS];                                                           \
        for (int k = 0; k < CHAINS; ++k)                                            \
            x[k] = (VECTOR){0} + (SCALAR)k;                                         \
        for (int64_t i = 0; i < iterations; ++i) {                                  \
            _Pragma("GCC unroll 12")                                                \
            for (int k = 0; k < CHAINS; ++k)                                        \
                x[k] = x[k] * va + vb;                                              \
        }                                                                           \
        for (int k = 0; k < CHAINS; ++k)                                            \
            for (int lane = 0; lane < (int)(VECTOR_BYTES / sizeof(SCALAR)); ++lane) \
                total += x[k][lane];                                                \
        flops += 2.0 * iterations * CHAINS * (VECTOR_BYTES / sizeof(SCALAR));       \
    }                                                                               \
    *sink = total;                                                                  \
    return flops;                                                                   \
}

MULTIPLY_ADD_PEAK(multiply_add_peak_f64, f64_vector, double)
MULTIPLY_ADD_PEAK(multiply_add_peak_f32, f32_vector, float)
