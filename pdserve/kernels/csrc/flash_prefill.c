/* Causal attention of one sequence's prefill chunk in one pass, flash-attention style.
 *
 * The tiled prefill attention in PyTorch (attention._tiled_causal_attention) writes each tile's
 * [queries x keys] scores to memory, reads them back for the softmax, writes the probabilities and
 * reads them again for P @ V: at 2048 tokens that traffic, and GEMMs whose inner dimension is only
 * head_dim, made attention half of a prefill. Here a work item is one KV head and a block of query
 * positions (with the query heads of that KV head's group folded into rows); it walks the keys in
 * blocks of BK, keeps the scores of one block in L1, and carries a running maximum and sum per row
 * (the online softmax), so nothing of size queries x keys is ever stored. Blocks wholly above the
 * causal diagonal are never visited.
 *
 * K and V are first packed (in parallel, once per call) into the layout the register tiles read,
 * padded with zeros to ld keys, a multiple of BK; each block of BK keys is one contiguous run, so the
 * tiles of a block read it from L1 (K packed [d, ld], its rows ld apart, mapped a block's rows onto a
 * few L1 sets: 3% slower at 2048 tokens, in two runs one after the other). Two forms of the products:
 * - fp32 (FLASH_F32, and FLASH_BF16 where the CPU lacks AVX512-BF16): q is widened when a work item
 *   starts; K is packed transposed, [kv_heads, ld / BK, d, BK] fp32, and V as [kv_heads, ld, d] fp32.
 *   The register tiles use GCC vector extensions, so the compiler emits AVX-512 here and narrower
 *   vectors elsewhere, but for AVX2 + FMA without AVX-512: flash_avx2.h's tiles, sized to its registers.
 * - bf16 (FLASH_BF16_PAIRS, only where flash_prefill_bf16_pairs() says the build has AVX512-BF16):
 *   both products take bf16 pairs with fp32 accumulation (vdpbf16ps), twice the fp32 rate. K is
 *   packed as [kv_heads, ld / BK, d / 2, BK, 2] (for each pair of dimensions, each key's two values)
 *   and V as [kv_heads, ld / 2, d, 2] (for each pair of keys, each dimension's two values). The
 *   probabilities are rounded to bf16 for P @ V, as PyTorch's bf16 flash attention rounds them; their
 *   sum is not.
 * Scores, the softmax and the accumulators are fp32 in both. A row's running sum is kept in LANES
 * partial sums, added up at the end, and its running maximum is tested against a block's lanes
 * without a horizontal reduction unless it moves: the softmax then costs a block's exps and little
 * else.
 *
 * q: [n, heads, d] fp32 or bf16, query i's heads at i * q_seq_stride (elements), each head's d values
 *    contiguous and the heads one after another; query i sits at position ctx - n + i and sees keys
 *    0 .. ctx - n + i.
 * k, v: in q's dtype, key t of KV head h at h * head_stride + t * token_stride (elements), each key's
 *    d values contiguous; or, with `dequant` given, float8_e4m3fn bytes (an FP8 KV cache, fp8.h) read
 *    through dequant[0][256] (K) and dequant[1][256] (V), what each byte stands for in q's dtype: the
 *    packing widens them, and the tiles run as for q's dtype.
 * out: [n, heads, d] in q's dtype (bf16 rounded to nearest even), contiguous.
 * window: with a sliding window, query P sees keys P - window + 1 .. P only: key blocks wholly before
 *    a work item's window are not visited, and the keys of a block a row may not see are masked like
 *    those past its diagonal.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"

/* Without AVX-512 these 64-byte vectors are passed in memory; they never cross a call that is not inlined. */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float vf __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4), may_alias));

enum { FLASH_F32 = 0, FLASH_BF16 = 1, FLASH_BF16_PAIRS = 2 };
enum { LANES = 16, BK = 64, MR = 6, TARGET_ROWS = 96 };
/* The running max moves only when a block's max passes it by more than this (the rescale of a row's
 * accumulator is then rare): probabilities stay below e^8, far from fp32's range. */
#define LAZY_MAX 8.0f

struct flash_args {
    const void *q, *k, *v;
    void *out;
    int64_t n, ctx, heads, kv_heads, head_dim, q_seq_stride;
    int64_t k_head_stride, k_token_stride, v_head_stride, v_token_stride;
    int64_t window; /* > 0: position P sees keys (P - window, P] only (a sliding window); 0: keys [0, P] */
    float scale;
    const float *dequant; /* NULL: k and v in q's dtype; else FP8 k and v, and their tables [2][256] */
};

/* K and V packed for the tiles (see the top of the file), ld keys per KV head. */
struct packed {
    void *k, *v;
    int64_t ld;
};

static inline vf vload(const float *p) { return *(const vf_u *)p; }
static inline void vstore(float *p, vf x) { *(vf_u *)p = x; }
static inline vf vbcast(float s) { return (vf){0} + s; }

#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
/* s[r][0, BK) = qb[r] . K[kb + j] for the MR rows of qb (row stride d); kt points at key block kb of
 * the transposed K (row stride ld, which is BK in a packed block). */
static inline void qk_tile(const float *qb, int64_t d, const float *kt, int64_t ld, float *s) {
    vf acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = (vf){0};
    for (int64_t x = 0; x < d; x++) {
        const float *k = kt + x * ld;
        const vf k0 = vload(k), k1 = vload(k + LANES), k2 = vload(k + 2 * LANES), k3 = vload(k + 3 * LANES);
        for (int r = 0; r < MR; r++) {
            const vf b = vbcast(qb[r * d + x]);
            acc[r][0] += b * k0;
            acc[r][1] += b * k1;
            acc[r][2] += b * k2;
            acc[r][3] += b * k3;
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) vstore(s + r * BK + j * LANES, acc[r][j]);
}

/* o[r][dv, dv + NV * LANES) += sum over the first kn keys of p[r][k] * v[k][...], for MR rows. */
static inline __attribute__((always_inline)) void pv_tile(const float *p, int64_t kn, const float *v, int64_t d,
                                                         float *o, const int nv) {
    vf acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = vload(o + r * d + j * LANES);
    for (int64_t k = 0; k < kn; k++) {
        vf vk[4];
        for (int j = 0; j < nv; j++) vk[j] = vload(v + k * d + j * LANES);
        for (int r = 0; r < MR; r++) {
            const vf b = vbcast(p[r * BK + k]);
            for (int j = 0; j < nv; j++) acc[r][j] += b * vk[j];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < nv; j++) vstore(o + r * d + j * LANES, acc[r][j]);
}

static void pv_rows(const float *p, int64_t kn, const float *v, int64_t d, float *o) {
    int64_t dv = 0;
    for (; dv + 4 * LANES <= d; dv += 4 * LANES) pv_tile(p, kn, v + dv, d, o + dv, 4);
    if (dv + 2 * LANES <= d) {
        pv_tile(p, kn, v + dv, d, o + dv, 2);
        dv += 2 * LANES;
    }
    if (dv < d) pv_tile(p, kn, v + dv, d, o + dv, 1);
}
#else
#define FLASH_AVX2 1  /* the fp32 tiles and the softmax sized for AVX2's 16 registers of 8 floats */
#include "flash_avx2.h"
#endif

#ifdef __AVX512BF16__
static inline __m512bh pair_bcast(const uint16_t *p) {
    int32_t u;
    memcpy(&u, p, 4);
    return (__m512bh)_mm512_set1_epi32(u);
}

/* qk_tile on bf16 pairs: qb bf16 [MR][d]; kp points at key block kb of K packed as [d / 2][ld][2]
 * (ld is BK in a packed block). */
static inline void qk_tile_bf16(const uint16_t *qb, int64_t d, const uint16_t *kp, int64_t ld, float *s) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t x = 0; x < d / 2; x++) {
        const uint16_t *k = kp + x * ld * 2;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k), k1 = (__m512bh)_mm512_loadu_si512(k + 2 * LANES),
                       k2 = (__m512bh)_mm512_loadu_si512(k + 4 * LANES),
                       k3 = (__m512bh)_mm512_loadu_si512(k + 6 * LANES);
        for (int r = 0; r < MR; r++) {
            const __m512bh b = pair_bcast(qb + r * d + 2 * x);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, k3);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(s + r * BK + j * LANES, acc[r][j]);
}

/* pv_tile on bf16 pairs: p bf16 [MR][BK]; vp points at dimension dv of key pair kb / 2 of V packed
 * as [ld / 2][d][2]; kn rounded up to a pair (the probability past kn is zero). */
static inline __attribute__((always_inline)) void pv_tile_bf16(const uint16_t *p, int64_t kn, const uint16_t *vp,
                                                              int64_t d, float *o, const int nv) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = _mm512_loadu_ps(o + r * d + j * LANES);
    for (int64_t k = 0; k < (kn + 1) / 2; k++) {
        __m512bh vk[4];
        for (int j = 0; j < nv; j++) vk[j] = (__m512bh)_mm512_loadu_si512(vp + (k * d + j * LANES) * 2);
        for (int r = 0; r < MR; r++) {
            const __m512bh b = pair_bcast(p + r * BK + 2 * k);
            for (int j = 0; j < nv; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, vk[j]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(o + r * d + j * LANES, acc[r][j]);
}

static void pv_rows_bf16(const uint16_t *p, int64_t kn, const uint16_t *vp, int64_t d, float *o) {
    int64_t dv = 0;
    for (; dv + 4 * LANES <= d; dv += 4 * LANES) pv_tile_bf16(p, kn, vp + 2 * dv, d, o + dv, 4);
    if (dv + 2 * LANES <= d) {
        pv_tile_bf16(p, kn, vp + 2 * dv, d, o + dv, 2);
        dv += 2 * LANES;
    }
    if (dv < d) pv_tile_bf16(p, kn, vp + 2 * dv, d, o + dv, 1);
}
#endif

/* 1 where this build multiplies bf16 pairs natively (FLASH_BF16_PAIRS), else 0. */
int flash_prefill_bf16_pairs(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* Per-thread scratch: rows of q (fp32, or bf16 in FLASH_BF16_PAIRS), scores, bf16 probabilities,
 * output accumulators, running max, and running sum (LANES partial sums a row). */
struct scratch {
    void *q;
    float *s, *o, *m, *l;
    uint16_t *p;
};

/* Copies the query rows of one work item into w->q (zero padding rows) and resets the running
 * softmax and the accumulators. */
static void load_rows(const struct flash_args *a, int mode, int64_t kvh, int64_t q0, int64_t real, int64_t rows,
                      const struct scratch *w) {
    const int64_t d = a->head_dim, group = a->heads / a->kv_heads;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = q0 + r / group, h = kvh * group + r % group, at = i * a->q_seq_stride + h * d;
        if (mode == FLASH_BF16_PAIRS) {
            uint16_t *qr = (uint16_t *)w->q + r * d;
            if (r < real) memcpy(qr, (const uint16_t *)a->q + at, d * sizeof(uint16_t));
            else memset(qr, 0, d * sizeof(uint16_t));  /* padding rows: computed, never written out */
        } else {
            float *qr = (float *)w->q + r * d;
            if (r >= real) memset(qr, 0, d * sizeof(float));
            else if (mode == FLASH_F32) memcpy(qr, (const float *)a->q + at, d * sizeof(float));
            else for (int64_t x = 0; x < d; x++) qr[x] = bf16_in(((const uint16_t *)a->q)[at + x]);
        }
        w->m[r] = -FLT_MAX;
        memset(w->l + r * LANES, 0, LANES * sizeof(float));
    }
    memset(w->o, 0, rows * d * sizeof(float));
}

#ifdef __AVX512F__
/* e^x for x <= LAZY_MAX, to a few ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is
 * exact to fp32), e^r by its Taylor series to r^6 (error < 1.3e-7 relative), times 2^n by scalef,
 * which flushes to zero below the smallest normal power. */
static inline __m512 exp_bounded(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  /* ln2 high part, 16 bits */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);       /* ln2 - high part */
    __m512 e = _mm512_set1_ps(1.0f / 720);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}

/* The first k of a vector's LANES lanes, as a mask (none for k <= 0, all for k >= LANES). */
static inline __mmask16 lanes_below(int64_t k) {
    return k >= LANES ? 0xffff : k <= 0 ? 0 : (__mmask16)((1u << k) - 1);
}

/* The online softmax of row r over one key block whose scores [from, vis) it may see: the
 * probabilities (relative to the running max m) replace the scores, and go to p as bf16 when p is not
 * NULL; zero outside [from, vis). The running sum l (LANES partial sums) moves on; when m moves, the
 * row's accumulator and sums are rescaled to it. Only then is the block's maximum reduced to one value:
 * whether any of its lanes passes m + LAZY_MAX is a mask test. */
static void softmax_step(float *s, int64_t from, int64_t vis, float scale, float *m, float *l, float *o, int64_t d,
                         uint16_t *p) {
    __m512 x[BK / LANES];
    __mmask16 keep[BK / LANES];
    __m512 vmax = _mm512_set1_ps(-FLT_MAX);
    for (int j = 0; j < BK / LANES; j++) {
        keep[j] = lanes_below(vis - j * LANES) & (__mmask16)~lanes_below(from - j * LANES);
        x[j] = _mm512_mul_ps(_mm512_loadu_ps(s + j * LANES), _mm512_set1_ps(scale));
        vmax = _mm512_mask_max_ps(vmax, keep[j], vmax, x[j]);
    }
    float mx = *m, corr = 1.0f;
    if (mx == -FLT_MAX) {
        mx = _mm512_reduce_max_ps(vmax);  /* the first block this row sees */
        corr = 0.0f;
    } else if (_mm512_cmp_ps_mask(vmax, _mm512_set1_ps(mx + LAZY_MAX), _CMP_GT_OQ)) {
        mx = _mm512_reduce_max_ps(vmax);  /* else lazy: probabilities up to e^LAZY_MAX are safe in fp32 */
        corr = expf(*m - mx);
    }
    __m512 vsum = _mm512_mul_ps(_mm512_loadu_ps(l), _mm512_set1_ps(corr));
    for (int j = 0; j < BK / LANES; j++) {
        const __m512 e = _mm512_maskz_mov_ps(keep[j], exp_bounded(_mm512_sub_ps(x[j], _mm512_set1_ps(mx))));
        vsum = _mm512_add_ps(vsum, e);
        _mm512_storeu_ps(s + j * LANES, e);
#ifdef __AVX512BF16__
        if (p) _mm256_storeu_si256((__m256i *)(p + j * LANES), (__m256i)_mm512_cvtneps_pbh(e));
#endif
    }
    _mm512_storeu_ps(l, vsum);
    *m = mx;
    if (corr != 1.0f)
        for (int64_t x0 = 0; x0 < d; x0++) o[x0] *= corr;
}
#elif !defined(FLASH_AVX2)
/* softmax_step above, in plain C. */
static void softmax_step(float *s, int64_t from, int64_t vis, float scale, float *m, float *l, float *o, int64_t d,
                         uint16_t *p) {
    float mx = -FLT_MAX;
    for (int64_t j = from; j < vis; j++) {
        s[j] *= scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    float corr = 1.0f;
    if (*m == -FLT_MAX) corr = 0.0f;
    else if (from >= vis || mx <= *m + LAZY_MAX) mx = *m;
    else corr = expf(*m - mx);
    float sum = 0.0f;
    for (int64_t j = from; j < vis; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    for (int64_t j = 0; j < BK; j++)
        if (j < from || j >= vis) s[j] = 0.0f;
    if (p)
        for (int64_t j = 0; j < BK; j++) p[j] = bf16_out(s[j]);
    l[0] = l[0] * corr + sum;  /* one of the LANES partial sums */
    *m = mx;
    if (corr != 1.0f)
        for (int64_t x = 0; x < d; x++) o[x] *= corr;
}
#endif

/* One KV head, query positions [q0, q1): rows (i - q0) * group + g for query head kvh * group + g. */
static void work_item(const struct flash_args *a, int mode, const struct packed *kv, int64_t kvh, int64_t q0,
                      int64_t q1, const struct scratch *w) {
    const int64_t d = a->head_dim, group = a->heads / a->kv_heads, past = a->ctx - a->n;
    const int64_t real = (q1 - q0) * group, rows = (real + MR - 1) / MR * MR;
    load_rows(a, mode, kvh, q0, real, rows, w);
    const int64_t head_elems = d * kv->ld;  /* K and V of one KV head, in elements of either form */
    const int64_t key_end = past + q1;  /* the last query of the item sees keys [0, key_end) */
    /* With a sliding window the item's first query sees keys from key_start on; later ones fewer. */
    const int64_t key_start = a->window > 0 && past + q0 + 1 > a->window ? past + q0 + 1 - a->window : 0;
    for (int64_t kb = key_start / BK * BK; kb < key_end; kb += BK) {
        const int64_t kn = key_end - kb < BK ? key_end - kb : BK;
        for (int64_t r = 0; r < rows; r += MR) {
#ifdef __AVX512BF16__
            if (mode == FLASH_BF16_PAIRS) {
                qk_tile_bf16((const uint16_t *)w->q + r * d, d, (const uint16_t *)kv->k + kvh * head_elems + kb * d,
                             BK, w->s + r * BK);
                continue;
            }
#endif
            qk_tile((const float *)w->q + r * d, d, (const float *)kv->k + kvh * head_elems + kb * d, BK, w->s + r * BK);
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t i = q0 + (r < real ? r : real - 1) / group;
            int64_t vis = past + i + 1 - kb;  /* keys of this block row r sees: [from, vis) */
            vis = vis < 0 ? 0 : vis > kn ? kn : vis;
            int64_t from = a->window > 0 ? past + i + 1 - a->window - kb : 0;
            from = from < 0 ? 0 : from > kn ? kn : from;
            softmax_step(w->s + r * BK, from, vis, a->scale, w->m + r, w->l + r * LANES, w->o + r * d, d,
                         mode == FLASH_BF16_PAIRS ? w->p + r * BK : NULL);
        }
        for (int64_t r = 0; r < rows; r += MR) {
#ifdef __AVX512BF16__
            if (mode == FLASH_BF16_PAIRS) {
                pv_rows_bf16(w->p + r * BK, kn, (const uint16_t *)kv->v + kvh * head_elems + kb * d, d, w->o + r * d);
                continue;
            }
#endif
            pv_rows(w->s + r * BK, kn, (const float *)kv->v + kvh * head_elems + kb * d, d, w->o + r * d);
        }
    }
    for (int64_t r = 0; r < real; r++) {
        const int64_t i = q0 + r / group, h = kvh * group + r % group, at = (i * a->heads + h) * d;
        float sum = 0.0f;
        for (int j = 0; j < LANES; j++) sum += w->l[r * LANES + j];
        const float inv = 1.0f / sum, *o = w->o + r * d;
        if (mode == FLASH_F32)
            for (int64_t x = 0; x < d; x++) ((float *)a->out)[at + x] = o[x] * inv;
        else
            for (int64_t x = 0; x < d; x++) ((uint16_t *)a->out)[at + x] = bf16_out(o[x] * inv);
    }
}

/* Element i of bf16 K or V, or of FP8 K or V through its table (whose values are bf16's: exact). */
static inline uint16_t bf16_at(const void *src, int64_t i, const float *table) {
    return table ? bf16_out(table[((const uint8_t *)src)[i]]) : ((const uint16_t *)src)[i];
}

/* Packs keys [t0, t0 + BK) of KV head h (zeros past ctx) into kv, in the form `mode` reads; the
 * block's reads and writes stay in L1. */
static void pack_block(const struct flash_args *a, int mode, const struct packed *kv, int64_t h, int64_t t0) {
    const int64_t d = a->head_dim, ld = kv->ld, base = h * d * ld;
    const int64_t kh = h * a->k_head_stride, vh = h * a->v_head_stride;
    const int64_t valid = a->ctx - t0 < BK ? (a->ctx - t0 > 0 ? a->ctx - t0 : 0) : BK;
    const float *kq = a->dequant, *vq = a->dequant ? a->dequant + 256 : NULL;
    if (mode == FLASH_BF16_PAIRS) {  /* K [ld / BK][d / 2][BK][2], V [ld / 2][d][2] */
        for (int64_t x = 0; x < d; x += 2) {
            uint16_t *k = (uint16_t *)kv->k + base + t0 * d + (x / 2) * BK * 2;
            for (int64_t t = 0; t < BK; t++) {
                k[2 * t] = t < valid ? bf16_at(a->k, kh + (t0 + t) * a->k_token_stride + x, kq) : 0;
                k[2 * t + 1] = t < valid ? bf16_at(a->k, kh + (t0 + t) * a->k_token_stride + x + 1, kq) : 0;
            }
        }
        for (int64_t t = 0; t < BK; t++) {
            uint16_t *v = (uint16_t *)kv->v + base + ((t0 + t) / 2) * d * 2 + t % 2;
            for (int64_t x = 0; x < d; x++)
                v[2 * x] = t < valid ? bf16_at(a->v, vh + (t0 + t) * a->v_token_stride + x, vq) : 0;
        }
    } else {  /* K [ld / BK][d][BK], V [ld][d], fp32; a token's row is read once, into K's column t */
        float *k = (float *)kv->k + base + t0 * d, *v = (float *)kv->v + base + t0 * d;
        if (valid < BK) {
            memset(k, 0, BK * d * sizeof(float));
            memset(v + valid * d, 0, (BK - valid) * d * sizeof(float));
        }
        for (int64_t t = 0; t < valid; t++) {
            const int64_t kt = kh + (t0 + t) * a->k_token_stride, vt = vh + (t0 + t) * a->v_token_stride;
            float *vr = v + t * d;
            if (a->dequant) {
                const uint8_t *ks = (const uint8_t *)a->k + kt, *vs = (const uint8_t *)a->v + vt;
                for (int64_t x = 0; x < d; x++) vr[x] = vq[vs[x]];
                for (int64_t x = 0; x < d; x++) k[x * BK + t] = kq[ks[x]];
            } else if (mode == FLASH_F32) {
                memcpy(vr, (const float *)a->v + vt, d * sizeof(float));
                for (int64_t x = 0; x < d; x++) k[x * BK + t] = ((const float *)a->k)[kt + x];
            } else {
                for (int64_t x = 0; x < d; x++) vr[x] = bf16_in(((const uint16_t *)a->v)[vt + x]);
                for (int64_t x = 0; x < d; x++) k[x * BK + t] = bf16_in(((const uint16_t *)a->k)[kt + x]);
            }
        }
    }
}

/* Returns 0; -1 for arguments the kernel does not take (head_dim not a multiple of 16, heads not a
 * multiple of kv_heads, a chunk longer than its context, FLASH_BF16_PAIRS in a build without
 * AVX512-BF16); -3 when out of memory. */
int flash_prefill(const struct flash_args *a, int mode, int num_threads) {
    if (a->n < 1 || a->ctx < a->n || a->kv_heads < 1 || a->heads % a->kv_heads || a->head_dim < LANES ||
        a->q_seq_stride < a->heads * a->head_dim ||
        a->head_dim % LANES || (mode != FLASH_F32 && mode != FLASH_BF16 && mode != FLASH_BF16_PAIRS) ||
        (mode == FLASH_BF16_PAIRS && !flash_prefill_bf16_pairs()))
        return -1;
    const int64_t group = a->heads / a->kv_heads, d = a->head_dim;
    const int64_t bq = group >= TARGET_ROWS ? 1 : TARGET_ROWS / group;  /* query positions per item */
    const int64_t blocks = (a->n + bq - 1) / bq, items = blocks * a->kv_heads;
    const int64_t max_rows = (bq * group + MR - 1) / MR * MR;
    const int64_t key_blocks = (a->ctx + BK - 1) / BK;
    const size_t kv_bytes = (size_t)a->kv_heads * key_blocks * BK * d * (mode == FLASH_BF16_PAIRS ? 2 : 4);
    struct packed kv = {malloc(kv_bytes), malloc(kv_bytes), key_blocks * BK};
    if (!kv.k || !kv.v) {
        free(kv.k);
        free(kv.v);
        return -3;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < a->kv_heads * key_blocks; t++) pack_block(a, mode, &kv, t / key_blocks, t % key_blocks * BK);
        /* q, o: max_rows x d floats; s: max_rows x BK; m: max_rows; l: max_rows x LANES; p: max_rows x BK
         * bf16. */
        float *buf = malloc((size_t)max_rows * (2 * d + BK + 1 + LANES + BK / 2) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        struct scratch w = {.q = buf};
        if (buf) {
            w.o = buf + max_rows * d;
            w.s = w.o + max_rows * d;
            w.m = w.s + max_rows * BK;
            w.l = w.m + max_rows;
            w.p = (uint16_t *)(w.l + max_rows * LANES);
        }
        /* The last query blocks see the most keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            if (!buf) continue;
            const int64_t qb = blocks - 1 - t / a->kv_heads, kvh = t % a->kv_heads;
            const int64_t q0 = qb * bq, q1 = q0 + bq < a->n ? q0 + bq : a->n;
            work_item(a, mode, &kv, kvh, q0, q1, &w);
        }
        free(buf);
    }
    free(kv.k);
    free(kv.v);
    return failed ? -3 : 0;
}
