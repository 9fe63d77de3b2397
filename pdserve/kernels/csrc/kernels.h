/* The argument structs and entry points of the kernels that decode_layers.c chains together.
 * The structs are mirrored by ctypes classes in kernels/cpu.py: field order and types must match. */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <stdint.h>

#include "pool.h"

/* paged_decode.c: one query per sequence against its paged K/V. */
typedef struct {
    pool_view cache;
    const int64_t *block_table; /* [b, max_blocks] */
    int64_t max_blocks;
    const int64_t *context_lens; /* [b] */
    int64_t batch, heads;
    float scale;
    const void *q;
    int64_t q_seq_stride;
    void *out;
    int64_t io_dtype; /* IO_F32 or IO_BF16, for q and out */
    int64_t window;   /* > 0: the query sees only the last `window` keys (a sliding window); 0: all */
} decode_args;

enum { IO_F32 = 0, IO_BF16 = 1 };

int paged_decode_attention(const decode_args *a, int kv_dtype, int num_threads);

/* rope_cache.c: RoPE on q and k, K and V into the pool. */
typedef struct {
    pool_view cache;
    const void *qkv;
    int64_t rows, heads;
    const float *cos, *signed_sin;
    const int64_t *slot_blocks, *slot_offsets;
    void *qk_out;
} rope_cache_args;

int rope_cache_write(const rope_cache_args *a, int model_dtype, int pool_dtype, int num_threads);

/* rms_norm.c */
int rms_norm(const void *x, const void *residual, void *h_out, const void *weight, void *out, int64_t rows,
             int64_t hidden, float eps, int dtype, int num_threads);

/* skinny_linear.c */
int skinny_linear(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int64_t ldx, int64_t ldy, int dtype, int num_threads);

#endif
