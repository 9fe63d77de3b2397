/* One layer of a rank's KV pool, as the kernels address it (attention.PagedKVCache's layout):
 *     row(block, kv, head, token) = block * block_stride + layer_offset + kv * kv_stride
 *                                   + head * head_stride + token * token_stride
 * in elements of the pool's dtype, with head_dim contiguous; kv is 0 for K, 1 for V. HND and NHD
 * differ only in head_stride and token_stride. Mirrored by cpu_kernels._PoolView. */
#ifndef PDSERVE_POOL_H
#define PDSERVE_POOL_H

#include <stdint.h>

typedef struct {
    void *base;
    int64_t layer_offset, block_stride, kv_stride, head_stride, token_stride;
    int64_t num_blocks, kv_heads, tokens_per_block, head_dim;
} pool_view;

#endif
