/* Helpers for benchmarks: a STREAM triad (the machine's memory bandwidth roof) and a
 * parallel first touch (pages land on the NUMA node of the thread that writes them first).
 * Built with the kernels' own compiler and flags. */
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
