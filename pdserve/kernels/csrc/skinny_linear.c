/* y = x @ W^T (+ bias) for a few rows of x: the linears of a decode step.
 *
 * At a decode step x has one row per sequence, so a linear is a matrix-vector product whose time is
 * the time to stream W from memory once, and at a few rows this loop on plain row-major weights streams
 * W faster than oneDNN's GEMM on its packed weights. Past 8 fp32 rows the tiles turn compute-bound, so
 * 9 to 16 fp32 rows take a second loop (lanes_f32, below). The engine sends it the steps of
 * cpu.SKINNY_ROWS rows (layers.linear), where the kernel dispatch found it the faster.
 *
 * Work is split by output columns (rows of W), NR at a time: each thread streams its own share of W
 * once, and the NR rows it holds meet every row of x before it moves on (for more than MR rows of x,
 * the NR weight rows are read again from L1/L2, not from memory). Each (x row, W row) product is a
 * 16-lane fp32 accumulator summed across its lanes at the end, in the same order whatever the number
 * of rows of x, so a sequence's result does not depend on the batch it runs in (for fp32: among batches
 * of 1-8 rows, and among batches of 9-16, which the lane loop takes).
 *
 * Dtypes: fp32 (fp32 FMAs), bf16 (products of bf16 pairs with fp32 accumulation, `vdpbf16ps`, where
 * the CPU has AVX512-BF16, else both widened to fp32); y in x's dtype, the bias added in fp32 before
 * the one rounding. x, W and y have unit stride along K and N. Returns 0; -1 where the kernel does
 * not apply (neither AVX-512 nor AVX2 + FMA at build time, another dtype), -3 out of memory for the lane
 * loop's copy of x: the caller keeps its GEMM. Built for AVX2 + FMA without AVX-512, skinny_avx2.h
 * stands in for everything below.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

enum { SKINNY_F32 = 0, SKINNY_BF16 = 1 };

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#define NR 4 /* rows of W per tile */
#define MR 4 /* rows of x per pass over a tile */

#define INLINE static inline __attribute__((always_inline))

/* The sums of the rows acc[0..nr) into out[0..nr): four at once when nr is NR. */
INLINE void reduce_rows(const __m512 *acc, int nr, float *out) {
    if (nr != NR) {
        for (int j = 0; j < nr; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
        return;
    }
    __m128 quarter[NR];
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {
        const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
        quarter[j] = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    }
    _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(quarter[0], quarter[1]), _mm_hadd_ps(quarter[2], quarter[3])));
}

/* fp32: 16 values of K per step. */
INLINE __m512 load_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

/* Asks for the weights PREFETCH_AHEAD bytes past the NR cache lines a step reads, counting a tile's rows
 * as the one run of memory they are (a thread's tiles follow each other in W). The hardware's own
 * prefetch follows each of the tile's NR row streams on its own and stops at each 4 KiB page, and falls
 * behind the memory's bandwidth. One row asks into L1 (the line is needed at once); several rows into L2,
 * since they work on a tile for a while and later passes over it (more than MR rows) must still find
 * it in L1. The weights sit in huge pages (host_malloc.huge_page_buffer; docs/benchmarks.md, "The decode
 * GEMV: prefetch and huge pages"). Past the last tile a prefetch asks for nothing useful, and it never
 * faults. */
#define PREFETCH_AHEAD 16384
#define PREFETCH_FLAT(w, step, hint) \
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) \
        _mm_prefetch((const char *)(w) + PREFETCH_AHEAD + ((step) * NR + j) * 64, hint)

/* One step along K: rows of x times rows of w, under `mask` (all ones but in the last step). */
INLINE void step_f32(__m512 acc[MR][NR], const float *x, int64_t ldx, const float *w, int64_t k, int64_t kk,
                     __mmask16 mask, int mr, int nr) {
    PREFETCH_FLAT(w, kk / 16, _MM_HINT_T1);
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++) {
        const __m512 xv = load_f32(x + i * ldx + kk, mask);
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++)
            acc[i][j] = _mm512_fmadd_ps(load_f32(w + j * k + kk, mask), xv, acc[i][j]);
    }
}

/* mr rows of x against nr rows of w; mr and nr are constants where this is inlined, so the
 * accumulators live in registers. */
INLINE void block_f32(const float *x, int64_t ldx, const float *w, int64_t k, int mr, int nr, float out[MR][NR]) {
    const int64_t full = k & ~(int64_t)15;
    __m512 acc[MR][NR];
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    if (mr == 1) /* as in block_bf16 */
        for (int64_t kk = 0; kk < full; kk += 16) {
            PREFETCH_FLAT(w, kk / 16, _MM_HINT_T0);
            const __m512 xv = _mm512_loadu_ps(x + kk);
            _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++)
                acc[0][j] = _mm512_fmadd_ps(_mm512_loadu_ps(w + j * k + kk), xv, acc[0][j]);
        }
    else
        for (int64_t kk = 0; kk < full; kk += 16) step_f32(acc, x, ldx, w, k, kk, (__mmask16)0xffff, mr, nr);
    if (full < k) step_f32(acc, x, ldx, w, k, full, (__mmask16)((1u << (k - full)) - 1u), mr, nr);
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++) reduce_rows(acc[i], nr, out[i]);
}

/* bf16: 32 values of K per step. */
INLINE __m512i load_bf16(const uint16_t *p, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, p); }

#if defined(__AVX512BF16__)
INLINE __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#else
/* The even and odd bf16 of each 32-bit lane widened to fp32 (a bf16 is the top half of an fp32). */
INLINE __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)), acc);
}
#endif

INLINE void step_bf16(__m512 acc[MR][NR], const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k,
                      int64_t kk, __mmask32 mask, int mr, int nr) {
    PREFETCH_FLAT(w, kk / 32, _MM_HINT_T1);
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++) {
        const __m512i xv = load_bf16(x + i * ldx + kk, mask);
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++)
            acc[i][j] = dot_bf16(acc[i][j], load_bf16(w + j * k + kk, mask), xv);
    }
}

INLINE void block_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k, int mr, int nr,
                       float out[MR][NR]) {
    const int64_t full = k & ~(int64_t)31;
    __m512 acc[MR][NR];
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    if (mr == 1) /* one row of x: plain loads indexed from the row starts (measured faster than the general step) */
        for (int64_t kk = 0; kk < full; kk += 32) {
            PREFETCH_FLAT(w, kk / 32, _MM_HINT_T0);
            const __m512i xv = _mm512_loadu_si512(x + kk);
            _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++)
                acc[0][j] = dot_bf16(acc[0][j], _mm512_loadu_si512(w + j * k + kk), xv);
        }
    else
        for (int64_t kk = 0; kk < full; kk += 32)
            step_bf16(acc, x, ldx, w, k, kk, (__mmask32)0xffffffffu, mr, nr);
    if (full < k) step_bf16(acc, x, ldx, w, k, full, (__mmask32)((1ull << (k - full)) - 1ull), mr, nr);
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++) reduce_rows(acc[i], nr, out[i]);
}

struct job {
    const void *x, *w, *bias;
    void *y;
    int64_t m, k, ldx, ldy;
};

/* part[i][j] (+ bias) into y[m0 + i][n0 + j], in y's dtype. */
INLINE void store(const struct job *jb, int dtype, int64_t m0, int mr, int64_t n0, int nr, float part[MR][NR]) {
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nr; j++) {
            const int64_t at = (m0 + i) * jb->ldy + n0 + j;
            if (dtype == SKINNY_F32)
                ((float *)jb->y)[at] = part[i][j] + (jb->bias ? ((const float *)jb->bias)[n0 + j] : 0.0f);
            else
                ((uint16_t *)jb->y)[at] =
                    bf16_out(part[i][j] + (jb->bias ? bf16_in(((const uint16_t *)jb->bias)[n0 + j]) : 0.0f));
        }
}

/* Columns n0 .. n0 + nr of y for every row of x: the rows of x MR at a time, then `rem` more. */
INLINE void columns(const struct job *jb, int dtype, int rem, int64_t n0, int nr) {
    const int64_t k = jb->k, ldx = jb->ldx;
    float part[MR][NR];
    int64_t m0 = 0;
    for (; m0 + MR <= jb->m; m0 += MR) {
        if (dtype == SKINNY_F32)
            block_f32((const float *)jb->x + m0 * ldx, ldx, (const float *)jb->w + n0 * k, k, MR, nr, part);
        else
            block_bf16((const uint16_t *)jb->x + m0 * ldx, ldx, (const uint16_t *)jb->w + n0 * k, k, MR, nr, part);
        store(jb, dtype, m0, MR, n0, nr, part);
    }
    if (rem) {
        if (dtype == SKINNY_F32)
            block_f32((const float *)jb->x + m0 * ldx, ldx, (const float *)jb->w + n0 * k, k, rem, nr, part);
        else
            block_bf16((const uint16_t *)jb->x + m0 * ldx, ldx, (const uint16_t *)jb->w + n0 * k, k, rem, nr, part);
        store(jb, dtype, m0, rem, n0, nr, part);
    }
}

/* Columns n0 .. n1 of y: NR rows of w at a time, the last few one by one. One function per dtype and
 * remainder, so that every block inside has constant sizes and its accumulators in registers, and a
 * tile costs no call. */
INLINE void column_range(const struct job *jb, int dtype, int rem, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) columns(jb, dtype, rem, n, NR);
    for (; n < n1; n++) columns(jb, dtype, rem, n, 1);
}

/* Inside a parallel region: the first of `tiles` tiles of this thread's share (next = 0), or of the next
 * thread's (next = 1). Each thread takes one contiguous share, so it streams its own part of W once. */
INLINE int64_t share_start(int64_t tiles, int next) {
    return tiles * (omp_get_thread_num() + next) / omp_get_num_threads();
}

/* fp32 with LANE_MIN_ROWS to 16 rows of x: the rows as the 16 lanes of a vector. Past 8 fp32 rows the
 * tiles above turn compute-bound on their horizontal sums, and oneDNN's GEMM is little better. Here x
 * is transposed once per call into xt [k][16] (zero lanes past m), and LR rows of W at a time meet it:
 * acc[j] (column n0 + j of all 16 rows) += W[n0 + j][kk] * xt[kk], kk in order. No horizontal sums
 * (from 12 rows it beats oneDNN: cpu.SKINNY_ROWS), and each value of y is one fp32 sum over K
 * in order, whatever the number of rows, so a sequence's result still does not depend on its batch. */
#define LR 16 /* rows of W per tile of the lane kernel */
#define LANE_MIN_ROWS 9

/* Columns n0 .. n0 + nr of y (nr is LR or 1 where inlined) into tile[j][0..16), the next tile's rows
 * prefetched along the way: at step kk, row kk % 16's line of the 16 values of K this step is in. */
INLINE void lane_tile(const float *xt, const float *w, int64_t k, int nr, float tile[LR][16]) {
    __m512 acc[LR];
    _Pragma("GCC unroll 16") for (int j = 0; j < nr; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        _mm_prefetch((const char *)(w + (nr + (kk & 15)) * k + (kk & ~(int64_t)15)), _MM_HINT_T0);
        const __m512 xv = _mm512_load_ps(xt + kk * 16);
        _Pragma("GCC unroll 16") for (int j = 0; j < nr; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[j * k + kk]), xv, acc[j]);
    }
    _Pragma("GCC unroll 16") for (int j = 0; j < nr; j++) _mm512_storeu_ps(tile[j], acc[j]);
}

static int lanes_f32(const struct job *jb, int64_t n, int threads) {
    const int64_t k = jb->k, m = jb->m;
    float *xt = aligned_alloc(64, (size_t)k * 16 * sizeof(float));
    if (!xt) return -3;
    for (int64_t kk = 0; kk < k; kk++)
        for (int64_t i = 0; i < 16; i++) xt[kk * 16 + i] = i < m ? ((const float *)jb->x)[i * jb->ldx + kk] : 0.0f;
    const int64_t tiles = (n + LR - 1) / LR;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t0 = share_start(tiles, 0), t1 = share_start(tiles, 1);
        float tile[LR][16];
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n0 = t * LR, nr = n - n0 < LR ? n - n0 : LR;
            const float *w = (const float *)jb->w + n0 * k;
            if (nr == LR) lane_tile(xt, w, k, LR, tile);
            else for (int64_t j = 0; j < nr; j++) lane_tile(xt, w + j * k, k, 1, tile + j);
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < nr; j++)
                    ((float *)jb->y)[i * jb->ldy + n0 + j] = tile[j][i] + (jb->bias ? ((const float *)jb->bias)[n0 + j] : 0.0f);
        }
    }
    free(xt);
    return 0;
}

typedef void (*range_fn)(const struct job *jb, int64_t n0, int64_t n1);
#define RANGE(name, dtype, rem) \
    static void name(const struct job *jb, int64_t n0, int64_t n1) { column_range(jb, dtype, rem, n0, n1); }
RANGE(range_f32_0, SKINNY_F32, 0)
RANGE(range_f32_1, SKINNY_F32, 1)
RANGE(range_f32_2, SKINNY_F32, 2)
RANGE(range_f32_3, SKINNY_F32, 3)
RANGE(range_bf16_0, SKINNY_BF16, 0)
RANGE(range_bf16_1, SKINNY_BF16, 1)
RANGE(range_bf16_2, SKINNY_BF16, 2)
RANGE(range_bf16_3, SKINNY_BF16, 3)
static const range_fn ranges[2][MR] = {{range_f32_0, range_f32_1, range_f32_2, range_f32_3},
                                       {range_bf16_0, range_bf16_1, range_bf16_2, range_bf16_3}};

/* x: [m, k] (row stride ldx), w: [n, k] contiguous, bias: [n] or NULL, y: [m, n] (row stride ldy). */
int skinny_linear(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int64_t ldx, int64_t ldy, int dtype, int num_threads) {
    if ((dtype != SKINNY_F32 && dtype != SKINNY_BF16) || m < 1 || n < 1 || k < 1) return -1;
    const struct job jb = {x, w, bias, y, m, k, ldx, ldy};
    const range_fn fn = ranges[dtype][m % MR];
    const int64_t tiles = (n + NR - 1) / NR;
    const int threads = n * k < 32768 || tiles < 2 ? 1 : num_threads; /* a tiny weight is not worth a thread */
    if (dtype == SKINNY_F32 && m >= LANE_MIN_ROWS && m <= 16) return lanes_f32(&jb, n, threads);
#pragma omp parallel num_threads(threads)
    {
        /* each thread streams one contiguous share of w, whole tiles */
        const int64_t t0 = share_start(tiles, 0), t1 = share_start(tiles, 1);
        const int64_t n1 = t1 * NR < n ? t1 * NR : n;
        if (t0 * NR < n1) fn(&jb, t0 * NR, n1);
    }
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "skinny_avx2.h"
#else

int skinny_linear(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int64_t ldx, int64_t ldy, int dtype, int num_threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy, (void)dtype;
    (void)num_threads;
    return -1;
}

#endif
