/* One layer of a rank's KV pool, as the kernels address it (attention.PagedKVCache's layout):
 *     row(block, kv, head, token) = block * block_stride + layer_offset + kv * kv_stride
 *                                   + head * head_stride + token * token_stride
 * in elements of the pool's dtype, with head_dim contiguous; kv is 0 for K, 1 for V. HND and NHD
 * differ only in head_stride and token_stride. Mirrored by cpu._PoolView.
 *
 * An FP8 pool (fp8.h) also carries its layer's static scales: a value x is stored as e4m3(x / scale),
 * and read through `dequant`, [2 compute dtypes (fp32, bf16)][2 (K, V)][256] floats, what each byte
 * reads back as in that dtype. NULL and 1 for other pools. */
#ifndef PDSERVE_POOL_H
#define PDSERVE_POOL_H

#include <stdint.h>

typedef struct {
    void *base;
    int64_t layer_offset, block_stride, kv_stride, head_stride, token_stride;
    int64_t num_blocks, kv_heads, tokens_per_block, head_dim;
    const float *dequant;
    float k_scale, v_scale;
} pool_view;

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_FP8 = 3 }; /* a pool's dtype, as cpu._KV_DTYPES */

/* The 256-entry table of part `kv` (0 K, 1 V) for compute dtype `io` (0 fp32, 1 bf16). */
static inline const float *pool_dequant(const pool_view *p, int64_t io, int64_t kv) {
    return p->dequant + (io * 2 + kv) * 256;
}

#endif
