/* skinny_linear.c's GEMV for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, most cloud VMs and
 * laptops); included by skinny_linear.c, whose contract it keeps (see there).
 *
 * Sixteen values of K a step for both dtypes: fp32 as two vectors of 8, bf16 as one vector of 16
 * split into its even and odd halves, each widened to fp32 in place (a bf16 is the top half of an fp32:
 * the even one shifted up, the odd one masked), so a bf16 pair costs two FMAs and no conversion
 * instruction. A tile is NR = 4 rows of W against XR = 2 rows of x (8 accumulators of the 16 ymm
 * registers); the K values past the last full step are summed in scalar code after the lanes. Each
 * (x row, W row) value is one fixed sequence of sums whatever the number of rows of x, so a row's result
 * does not depend on its batch. Prefetch as the AVX-512 form: the tile's rows are one run of memory,
 * asked for PREFETCH_AHEAD bytes ahead. */
#ifndef PDSERVE_SKINNY_AVX2_H
#define PDSERVE_SKINNY_AVX2_H

#include <immintrin.h>
#include <omp.h>

#define INLINE static inline __attribute__((always_inline))
#define NR 4
#define XR 2
#define STEP 16
#define PREFETCH_AHEAD 16384

struct job {
    const void *x, *w, *bias;
    void *y;
    int64_t m, k, ldx, ldy;
};

/* The 16 values of K at p as two fp32 vectors; for bf16 the even and the odd values (lo and hi: any
 * pairing works, as long as x and W pair alike). */
INLINE void load16(const void *p, int64_t at, int dtype, __m256 *lo, __m256 *hi) {
    if (dtype == SKINNY_F32) {
        *lo = _mm256_loadu_ps((const float *)p + at);
        *hi = _mm256_loadu_ps((const float *)p + at + 8);
    } else {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    }
}

INLINE float value(const void *p, int64_t at, int dtype) {
    return dtype == SKINNY_F32 ? ((const float *)p)[at] : bf16_in(((const uint16_t *)p)[at]);
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* xr rows of x (from row m0) against nr rows of W (from row n0) into out; xr, nr constant where inlined. */
INLINE void block(const struct job *jb, int dtype, int64_t m0, int xr, int64_t n0, int nr, float out[XR][NR]) {
    const int64_t k = jb->k, full = k / STEP * STEP, elem = dtype == SKINNY_F32 ? 4 : 2;
    const char *tile = (const char *)jb->w + n0 * k * elem;
    __m256 acc[XR][NR];
    _Pragma("GCC unroll 4") for (int i = 0; i < xr; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < full; kk += STEP) {
        _Pragma("GCC unroll 4") for (int64_t line = 0; line < NR * STEP * elem; line += 64)
            _mm_prefetch(tile + PREFETCH_AHEAD + kk * NR * elem + line, xr == 1 ? _MM_HINT_T0 : _MM_HINT_T1);
        __m256 xl[XR], xh[XR];
        _Pragma("GCC unroll 4") for (int i = 0; i < xr; i++) load16(jb->x, (m0 + i) * jb->ldx + kk, dtype, &xl[i], &xh[i]);
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++) {
            __m256 wl, wh;
            load16(jb->w, (n0 + j) * k + kk, dtype, &wl, &wh);
            _Pragma("GCC unroll 4") for (int i = 0; i < xr; i++)
                acc[i][j] = _mm256_fmadd_ps(wh, xh[i], _mm256_fmadd_ps(wl, xl[i], acc[i][j]));
        }
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < xr; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++) {
            float s = hsum8(acc[i][j]);
            for (int64_t kk = full; kk < k; kk++)
                s += value(jb->x, (m0 + i) * jb->ldx + kk, dtype) * value(jb->w, (n0 + j) * k + kk, dtype);
            out[i][j] = s;
        }
}

/* out (+ bias) into y[m0 + i][n0 + j], in y's dtype. */
INLINE void store(const struct job *jb, int dtype, int64_t m0, int xr, int64_t n0, int nr, float out[XR][NR]) {
    _Pragma("GCC unroll 4") for (int i = 0; i < xr; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++) {
            const float v = out[i][j] + (jb->bias ? value(jb->bias, n0 + j, dtype) : 0.0f);
            const int64_t at = (m0 + i) * jb->ldy + n0 + j;
            if (dtype == SKINNY_F32) ((float *)jb->y)[at] = v;
            else ((uint16_t *)jb->y)[at] = bf16_out(v);
        }
}

/* Columns [n0, n1) of y for every row of x: NR rows of W at a time (the last few one by one), each
 * meeting the rows of x XR at a time while it is in cache. */
INLINE void column_range(const struct job *jb, int dtype, int64_t n0, int64_t n1) {
    float out[XR][NR] = {{0}};  /* (every value a store reads is written first; gcc cannot tell) */
    for (int64_t n = n0; n < n1;) {
        const int nr = n1 - n >= NR ? NR : 1;
        for (int64_t m0 = 0; m0 < jb->m; m0 += XR) {
            const int xr = jb->m - m0 >= XR ? XR : 1;
            if (nr == NR && xr == XR) block(jb, dtype, m0, XR, n, NR, out);
            else if (nr == NR) block(jb, dtype, m0, 1, n, NR, out);
            else if (xr == XR) block(jb, dtype, m0, XR, n, 1, out);
            else block(jb, dtype, m0, 1, n, 1, out);
            store(jb, dtype, m0, xr, n, nr, out);
        }
        n += nr;
    }
}

static void range_f32(const struct job *jb, int64_t n0, int64_t n1) { column_range(jb, SKINNY_F32, n0, n1); }
static void range_bf16(const struct job *jb, int64_t n0, int64_t n1) { column_range(jb, SKINNY_BF16, n0, n1); }

int skinny_linear(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int64_t ldx, int64_t ldy, int dtype, int num_threads) {
    if ((dtype != SKINNY_F32 && dtype != SKINNY_BF16) || m < 1 || n < 1 || k < 1) return -1;
    const struct job jb = {x, w, bias, y, m, k, ldx, ldy};
    const int64_t tiles = (n + NR - 1) / NR;
    const int threads = n * k < 32768 || tiles < 2 ? 1 : num_threads; /* a tiny weight is not worth a thread */
#pragma omp parallel num_threads(threads)
    {
        /* each thread streams one contiguous share of w, whole tiles */
        const int64_t t0 = tiles * omp_get_thread_num() / omp_get_num_threads();
        const int64_t t1 = tiles * (omp_get_thread_num() + 1) / omp_get_num_threads();
        const int64_t n1 = t1 * NR < n ? t1 * NR : n;
        if (t0 * NR < n1) (dtype == SKINNY_F32 ? range_f32 : range_bf16)(&jb, t0 * NR, n1);
    }
    return 0;
}

#endif
