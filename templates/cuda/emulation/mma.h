/* CUDA's WMMA (nvcuda::wmma) on the host, for the tensor-core kernels the emulation runs
 * (cuda_runtime.h; a .cu file's own `#include <mma.h>` brings this in).
 *
 * A fragment's layout across a warp's lanes is opaque to the program, so here every lane
 * holds the whole tile (x[], num_elements: rows x columns, row by row): load_matrix_sync
 * reads all of it on every lane, mma_sync computes all of it on every lane, and
 * store_matrix_sync writes element t on lane t % 32 only, so that the race check (through a
 * shared array's view, `name + offset`) sees one writer an element and every lane's reads.
 * What a GPU requires of them is checked, failing the launch: a first element 256-bit
 * aligned, ldm a multiple of 16 bytes.
 *
 * Arithmetic, as the tensor cores do it: double (DMMA) d = c + sum over k of a * b, fused
 * in k's order; precision::tf32 fragments hold float, of which a product takes the TF32
 * part (the low 13 bits of the mantissa dropped), multiplied exactly and summed in float.
 * __float_to_tf32 rounds as cvt.rna.tf32.f32 does: to nearest, ties away from zero, 10
 * bits of mantissa kept (NaN and infinity as they are).
 */
#ifndef MOAGEN_MMA_EMULATION_H
#define MOAGEN_MMA_EMULATION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
namespace precision {
struct tf32 {};
}
enum layout_t { mem_row_major, mem_col_major };

template <typename T> struct moagen_storage { typedef T type; };
template <> struct moagen_storage<precision::tf32> { typedef float type; };

/* a fragment's rows and columns: a is m x k, b k x n, the accumulator m x n */
template <typename Use, int M, int N, int K> struct moagen_shape;
template <int M, int N, int K> struct moagen_shape<matrix_a, M, N, K> { enum { rows = M, cols = K }; };
template <int M, int N, int K> struct moagen_shape<matrix_b, M, N, K> { enum { rows = K, cols = N }; };
template <int M, int N, int K> struct moagen_shape<accumulator, M, N, K> { enum { rows = M, cols = N }; };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    typedef typename moagen_storage<T>::type element_type;
    enum { rows = moagen_shape<Use, M, N, K>::rows, cols = moagen_shape<Use, M, N, K>::cols,
           num_elements = rows * cols };
    element_type x[num_elements];
};

/* cvt.rna.tf32.f32 */
static inline float __float_to_tf32(float in)
{
    uint32_t u;
    memcpy(&u, &in, 4);
    if ((u & 0x7f800000u) != 0x7f800000u)
        u = (u + 0x1000u) & 0xffffe000u;
    memcpy(&in, &u, 4);
    return in;
}

/* what a TF32 product takes of a float: its TF32 part */
static inline float moagen_tf32_part(float in)
{
    uint32_t u;
    memcpy(&u, &in, 4);
    u &= 0xffffe000u;
    memcpy(&in, &u, 4);
    return in;
}

/* a pointer's first byte in shared memory, as far as its alignment goes */
template <typename T> static inline uintptr_t moagen_address(const T *p) { return (uintptr_t)p; }
#ifdef MOAGEN_RACECHECK
template <typename T> static inline uintptr_t moagen_address(const moagen_shared<T> &p)
{
    return p.shadow ? p.base : (uintptr_t)p.data;
}
#endif

template <typename E, typename P>
static inline void moagen_check_fragment(const char *what, const P &p, unsigned ldm)
{
    if (moagen_address(p) % 32 != 0 || (ldm * sizeof(E)) % 16 != 0) {
        char who[48];
        moagen_fail("%s: a first element at byte %lu (not 32-byte aligned) or ldm %u (not a "
                    "multiple of 16 bytes), thread %s", what, (unsigned long)moagen_address(p), ldm,
                    moagen_thread_name(moagen_thread, who));
    }
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename P>
static inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout> &f, const P &p, unsigned ldm)
{
    typedef fragment<Use, M, N, K, T, Layout> F;
    typedef typename F::element_type E;
    moagen_check_fragment<E>("wmma::load_matrix_sync", p, ldm);
    const bool row = __is_same(Layout, row_major);
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c) {
            const E v = p[row ? r * ldm + c : c * ldm + r];
            f.x[r * F::cols + c] = v;
        }
}

template <int M, int N, int K, typename T, typename P>
static inline void store_matrix_sync(const P &p, const fragment<accumulator, M, N, K, T> &f,
                                     unsigned ldm, layout_t layout)
{
    typedef fragment<accumulator, M, N, K, T> F;
    moagen_check_fragment<typename F::element_type>("wmma::store_matrix_sync", p, ldm);
    const unsigned int lane = moagen_thread % 32;
    for (int t = lane; t < F::num_elements; t += 32) {
        const int r = t / F::cols, c = t % F::cols;
        p[layout == mem_row_major ? r * ldm + c : c * ldm + r] = f.x[t];
    }
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
static inline void fill_fragment(fragment<Use, M, N, K, T, Layout> &f,
                                 typename fragment<Use, M, N, K, T, Layout>::element_type v)
{
    for (int t = 0; t < fragment<Use, M, N, K, T, Layout>::num_elements; ++t)
        f.x[t] = v;
}

template <int M, int N, int K, typename T, typename AT, typename BT, typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, M, N, K, T> &d,
                            const fragment<matrix_a, M, N, K, AT, LA> &a,
                            const fragment<matrix_b, M, N, K, BT, LB> &b,
                            const fragment<accumulator, M, N, K, T> &c)
{
    const bool tf32 = __is_same(AT, precision::tf32);
    T out[M * N];
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            T sum = c.x[i * N + j];
            for (int k = 0; k < K; ++k) {
                if (tf32)
                    sum += (T)moagen_tf32_part((float)a.x[i * K + k]) *
                           (T)moagen_tf32_part((float)b.x[k * N + j]);
                else
                    sum = fma(a.x[i * K + k], b.x[k * N + j], sum);
            }
            out[i * N + j] = sum;
        }
    for (int t = 0; t < M * N; ++t)
        d.x[t] = out[t];
}

}  // namespace wmma
}  // namespace nvcuda

#endif
