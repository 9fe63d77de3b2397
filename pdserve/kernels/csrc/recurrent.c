/* The recurrent mixers of the hybrid models, one call per layer and step: Gated DeltaNet (Qwen3.5) and
 * Mamba2 (Nemotron-H), each from its input projections to the gated norm before its output projection,
 * for any mix of sequences (a decode step of b sequences of one token, prefill chunks, both).
 *
 * In PyTorch one such layer is some forty ops a step, plus a gather and a scatter of the state slots; at a
 * decode step their dispatch costs more than their arithmetic, and in a prefill the chunked form builds
 * [heads, 64, 64] decay and score matrices. Here each state is read and written in place in its pool slot,
 * and a prefill runs the recurrence token by token: a head's state (64 x 64 fp32, 16 KiB) stays in L1
 * while the chunk's tokens stream through it, which costs fewer operations than the chunked form.
 *
 * One OpenMP region, in phases split by the loops' barriers:
 *   1. the depthwise causal conv + silu of every row (parallel over rows), into fp32 scratch;
 *   2. the conv states moved on to their last taps - 1 inputs (parallel over sequence x channel);
 *   3. DeltaNet only: q, k L2-normalised per key head (q scaled), g and beta per value head, per row;
 *   4. the recurrence, parallel over sequence x head, each token in order;
 *   5. the gated RMSNorm (DeltaNet: per value head, fused into 4; Mamba2: per group, after it).
 *
 * Rounding follows the models' PyTorch forms (gated_deltanet.py, mamba2.py): values PyTorch keeps in the
 * model's dtype (the conv's output, DeltaNet's beta and rule output) are rounded to it here too; the rest
 * is fp32. For bf16 that keeps these paths within rounding of each other, not bit-equal: the recurrence
 * here is the token-by-token form, PyTorch's prefill the chunked one (equal sums in another order).
 *
 * The inner loops run over contiguous fp32 (a head's state rows, the channels of a row) in plain C that
 * the build's -O3 -march=native -ffast-math vectorises: AVX-512 on CPUs that have it, AVX2 or SSE
 * elsewhere, whatever -march the kernel cache was built for.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { REC_F32 = 0, REC_BF16 = 1 };
enum { SEQ_START = 0, SEQ_LEN = 1, SEQ_SLOT = 2, SEQ_FRESH = 3, SEQ_FIELDS = 4 };

static inline float ld(const void *p, int64_t i, int bf) {
    return bf ? bf16_in(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = bf16_out(v);
    else ((float *)p)[i] = v;
}

static inline float rnd(float v, int bf) { return bf ? bf16_in(bf16_out(v)) : v; }

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* Threads for a step whose recurrence touches `work` state values per call: one below PARALLEL_MIN (a decode
 * step of a few sequences, microseconds of work, where waking a second thread and its barriers cost more). */
enum { PARALLEL_MIN = 1 << 18 };

static inline int threads_for(int64_t work, int num_threads) { return work < PARALLEL_MIN ? 1 : num_threads; }

static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); } /* PyTorch's threshold */

/* The depthwise causal conv of one step's rows, shared by both mixers. */
typedef struct {
    const void *x;          /* [rows, channels] in the model's dtype, row stride x_stride */
    int64_t x_stride;
    void *state;            /* the layer's conv pool: slot s at state + s * slot_stride, [channels, taps - 1] */
    int64_t slot_stride;
    const void *weight;     /* [channels, taps] */
    const void *bias;       /* [channels] or NULL */
    int64_t channels, taps;
} conv_args;

/* Phase 1 for row r of sequence q: mixed[r] = round(silu(round(bias + sum_j w_j in_{t - taps + 1 + j}))). */
static void conv_row(const conv_args *c, const int64_t *q, int64_t r, const float *wt, float *mixed, int bf) {
    const int64_t C = c->channels, K = c->taps, t = r - q[SEQ_START];
    float *out = mixed + r * C;
    for (int64_t ch = 0; ch < C; ch++) out[ch] = c->bias ? ld(c->bias, ch, bf) : 0.0f;
    for (int64_t j = 0; j < K; j++) {
        const int64_t i = t - (K - 1) + j; /* the input this tap reads: a row of x, or the kept state */
        const float *w = wt + j * C;
        if (i >= 0) {
            const int64_t row = (q[SEQ_START] + i) * c->x_stride;
            if (bf) {
                const uint16_t *x = (const uint16_t *)c->x + row;
                for (int64_t ch = 0; ch < C; ch++) out[ch] += w[ch] * bf16_in(x[ch]);
            } else {
                const float *x = (const float *)c->x + row;
                for (int64_t ch = 0; ch < C; ch++) out[ch] += w[ch] * x[ch];
            }
        } else if (!q[SEQ_FRESH]) {
            const int64_t base = q[SEQ_SLOT] * c->slot_stride + (K - 1 + i);
            for (int64_t ch = 0; ch < C; ch++) out[ch] += w[ch] * ld(c->state, base + ch * (K - 1), bf);
        }
    }
    for (int64_t ch = 0; ch < C; ch++) out[ch] = rnd(silu(rnd(out[ch], bf)), bf);
}

/* Phase 2 for one channel of sequence q: its kept inputs become the last taps - 1 it saw. Reading
 * old[j + len] before writing new[j], in order of j, makes the shift safe in place. */
static void conv_keep(const conv_args *c, const int64_t *q, int64_t ch, int bf) {
    const int64_t K1 = c->taps - 1, len = q[SEQ_LEN];
    const int64_t base = q[SEQ_SLOT] * c->slot_stride + ch * K1;
    for (int64_t j = 0; j < K1; j++) {
        const int64_t i = len - K1 + j;
        float v;
        if (i >= 0) v = ld(c->x, (q[SEQ_START] + i) * c->x_stride + ch, bf);
        else v = q[SEQ_FRESH] ? 0.0f : ld(c->state, base + j + len, bf);
        st(c->state, base + j, v, bf);
    }
}

/* The step's shared checks and scratch: -2 for a row or slot out of range. */
static int check_seqs(const int64_t *seqs, int64_t nseq, int64_t rows, int64_t num_slots, int64_t *row_seq) {
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t *q = seqs + s * SEQ_FIELDS;
        if (q[SEQ_START] < 0 || q[SEQ_LEN] < 1 || q[SEQ_START] + q[SEQ_LEN] > rows || q[SEQ_SLOT] < 0
            || q[SEQ_SLOT] >= num_slots)
            return -2;
        for (int64_t r = q[SEQ_START]; r < q[SEQ_START] + q[SEQ_LEN]; r++) row_seq[r] = s;
    }
    for (int64_t r = 0; r < rows; r++)
        if (row_seq[r] < 0) return -2;
    return 0;
}

static float *conv_weights_t(const conv_args *c, int bf) { /* [taps, channels] fp32, for rows of channels */
    float *wt = malloc(sizeof(float) * c->taps * c->channels);
    if (!wt) return NULL;
    for (int64_t ch = 0; ch < c->channels; ch++)
        for (int64_t j = 0; j < c->taps; j++) wt[j * c->channels + ch] = ld(c->weight, ch * c->taps + j, bf);
    return wt;
}

/* ------------------------------------------------------------------------------------------------ */

typedef struct {
    conv_args conv;          /* x: qkv [rows, q | k | v] */
    const void *z;           /* [rows, v_heads * v_dim], row stride z_stride */
    int64_t z_stride;
    const void *b, *a;       /* [rows, v_heads] each, row strides b_stride, a_stride */
    int64_t b_stride, a_stride;
    const float *neg_a;      /* [v_heads]: -exp(A_log) */
    const float *dt_bias;    /* [v_heads] */
    const void *norm_weight; /* [v_dim] */
    float norm_eps;
    float *ssm;              /* the layer's pool: slot s at ssm + s * ssm_slot_stride, [v_heads, k_dim, v_dim] */
    int64_t ssm_slot_stride, num_slots;
    int64_t k_heads, v_heads, k_dim, v_dim;
    const int64_t *seqs;     /* [nseq, SEQ_FIELDS] */
    int64_t nseq, rows;
    void *out;               /* [rows, v_heads * v_dim], contiguous */
} deltanet_args;

/* One value head of one sequence through its tokens, then its gated norm, into out. */
static void deltanet_head(const deltanet_args *a, const int64_t *q, int64_t h, const float *mixed, const float *qk,
                          const float *gb, int bf) {
    const int64_t K = a->k_dim, V = a->v_dim, kh = h / (a->v_heads / a->k_heads), C = a->conv.channels;
    const int64_t vcol = 2 * a->k_heads * K + h * V;
    float *S = a->ssm + q[SEQ_SLOT] * a->ssm_slot_stride + h * K * V;
    if (q[SEQ_FRESH]) memset(S, 0, sizeof(float) * K * V);
    float u[V], o[V], zs[V], nw[V];
    for (int64_t j = 0; j < V; j++) nw[j] = ld(a->norm_weight, j, bf);
    for (int64_t r = q[SEQ_START]; r < q[SEQ_START] + q[SEQ_LEN]; r++) {
        const float *kv = qk + (r * 2 * a->k_heads + a->k_heads + kh) * K, *qv = qk + (r * 2 * a->k_heads + kh) * K;
        const float *v = mixed + r * C + vcol;
        const float decay = expf(gb[(r * a->v_heads + h) * 2]), beta = gb[(r * a->v_heads + h) * 2 + 1];
        for (int64_t j = 0; j < V; j++) u[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) { /* u = S^T k: what S now answers for k */
            const float *row = S + i * V;
            for (int64_t j = 0; j < V; j++) u[j] += row[j] * kv[i];
        }
        for (int64_t j = 0; j < V; j++) { u[j] = beta * (v[j] - decay * u[j]); o[j] = 0.0f; }
        for (int64_t i = 0; i < K; i++) { /* S <- decay S + k u^T; o = S^T q */
            float *row = S + i * V;
            for (int64_t j = 0; j < V; j++) {
                row[j] = decay * row[j] + kv[i] * u[j];
                o[j] += row[j] * qv[i];
            }
        }
        /* the gated RMSNorm of the rule's output, rounded as GatedRMSNorm rounds; loops apart per dtype so
         * that the silu's expf vectorises */
        const int64_t zrow = r * a->z_stride + h * V, orow = r * a->v_heads * V + h * V;
        float ms = 0.0f;
        if (bf) {
            const uint16_t *z = (const uint16_t *)a->z + zrow;
            for (int64_t j = 0; j < V; j++) { o[j] = bf16_in(bf16_out(o[j])); ms += o[j] * o[j]; }
            const float inv = 1.0f / sqrtf(ms / (float)V + a->norm_eps);
            for (int64_t j = 0; j < V; j++) { zs[j] = silu(bf16_in(z[j])); o[j] = bf16_in(bf16_out(o[j] * inv)); }
            uint16_t *out = (uint16_t *)a->out + orow;
            for (int64_t j = 0; j < V; j++) out[j] = bf16_out(bf16_in(bf16_out(nw[j] * o[j])) * zs[j]);
        } else {
            const float *z = (const float *)a->z + zrow;
            for (int64_t j = 0; j < V; j++) ms += o[j] * o[j];
            const float inv = 1.0f / sqrtf(ms / (float)V + a->norm_eps);
            float *out = (float *)a->out + orow;
            for (int64_t j = 0; j < V; j++) out[j] = nw[j] * (o[j] * inv) * silu(z[j]);
        }
    }
}

/* Returns 0; -1 for a dtype or shape the kernel does not take; -2 for a row or slot out of range; -3 out of
 * memory. */
int deltanet_forward(const deltanet_args *a, int dtype, int num_threads) {
    if ((dtype != REC_F32 && dtype != REC_BF16) || a->k_heads < 1 || a->v_heads % a->k_heads || a->conv.taps < 2
        || a->conv.channels != 2 * a->k_heads * a->k_dim + a->v_heads * a->v_dim)
        return -1;
    const int bf = dtype == REC_BF16;
    const int64_t rows = a->rows, C = a->conv.channels, K = a->k_dim, KH = a->k_heads, VH = a->v_heads;
    int64_t *row_seq = malloc(sizeof(int64_t) * (rows > 0 ? rows : 1));
    float *mixed = malloc(sizeof(float) * (rows * C + 1)), *qk = malloc(sizeof(float) * (rows * 2 * KH * K + 1));
    float *gb = malloc(sizeof(float) * (rows * VH * 2 + 1)), *wt = conv_weights_t(&a->conv, bf);
    int status = (row_seq && mixed && qk && gb && wt) ? 0 : -3;
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++) row_seq[r] = -1;
        status = check_seqs(a->seqs, a->nseq, rows, a->num_slots, row_seq);
    }
    if (status == 0) {
        const float scale = 1.0f / sqrtf((float)K);
#pragma omp parallel num_threads(threads_for(rows * VH * K * a->v_dim, num_threads))
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) conv_row(&a->conv, a->seqs + row_seq[r] * SEQ_FIELDS, r, wt, mixed, bf);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < a->nseq * C; i++) conv_keep(&a->conv, a->seqs + (i / C) * SEQ_FIELDS, i % C, bf);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                for (int64_t part = 0; part < 2 * KH; part++) { /* q heads, then k heads: L2-normalised */
                    const float *x = mixed + r * C + part * K;
                    float *y = qk + (r * 2 * KH + part) * K, ss = 0.0f;
                    for (int64_t i = 0; i < K; i++) ss += x[i] * x[i];
                    const float inv = 1.0f / sqrtf(ss + 1e-6f) * (part < KH ? scale : 1.0f);
                    for (int64_t i = 0; i < K; i++) y[i] = x[i] * inv;
                }
                for (int64_t h = 0; h < VH; h++) {
                    const float braw = ld(a->b, r * a->b_stride + h, bf), araw = ld(a->a, r * a->a_stride + h, bf);
                    gb[(r * VH + h) * 2] = a->neg_a[h] * softplus(araw + a->dt_bias[h]);
                    gb[(r * VH + h) * 2 + 1] = rnd(1.0f / (1.0f + expf(-braw)), bf);
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < a->nseq * VH; i++)
                deltanet_head(a, a->seqs + (i / VH) * SEQ_FIELDS, i % VH, mixed, qk, gb, bf);
        }
    }
    free(row_seq); free(mixed); free(qk); free(gb); free(wt);
    return status;
}

/* ------------------------------------------------------------------------------------------------ */

typedef struct {
    conv_args conv;          /* x: the [x | B | C] columns of the input projection's rows */
    const void *z;           /* [rows, heads * head_dim], row stride z_stride */
    int64_t z_stride;
    const void *dt;          /* [rows, heads] raw, row stride dt_stride */
    int64_t dt_stride;
    const float *neg_a, *dt_bias, *d; /* [heads]: -exp(A_log), dt_bias, D */
    float dt_min;
    const void *norm_weight; /* [heads * head_dim] */
    float norm_eps;
    float *ssm;              /* the layer's pool: slot s at ssm + s * ssm_slot_stride, [heads, head_dim, state] */
    int64_t ssm_slot_stride, num_slots;
    int64_t heads, groups, head_dim, state_size;
    const int64_t *seqs;
    int64_t nseq, rows;
    void *out;               /* [rows, heads * head_dim], contiguous */
} mamba2_args;

/* One head of one sequence through its tokens: y = S C + D x, into y (fp32). */
static void mamba2_head(const mamba2_args *a, const int64_t *q, int64_t h, const float *mixed, float *y, int bf) {
    const int64_t P = a->head_dim, N = a->state_size, C = a->conv.channels, inner = a->heads * P;
    const int64_t g = h / (a->heads / a->groups);
    float *S = a->ssm + q[SEQ_SLOT] * a->ssm_slot_stride + h * P * N;
    if (q[SEQ_FRESH]) memset(S, 0, sizeof(float) * P * N);
    for (int64_t r = q[SEQ_START]; r < q[SEQ_START] + q[SEQ_LEN]; r++) {
        const float *x = mixed + r * C + h * P, *B = mixed + r * C + inner + g * N;
        const float *Cv = mixed + r * C + inner + a->groups * N + g * N;
        float dt = softplus(ld(a->dt, r * a->dt_stride + h, bf) + a->dt_bias[h]);
        dt = dt < a->dt_min ? a->dt_min : dt;
        const float decay = expf(dt * a->neg_a[h]);
        float *yr = y + r * inner + h * P;
        for (int64_t p = 0; p < P; p++) {
            float *row = S + p * N, acc = 0.0f;
            const float xd = dt * x[p];
            for (int64_t n = 0; n < N; n++) {
                row[n] = decay * row[n] + xd * B[n];
                acc += row[n] * Cv[n];
            }
            yr[p] = acc + a->d[h] * x[p];
        }
    }
}

int mamba2_forward(const mamba2_args *a, int dtype, int num_threads) {
    if ((dtype != REC_F32 && dtype != REC_BF16) || a->groups < 1 || a->heads % a->groups || a->conv.taps < 2
        || a->conv.channels != a->heads * a->head_dim + 2 * a->groups * a->state_size)
        return -1;
    const int bf = dtype == REC_BF16;
    const int64_t rows = a->rows, C = a->conv.channels, H = a->heads, G = a->groups, inner = H * a->head_dim;
    const int64_t width = inner / G; /* one norm group's channels */
    int64_t *row_seq = malloc(sizeof(int64_t) * (rows > 0 ? rows : 1));
    float *mixed = malloc(sizeof(float) * (rows * C + 1)), *y = malloc(sizeof(float) * (rows * inner + 1));
    float *wt = conv_weights_t(&a->conv, bf);
    int status = (row_seq && mixed && y && wt) ? 0 : -3;
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++) row_seq[r] = -1;
        status = check_seqs(a->seqs, a->nseq, rows, a->num_slots, row_seq);
    }
    if (status == 0) {
        const mamba2_args *m = a;
#pragma omp parallel num_threads(threads_for(rows * inner * a->state_size, num_threads))
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) conv_row(&m->conv, m->seqs + row_seq[r] * SEQ_FIELDS, r, wt, mixed, bf);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m->nseq * C; i++) conv_keep(&m->conv, m->seqs + (i / C) * SEQ_FIELDS, i % C, bf);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < m->nseq * H; i++)
                mamba2_head(m, m->seqs + (i / H) * SEQ_FIELDS, i % H, mixed, y, bf);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows * G; i++) { /* y * silu(z), RMS-normalised per group, times the weight */
                const int64_t r = i / G, c0 = (i % G) * width;
                float gated[width], ms = 0.0f;
                for (int64_t j = 0; j < width; j++) {
                    gated[j] = y[r * inner + c0 + j] * silu(ld(m->z, r * m->z_stride + c0 + j, bf));
                    ms += gated[j] * gated[j];
                }
                const float inv = 1.0f / sqrtf(ms / (float)width + m->norm_eps);
                for (int64_t j = 0; j < width; j++)
                    st(m->out, r * inner + c0 + j, ld(m->norm_weight, c0 + j, bf) * (gated[j] * inv), bf);
            }
        }
    }
    free(row_seq); free(mixed); free(y); free(wt);
    return status;
}
