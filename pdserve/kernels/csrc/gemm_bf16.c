/* y = x @ W^T (+ bias) in bf16 for CPUs where oneDNN has no bf16 GEMM (AVX2 + FMA, no AVX-512 BF16 or
 * AVX-NE-CONVERT): there a bf16 linear falls to PyTorch's own bf16 GEMM, several times slower than its
 * fp32 one. Here each tile is widened to fp32 (exact: a bf16 is the top half of an fp32) and multiplied
 * with fp32 FMAs; the sums are fp32 and rounded once to bf16, after the bias, as F.linear rounds them.
 *
 * x: [m, k] bf16, rows ldx apart; W: [n, k] bf16, contiguous (a plain weight); bias: [n] bf16 or NULL;
 * y: [m, n] bf16, rows ldy apart. x is first widened to fp32 once (shared by the threads). The threads
 * split the columns of y in panels of NR: each packs its panel of W, widened, as [k][NR] (NR floats a
 * step of K, two vectors), which stays in L2, then walks every MR rows of x against it (x's copy is padded
 * with zero rows to a multiple of MR): 12 accumulators, two vectors of W and one broadcast of x, 15 of
 * AVX2's 16 registers. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

enum { GEMM_MR = 6, GEMM_NR = 16 };

/* MR rows of x (fp32, k apart) times the packed panel wp [k][NR] -> out [MR][NR] fp32. The accumulators
 * are named, not an array, so that they stay in registers (as an array GCC stores them every step). */
static void tile(const float *x, int64_t k, const float *wp, float *out) {
#define GEMM_ROW(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
    GEMM_ROW(0) GEMM_ROW(1) GEMM_ROW(2) GEMM_ROW(3) GEMM_ROW(4) GEMM_ROW(5)
#undef GEMM_ROW
    for (int64_t i = 0; i < k; i++) {
        const __m256 w0 = _mm256_loadu_ps(wp + i * GEMM_NR), w1 = _mm256_loadu_ps(wp + i * GEMM_NR + 8);
#define GEMM_ROW(r)                                                   \
    {                                                                 \
        const __m256 b = _mm256_broadcast_ss(x + (r) * k + i);        \
        a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0);                    \
        a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1);                    \
    }
        GEMM_ROW(0) GEMM_ROW(1) GEMM_ROW(2) GEMM_ROW(3) GEMM_ROW(4) GEMM_ROW(5)
#undef GEMM_ROW
    }
#define GEMM_ROW(r)                                                   \
    _mm256_storeu_ps(out + (r) * GEMM_NR, a##r##0);                   \
    _mm256_storeu_ps(out + (r) * GEMM_NR + 8, a##r##1);
    GEMM_ROW(0) GEMM_ROW(1) GEMM_ROW(2) GEMM_ROW(3) GEMM_ROW(4) GEMM_ROW(5)
#undef GEMM_ROW
}

/* Returns 0; -1 where the build has no AVX2 + FMA; -3 out of memory. */
int gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
              int64_t k, int64_t ldx, int64_t ldy, int num_threads) {
    const int64_t padded = (m + GEMM_MR - 1) / GEMM_MR * GEMM_MR; /* rows past m are zeros */
    float *xf = malloc((size_t)(padded * k) * sizeof(float));
    if (!xf) return -3;
    const int64_t panels = (n + GEMM_NR - 1) / GEMM_NR;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < padded; r++)
            for (int64_t i = 0; i < k; i++) xf[r * k + i] = r < m ? bf16_in(x[r * ldx + i]) : 0.0f;
        float *wp = malloc((size_t)(k * GEMM_NR + GEMM_MR * GEMM_NR) * sizeof(float));
        if (!wp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!wp) continue;
            const int64_t n0 = p * GEMM_NR, cols = n - n0 < GEMM_NR ? n - n0 : GEMM_NR;
            for (int64_t i = 0; i < k; i++) /* the panel widened, [k][NR], zeros past the last column */
                for (int64_t c = 0; c < GEMM_NR; c++) wp[i * GEMM_NR + c] = c < cols ? bf16_in(w[(n0 + c) * k + i]) : 0.0f;
            float *out = wp + k * GEMM_NR;
            for (int64_t r0 = 0; r0 < m; r0 += GEMM_MR) {
                const int rows = m - r0 < GEMM_MR ? (int)(m - r0) : GEMM_MR;
                tile(xf + r0 * k, k, wp, out);
                for (int r = 0; r < rows; r++)
                    for (int64_t c = 0; c < cols; c++) {
                        const float b = bias ? bf16_in(bias[n0 + c]) : 0.0f;
                        y[(r0 + r) * ldy + n0 + c] = bf16_out(out[r * GEMM_NR + c] + b);
                    }
            }
        }
        free(wp);
    }
    free(xf);
    return failed ? -3 : 0;
}
#else
int gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
              int64_t k, int64_t ldx, int64_t ldy, int num_threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy, (void)num_threads;
    return -1;
}
#endif
