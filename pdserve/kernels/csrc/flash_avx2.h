/* flash_prefill.c's fp32 register tiles and online softmax for CPUs with AVX2 and FMA but no AVX-512
 * (AMD Zen 1-3, most cloud VMs and laptops). Included by flash_prefill.c, beside its AVX-512 forms.
 *
 * An AVX2 core has 16 vector registers of 8 floats. The generic tiles (MR rows x 64 keys in 64-byte
 * vectors) need 24 accumulators of 16 lanes there, 48 ymm, which spill to the stack on every FMA.
 * Here a tile is MR rows in two groups of HR = 3, and 32 keys (or 32 dimensions of V) at a time:
 * 12 accumulators, the K or V row of each step read by the FMA from L1, and one broadcast register.
 * The softmax is the AVX-512 one with 8-lane vectors: masks by comparing key indices, e^x by the same
 * reduction and series, 2^n built in the exponent bits (no scalef), zero below e^-87 (fp32's smallest
 * normal is e^-87.3). */
#ifndef PDSERVE_FLASH_AVX2_H
#define PDSERVE_FLASH_AVX2_H

#include <immintrin.h>

enum { HR = 3, V8 = 8 };

/* s[r][0, BK) = qb[r] . K[kb + j] for the MR rows of qb (row stride d); kt as qk_tile's. */
static inline void qk_tile(const float *qb, int64_t d, const float *kt, int64_t ld, float *s) {
    for (int r0 = 0; r0 < MR; r0 += HR)
        for (int half = 0; half < BK; half += 4 * V8) {
            __m256 acc[HR][4];
            for (int r = 0; r < HR; r++)
                for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
            for (int64_t x = 0; x < d; x++) {
                const float *k = kt + x * ld + half;
                for (int r = 0; r < HR; r++) {
                    const __m256 b = _mm256_broadcast_ss(qb + (r0 + r) * d + x);
                    for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(k + j * V8), acc[r][j]);
                }
            }
            for (int r = 0; r < HR; r++)
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(s + (r0 + r) * BK + half + j * V8, acc[r][j]);
        }
}

/* o[r][0, nv * V8) += sum over the first kn keys of p[r][k] * v[k][...], for HR rows from r0. */
static inline __attribute__((always_inline)) void pv_tile8(const float *p, int64_t kn, const float *v, int64_t d,
                                                          float *o, const int nv) {
    __m256 acc[HR][4];
    for (int r = 0; r < HR; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = _mm256_loadu_ps(o + r * d + j * V8);
    for (int64_t k = 0; k < kn; k++) {
        const float *vk = v + k * d;
        for (int r = 0; r < HR; r++) {
            const __m256 b = _mm256_broadcast_ss(p + r * BK + k);
            for (int j = 0; j < nv; j++) acc[r][j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(vk + j * V8), acc[r][j]);
        }
    }
    for (int r = 0; r < HR; r++)
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(o + r * d + j * V8, acc[r][j]);
}

/* pv_rows: MR rows, d a multiple of 16 (so a last slice of 16 dimensions, two vectors, at most). */
static void pv_rows(const float *p, int64_t kn, const float *v, int64_t d, float *o) {
    for (int r0 = 0; r0 < MR; r0 += HR) {
        const float *pr = p + r0 * BK;
        float *orow = o + r0 * d;
        int64_t dv = 0;
        for (; dv + 4 * V8 <= d; dv += 4 * V8) pv_tile8(pr, kn, v + dv, d, orow + dv, 4);
        if (dv < d) pv_tile8(pr, kn, v + dv, d, orow + dv, 2);
    }
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* e^x for x <= LAZY_MAX, as exp_bounded in flash_prefill.c; 0 for x < -87. */
static inline __m256 exp_bounded8(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 e = _mm256_set1_ps(1.0f / 720);
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 120));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 24));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 6));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    /* 2^n for n in [-126, 12]: the biased exponent n + 127 in bits 23..30 */
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(e, _mm256_castsi256_ps(pow2)), tiny);
}

/* softmax_step of flash_prefill.c (the same contract) on 8-lane vectors; l holds LANES = 2 x 8 partial
 * sums, block lanes j * 8 .. j * 8 + 7 going to l[(j % 2) * 8 ..]. p (bf16 probabilities) is only asked
 * for in FLASH_BF16_PAIRS, which an AVX2 build never runs. */
static void softmax_step(float *s, int64_t from, int64_t vis, float scale, float *m, float *l, float *o, int64_t d,
                         uint16_t *p) {
    (void)p;
    __m256 x[BK / V8], keep[BK / V8];
    __m256 vmax = _mm256_set1_ps(-FLT_MAX);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_set1_epi32((int)from - 1), hi = _mm256_set1_epi32((int)vis);
    for (int j = 0; j < BK / V8; j++) {
        const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(j * V8));
        keep[j] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, lo), _mm256_cmpgt_epi32(hi, idx)));
        x[j] = _mm256_mul_ps(_mm256_loadu_ps(s + j * V8), _mm256_set1_ps(scale));
        vmax = _mm256_blendv_ps(vmax, _mm256_max_ps(vmax, x[j]), keep[j]);
    }
    float mx = *m, corr = 1.0f;
    if (mx == -FLT_MAX) {
        mx = hmax8(vmax);  /* the first block this row sees */
        corr = 0.0f;
    } else if (_mm256_movemask_ps(_mm256_cmp_ps(vmax, _mm256_set1_ps(mx + LAZY_MAX), _CMP_GT_OQ))) {
        mx = hmax8(vmax);
        corr = expf(*m - mx);
    }
    const __m256 c = _mm256_set1_ps(corr), vm = _mm256_set1_ps(mx);
    __m256 sum0 = _mm256_mul_ps(_mm256_loadu_ps(l), c), sum1 = _mm256_mul_ps(_mm256_loadu_ps(l + V8), c);
    for (int j = 0; j < BK / V8; j += 2) {
        const __m256 e0 = _mm256_and_ps(exp_bounded8(_mm256_sub_ps(x[j], vm)), keep[j]);
        const __m256 e1 = _mm256_and_ps(exp_bounded8(_mm256_sub_ps(x[j + 1], vm)), keep[j + 1]);
        sum0 = _mm256_add_ps(sum0, e0);
        sum1 = _mm256_add_ps(sum1, e1);
        _mm256_storeu_ps(s + j * V8, e0);
        _mm256_storeu_ps(s + (j + 1) * V8, e1);
    }
    _mm256_storeu_ps(l, sum0);
    _mm256_storeu_ps(l + V8, sum1);
    *m = mx;
    if (corr != 1.0f)
        for (int64_t x0 = 0; x0 < d; x0++) o[x0] *= corr;
}

#endif
