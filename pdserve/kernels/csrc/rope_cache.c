/* The attention prologue of every step: RoPE on q and k, and the new K and V written into the pool.
 *
 * In PyTorch this is some fifteen ops per layer (split, flip or halves, casts, two products and a
 * sum, a stack, a cast to the cache dtype, an indexed store): at a decode step each costs more in
 * dispatch than in arithmetic, and at a prefill each is a pass over the tokens. Here one call reads
 * each token's fused qkv row once; tokens are split across threads when there are many.
 *
 * The results are bit-identical to the PyTorch path (layers.RotaryEmbedding.rotate, then
 * attention.PagedKVCache.write): x * cos and rotate_half(x) * sin are each rounded to fp32 and then
 * added (contraction into a fused multiply-add is switched off below), the sum is rounded to the
 * model's dtype, and K and V are then converted to the cache's dtype (an FP8 pool: divided by the
 * layer's scale, then rounded to e4m3 and saturated, as kv_quant.quantize: in quantize_row, compiled
 * without -ffast-math, so that the division stays one and is not a product by the reciprocal, which
 * rounds differently).
 *
 * qkv: [rows, heads + 2 * kv_heads, d] contiguous in the model dtype (fp32 or bf16); cos and
 * signed_sin: [rows, d] fp32 (the rotary table's rows, minus sign of rotate_half folded into the
 * first half of sin); qk_out: [rows, heads + kv_heads, d], the rotated q and k in the model dtype.
 * Token i goes to the pool (pool.h; fp32, bf16, fp16 or FP8) at block slot_blocks[i], token
 * slot_offsets[i].
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"
#include "kernels.h"
#include "pool.h"

#define MAX_HEAD_DIM 512
#define MIN_PARALLEL_ROWS 16 /* fewer tokens (a decode step) stay on the calling thread */

enum { F32 = 0, BF16 = 1 }; /* the model's dtype (KV_F32 and KV_BF16 too, so store_row takes either) */

/* One head's row of the model dtype as fp32. */
static inline void load_row(const void *base, int64_t elem, int dtype, float *dst, int64_t d) {
    if (dtype == F32)
        memcpy(dst, (const float *)base + elem, d * sizeof(float));
    else
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_in(((const uint16_t *)base)[elem + i]);
}

/* Rotate `x` into `out`, rounding the sum to the model dtype (kept as fp32). */
static inline void rotate(const float *x, const float *cos, const float *ssin, float *out, int64_t d, int dtype) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float a = x[i] * cos[i];
        const float b = x[i < half ? i + half : i - half] * ssin[i];
        const float s = a + b;
        out[i] = dtype == F32 ? s : bf16_in(bf16_out(s));
    }
}

/* dst[i] = e4m3(src[i] / scale), IEEE division (never inlined into the fast-math code around it). */
__attribute__((optimize("no-fast-math"), noinline)) static void quantize_row(uint8_t *dst, const float *src, int64_t d,
                                                                             float scale) {
    for (int64_t i = 0; i < d; i++) dst[i] = fp8_e4m3_out(src[i] / scale);
}

/* `d` fp32 values into `dst` at element `elem`, converted to `dtype` (a pool's KV_*; FP8 by `scale`). */
static inline void store_row(void *dst, int64_t elem, int dtype, const float *src, int64_t d, float scale) {
    if (dtype == KV_F32)
        memcpy((float *)dst + elem, src, d * sizeof(float));
    else if (dtype == KV_BF16)
        for (int64_t i = 0; i < d; i++) ((uint16_t *)dst)[elem + i] = bf16_out(src[i]);
    else if (dtype == KV_F16)
        for (int64_t i = 0; i < d; i++) ((_Float16 *)dst)[elem + i] = (_Float16)src[i];
    else
        quantize_row((uint8_t *)dst + elem, src, d, scale);
}

/* One token: q and k rotated into qk_out, k and v stored into the pool. */
static void token(const rope_cache_args *a, int64_t t, int model_dtype, int pool_dtype) {
    const int64_t d = a->cache.head_dim, width = a->heads + 2 * a->cache.kv_heads, rotated_heads = a->heads + a->cache.kv_heads;
    const float *cos = a->cos + t * d, *ssin = a->signed_sin + t * d;
    const int64_t slot = a->slot_blocks[t] * a->cache.block_stride + a->cache.layer_offset + a->slot_offsets[t] * a->cache.token_stride;
    float x[MAX_HEAD_DIM], rotated[MAX_HEAD_DIM];
    for (int64_t h = 0; h < width; h++) {
        load_row(a->qkv, (t * width + h) * d, model_dtype, x, d);
        if (h < rotated_heads) {
            rotate(x, cos, ssin, rotated, d, model_dtype);
            store_row(a->qk_out, (t * rotated_heads + h) * d, model_dtype, rotated, d, 1.0f);
            if (h >= a->heads)
                store_row(a->cache.base, slot + (h - a->heads) * a->cache.head_stride, pool_dtype, rotated, d,
                          a->cache.k_scale);
        } else {
            store_row(a->cache.base, slot + a->cache.kv_stride + (h - rotated_heads) * a->cache.head_stride, pool_dtype,
                      x, d, a->cache.v_scale);
        }
    }
}

/* Returns 0; -1 for a dtype or shape the kernel does not take; -2 for a slot outside the pool (then
 * nothing is written). */
int rope_cache_write(const rope_cache_args *a, int model_dtype, int pool_dtype, int num_threads) {
    if (a->cache.head_dim > MAX_HEAD_DIM || a->cache.head_dim % 2 || (model_dtype != F32 && model_dtype != BF16) ||
        pool_dtype < KV_F32 || pool_dtype > KV_FP8 ||
        (pool_dtype == KV_FP8 && !(a->cache.k_scale > 0.0f && a->cache.v_scale > 0.0f)))
        return -1;
    for (int64_t t = 0; t < a->rows; t++)
        if (a->slot_blocks[t] < 0 || a->slot_blocks[t] >= a->cache.num_blocks || a->slot_offsets[t] < 0 ||
            a->slot_offsets[t] >= a->cache.tokens_per_block)
            return -2;
    const int threads = a->rows < MIN_PARALLEL_ROWS ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < a->rows; t++) token(a, t, model_dtype, pool_dtype);
    return 0;
}
