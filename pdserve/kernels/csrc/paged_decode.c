/* Paged decode attention for the CPU: one query token per sequence, read straight from the KV pool.
 *
 * The PyTorch path gathers every sequence's blocks into a dense [b, kv_heads, len, d] copy and then
 * runs SDPA over it, so the KV crosses memory three times per layer. Here each task (a sequence, or a
 * sequence and one KV head when there are few sequences) walks its block table and reads every K and
 * V row once, with an online softmax per block of tokens (running max and sum, rescaled when the max
 * grows), so no score row longer than one block is ever stored; the next block is prefetched row by
 * row while one is computed, since scattered blocks defeat the hardware prefetcher.
 *
 * Addressing is the pool's affine formula (pool.h).
 *
 * Query heads [h * group, (h + 1) * group) share KV head h. q is [b, heads, d] with heads and d
 * contiguous and sequences q_seq_stride elements apart (a view into the step's q/k buffer), out is
 * contiguous [b, heads, d]; both fp32 or both bf16 (io_dtype), the arithmetic fp32. An FP8 pool's rows
 * are widened through its dequantisation tables (fp8.h): the values the PyTorch path reads. Compiled
 * with -ffast-math so that the dot products vectorise (reassociated sums) and expf vectorises through
 * glibc's libmvec. With a sliding window (window > 0) a sequence reads only
 * its last `window` keys, starting mid-block where the window does.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"
#include "kernels.h"
#include "pool.h"

#define MAX_TOKENS_PER_BLOCK 256
#define MAX_HEAD_DIM 512

/* A pointer to one K or V row as fp32: the pool itself for fp32, else `buf` after conversion (FP8: by its
 * `scale`, rounded to bf16 for bf16 queries, as the part's dequantisation `table` holds it, pool.h). */
static inline __attribute__((always_inline)) const float *row_as_float(const char *pool, int64_t elem, int dtype,
                                                                       float *buf, int64_t d, const float *table,
                                                                       float scale, int io_dtype) {
    if (dtype == KV_F32) return (const float *)pool + elem;
    if (dtype == KV_FP8) {
        const uint8_t *src = (const uint8_t *)pool + elem;
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) fp8_e4m3_in16(src + i, buf + i, scale, io_dtype == IO_BF16);
        for (; i < d; i++) buf[i] = table[src[i]];
    } else if (dtype == KV_BF16) {
        const uint16_t *src = (const uint16_t *)pool + elem;
        for (int64_t i = 0; i < d; i++) buf[i] = bf16_in(src[i]);
    } else {
        const _Float16 *src = (const _Float16 *)pool + elem;
        for (int64_t i = 0; i < d; i++) buf[i] = (float)src[i];
    }
    return buf;
}

static inline int64_t elem_bytes(int dtype) { return dtype == KV_F32 ? 4 : dtype == KV_FP8 ? 1 : 2; }

/* Prefetch one K or V row (`d` elements of `elem` bytes at element `row`). */
static inline __attribute__((always_inline)) void prefetch_row(const char *pool, int64_t row, int64_t elem, int64_t d) {
    for (int64_t byte = 0; byte < d * elem; byte += 64) __builtin_prefetch(pool + row * elem + byte);
}

/* One task: sequence `seq`, KV heads [h0, h1) and the query heads that share them. Inlined into one
 * function per (dtype, head_dim) below, so that the loops over head_dim have a constant trip count
 * and vectorise without a remainder. Within a block it reads every K row of its heads, then every V
 * row, which for both layouts walks the block's memory forward. */
static inline __attribute__((always_inline)) void decode_task(const decode_args *a, int64_t seq, int64_t h0,
                                                              int64_t h1, const int dtype, const int64_t d) {
    const int64_t T = a->cache.tokens_per_block, group = a->heads / a->cache.kv_heads, ctx = a->context_lens[seq];
    const int64_t nq = (h1 - h0) * group; /* query heads of this task */
    const int64_t q_at = seq * a->q_seq_stride + h0 * group * d, out_at = (seq * a->heads + h0 * group) * d;
    float q[nq * d], acc[nq * d], scores[nq * T], running_max[nq], running_sum[nq], row[d];
    for (int64_t i = 0; i < nq * d; i++)
        q[i] = a->io_dtype == IO_F32 ? ((const float *)a->q)[q_at + i] : bf16_in(((const uint16_t *)a->q)[q_at + i]);
    for (int64_t r = 0; r < nq; r++) {
        running_max[r] = -FLT_MAX;
        running_sum[r] = 0.0f;
    }
    memset(acc, 0, sizeof(acc));
    const char *pool = (const char *)a->cache.base;
    const float *k_table = dtype == KV_FP8 ? pool_dequant(&a->cache, a->io_dtype, 0) : NULL;
    const float *v_table = dtype == KV_FP8 ? pool_dequant(&a->cache, a->io_dtype, 1) : NULL;
    const int64_t *table = a->block_table + seq * a->max_blocks;
    /* A sliding window starts the walk at the block of key ctx - window, and within it at that key. */
    const int64_t first = a->window > 0 && ctx > a->window ? ctx - a->window : 0;
    for (int64_t start = first / T * T, j = first / T; start < ctx; start += T, j++) {
        const int64_t n = ctx - start < T ? ctx - start : T, t0 = first > start ? first - start : 0;
        const int64_t base = table[j] * a->cache.block_stride + a->cache.layer_offset;
        /* Blocks sit anywhere in the pool, where the hardware prefetcher cannot follow: each K or V row
         * read here asks for the same row of the next block, so those loads overlap this block's
         * arithmetic (asking for the whole next block at once stalls on the core's miss buffers). */
        const int64_t next = start + T < ctx ? table[j + 1] * a->cache.block_stride + a->cache.layer_offset : -1;
        for (int64_t h = h0; h < h1; h++)
            for (int64_t t = t0; t < n; t++) {
                const int64_t offset = h * a->cache.head_stride + t * a->cache.token_stride;
                if (next >= 0) prefetch_row(pool, next + offset, elem_bytes(dtype), d);
                const float *k = row_as_float(pool, base + offset, dtype, row, d, k_table, a->cache.k_scale, a->io_dtype);
                for (int64_t r = (h - h0) * group; r < (h - h0 + 1) * group; r++) {
                    float s = 0.0f;
                    for (int64_t i = 0; i < d; i++) s += q[r * d + i] * k[i];
                    scores[r * T + t] = s * a->scale;
                }
            }
        for (int64_t r = 0; r < nq; r++) {
            float *sc = scores + r * T, m = running_max[r];
            for (int64_t t = t0; t < n; t++) m = sc[t] > m ? sc[t] : m;
            const float rescale = expf(running_max[r] - m);
            float sum = 0.0f;
            for (int64_t t = t0; t < n; t++) {
                sc[t] = expf(sc[t] - m);
                sum += sc[t];
            }
            running_sum[r] = running_sum[r] * rescale + sum;
            running_max[r] = m;
            if (rescale != 1.0f)
                for (int64_t i = 0; i < d; i++) acc[r * d + i] *= rescale;
        }
        for (int64_t h = h0; h < h1; h++)
            for (int64_t t = t0; t < n; t++) {
                const int64_t offset = a->cache.kv_stride + h * a->cache.head_stride + t * a->cache.token_stride;
                if (next >= 0) prefetch_row(pool, next + offset, elem_bytes(dtype), d);
                const float *v = row_as_float(pool, base + offset, dtype, row, d, v_table, a->cache.v_scale, a->io_dtype);
                for (int64_t r = (h - h0) * group; r < (h - h0 + 1) * group; r++) {
                    const float p = scores[r * T + t];
                    for (int64_t i = 0; i < d; i++) acc[r * d + i] += p * v[i];
                }
            }
    }
    for (int64_t r = 0; r < nq; r++) {
        const float inv = 1.0f / running_sum[r];
        for (int64_t i = 0; i < d; i++) {
            const float o = acc[r * d + i] * inv;
            if (a->io_dtype == IO_F32)
                ((float *)a->out)[out_at + r * d + i] = o;
            else
                ((uint16_t *)a->out)[out_at + r * d + i] = bf16_out(o);
        }
    }
}

typedef void (*task_fn)(const decode_args *, int64_t, int64_t, int64_t);

#define DEFINE_TASKS(NAME, DTYPE)                                                                        \
    static void NAME##_d64(const decode_args *a, int64_t s, int64_t h0, int64_t h1) {                   \
        decode_task(a, s, h0, h1, DTYPE, 64);                                                            \
    }                                                                                                    \
    static void NAME##_d128(const decode_args *a, int64_t s, int64_t h0, int64_t h1) {                  \
        decode_task(a, s, h0, h1, DTYPE, 128);                                                           \
    }                                                                                                    \
    static void NAME##_any(const decode_args *a, int64_t s, int64_t h0, int64_t h1) {                   \
        decode_task(a, s, h0, h1, DTYPE, a->cache.head_dim);                                                   \
    }

DEFINE_TASKS(f32, KV_F32)
DEFINE_TASKS(bf16, KV_BF16)
DEFINE_TASKS(f16, KV_F16)
DEFINE_TASKS(fp8, KV_FP8)

static task_fn pick_task(int dtype, int64_t d) {
    static const task_fn table[4][3] = {{f32_d64, f32_d128, f32_any},
                                        {bf16_d64, bf16_d128, bf16_any},
                                        {f16_d64, f16_d128, f16_any},
                                        {fp8_d64, fp8_d128, fp8_any}};
    return table[dtype][d == 64 ? 0 : d == 128 ? 1 : 2];
}

/* kv_dtype: KV_F32, KV_BF16, KV_F16 or KV_FP8 (pool.h). Returns 0; -1 for a shape or dtype the kernel
 * does not take (an FP8 pool without its tables among them); -2
 * for a context length or block id outside the table or the pool. */
int paged_decode_attention(const decode_args *a, int kv_dtype, int num_threads) {
    if (a->cache.tokens_per_block > MAX_TOKENS_PER_BLOCK || a->cache.head_dim > MAX_HEAD_DIM || a->cache.kv_heads <= 0 ||
        a->heads % a->cache.kv_heads != 0 || kv_dtype < KV_F32 || kv_dtype > KV_FP8 || a->io_dtype < IO_F32 ||
        a->io_dtype > IO_BF16 || (kv_dtype == KV_FP8 && !a->cache.dequant))
        return -1;
    /* A bad block id or length would read outside the pool: refuse the call instead. */
    for (int64_t seq = 0; seq < a->batch; seq++) {
        const int64_t ctx = a->context_lens[seq], used = (ctx + a->cache.tokens_per_block - 1) / a->cache.tokens_per_block;
        if (ctx < 1 || used > a->max_blocks) return -2;
        for (int64_t j = 0; j < used; j++) {
            const int64_t block = a->block_table[seq * a->max_blocks + j];
            if (block < 0 || block >= a->cache.num_blocks) return -2;
        }
    }
    const task_fn task = pick_task(kv_dtype, a->cache.head_dim);
    /* A task covers all KV heads of a sequence (one forward walk through each block) when there are
     * enough sequences to keep every thread busy, else one KV head. */
    const int64_t heads_per_task = a->batch >= 4 * (int64_t)num_threads ? a->cache.kv_heads : 1;
    const int64_t per_seq = a->cache.kv_heads / heads_per_task, tasks = a->batch * per_seq;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < tasks; i++) {
        const int64_t h0 = (i % per_seq) * heads_per_task;
        task(a, i / per_seq, h0, h0 + heads_per_task);
    }
    return 0;
}
