/* A decode step of a few sequences (one token each) through a pipeline stage's layers in one call.
 *
 * With one sequence a decode step is ~120 small GEMVs and ~150 small kernels and PyTorch ops, and
 * the Python around them (module calls, views, wrappers) is a large share of a small model's step;
 * with a few sequences the kernels are the same and so is that cost. This function runs
 * the decoder block of every layer in C, calling the same kernels in the same order as the model's
 * PyTorch code does:
 *
 *     x = rms_norm(h); qkv = x Wqkv (+ b); q, k = rope(q, k), k and v into the pool;
 *     a = attention(q, pool); h = h + a Wo; x = rms_norm(h); h = h + (silu(g) * u) Wdown, [g u] = x Wgu
 *
 * so its result equals the module path's but for silu, whose exp here is glibc's where PyTorch's is
 * Sleef's: the two may differ in the last bit of an fp32 (tests/models/test_cpu_decode.py measures
 * how far that carries). Every product and sum is rounded to the model dtype where PyTorch rounds it.
 *
 * h_in, h_out: [rows, hidden] in the model dtype (fp32 or bf16); h_in is left as it is, so a caller may
 * still take another path after a failure. Returns 0; -1 where a kernel refused its inputs (nothing
 * is then half-done that the other path does not redo: it rewrites every pool slot written here);
 * -2 for a slot, block id or length outside the pool or table; -3 out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

enum { MODEL_F32 = 0, MODEL_BF16 = 1 };

/* What one layer reads: its plain weights and norms, and its layer of the KV pool. */
typedef struct {
    pool_view cache;
    const void *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *qkv_bias;         /* [(heads + 2 kv_heads) d, hidden], [(heads + 2 kv_heads) d] or NULL */
    const void *o;                      /* [hidden, heads d] */
    const void *gate_up;                /* [2 intermediate, hidden]: gate rows, then up rows */
    const void *down;                   /* [hidden, intermediate] */
    int64_t window;                     /* attention's sliding window, 0 for none (decode_args) */
} layer_args;

/* What every layer of the step shares. */
typedef struct {
    int64_t hidden, heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *signed_sin;             /* [rows, head_dim]: the rotary table's row for each position */
    const int64_t *slot_block, *slot_offset;   /* [rows]: where each new token's K and V go */
    const int64_t *block_table, *context_len;  /* [rows, max_blocks], [rows] */
    int64_t max_blocks;
    int64_t rows;                              /* sequences in the step, one token each */
} step_args;

/* act = silu(gate) * up, rounded as F.silu(gate).mul_(up) rounds: the silu to the dtype, then the product. */
static void silu_mul(const void *gu, void *act, int64_t n, int dtype) {
    if (dtype == MODEL_F32) {
        const float *g = gu, *u = (const float *)gu + n;
        for (int64_t i = 0; i < n; i++) ((float *)act)[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    } else {
        const uint16_t *g = gu, *u = (const uint16_t *)gu + n;
        for (int64_t i = 0; i < n; i++) {
            const float x = bf16_in(g[i]), s = bf16_in(bf16_out(x / (1.0f + expf(-x))));
            ((uint16_t *)act)[i] = bf16_out(s * bf16_in(u[i]));
        }
    }
}

/* out = a + b, rounded to the dtype. */
static void add(const void *a, const void *b, void *out, int64_t n, int dtype) {
    if (dtype == MODEL_F32)
        for (int64_t i = 0; i < n; i++) ((float *)out)[i] = ((const float *)a)[i] + ((const float *)b)[i];
    else
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)out)[i] = bf16_out(bf16_in(((const uint16_t *)a)[i]) + bf16_in(((const uint16_t *)b)[i]));
}

#define CHECK(call)                     \
    do {                                \
        const int status_ = (call);     \
        if (status_ != 0) {             \
            free(scratch);              \
            return status_;             \
        }                               \
    } while (0)

int decode_layers(const layer_args *layers, int64_t num_layers, const step_args *s, const void *h_in, void *h_out,
                  int dtype, int kv_dtype, int num_threads) {
    if ((dtype != MODEL_F32 && dtype != MODEL_BF16) || num_layers < 1 || s->rows < 1) return -1;
    const int64_t H = s->hidden, d = s->head_dim, kv = layers[0].cache.kv_heads, I = s->intermediate;
    const int64_t width = s->heads + 2 * kv, esize = dtype == MODEL_F32 ? 4 : 2, R = s->rows;
    /* per row: x, h2, o, down: [H]; qkv: [width d]; qk: [(heads + kv) d]; attn: [heads d]; gu: [2 I]; act: [I] */
    const int64_t sizes[] = {R * H, R * H, R * H, R * H, R * width * d, R * (s->heads + kv) * d, R * s->heads * d,
                             R * 2 * I, R * I};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += (sizes[i] * esize + 63) & ~(int64_t)63;
    char *scratch = aligned_alloc(64, (size_t)total);
    if (!scratch) return -3;
    char *buf[sizeof sizes / sizeof *sizes];
    for (size_t i = 0, at = 0; i < sizeof sizes / sizeof *sizes; i++) {
        buf[i] = scratch + at;
        at += (sizes[i] * esize + 63) & ~(int64_t)63;
    }
    char *x = buf[0], *h2 = buf[1], *o = buf[2], *down = buf[3], *qkv = buf[4], *qk = buf[5], *attn = buf[6];
    char *gu = buf[7], *act = buf[8];
    memcpy(h_out, h_in, (size_t)(R * H * esize)); /* h_out carries the residual stream from here on */
    for (int64_t l = 0; l < num_layers; l++) {
        const layer_args *L = layers + l;
        CHECK(rms_norm(h_out, NULL, NULL, L->input_norm, x, R, H, s->eps, dtype, num_threads));
        CHECK(skinny_linear(x, L->qkv, L->qkv_bias, qkv, R, width * d, H, H, width * d, dtype, num_threads));
        const rope_cache_args rope = {L->cache, qkv, R, s->heads, s->cos, s->signed_sin, s->slot_block,
                                      s->slot_offset, qk};
        CHECK(rope_cache_write(&rope, dtype, kv_dtype, num_threads));
        const decode_args att = {L->cache, s->block_table, s->max_blocks, s->context_len, R, s->heads, s->scale,
                                 qk, (s->heads + kv) * d, attn, dtype, L->window};
        CHECK(paged_decode_attention(&att, kv_dtype, num_threads));
        CHECK(skinny_linear(attn, L->o, NULL, o, R, H, s->heads * d, s->heads * d, H, dtype, num_threads));
        CHECK(rms_norm(o, h_out, h2, L->post_norm, x, R, H, s->eps, dtype, num_threads)); /* h2 = h + o */
        CHECK(skinny_linear(x, L->gate_up, NULL, gu, R, 2 * I, H, H, 2 * I, dtype, num_threads));
        for (int64_t r = 0; r < R; r++) silu_mul(gu + r * 2 * I * esize, act + r * I * esize, I, dtype);
        CHECK(skinny_linear(act, L->down, NULL, down, R, H, I, I, H, dtype, num_threads));
        add(h2, down, h_out, R * H, dtype);
    }
    free(scratch);
    return 0;
}
