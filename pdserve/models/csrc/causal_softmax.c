/* Causal softmax over one tile of prefill attention scores, masked, normalised and cast in one pass.
 *
 * The tiled prefill attention (attention._tiled_causal_attention) multiplies a tile of `rows`
 * queries, each with the `group` query heads of one KV head, by the `keys` keys the tile's last
 * query can see. In PyTorch the mask, the softmax and the cast of the probabilities to the dtype of
 * the P @ V product are three passes over the [rows * group, keys] scores, the softmax itself three
 * more. Here each row is read twice (maximum; exponentials and their sum, kept in place) and written
 * once, and the masked tail is never exponentiated.
 *
 * scores: fp32 [rows, group, keys], contiguous, already scaled. Query row i sees keys
 * [0, keys - rows + i]; the rest of its row is written as zero. out: [rows, group, keys], fp32 or
 * bf16 (rounded to nearest even, as PyTorch casts); it may be `scores` itself when fp32.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

enum { OUT_F32 = 0, OUT_BF16 = 1 };

static void softmax_row(float *s, int64_t visible, int64_t keys, void *out, int out_dtype) {
    float max = -FLT_MAX;
    for (int64_t j = 0; j < visible; j++) max = s[j] > max ? s[j] : max;
    float sum = 0.0f;
    for (int64_t j = 0; j < visible; j++) {
        s[j] = expf(s[j] - max);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    if (out_dtype == OUT_F32) {
        float *o = out;
        for (int64_t j = 0; j < visible; j++) o[j] = s[j] * inv;
        memset(o + visible, 0, (keys - visible) * sizeof(float));
    } else {
        uint16_t *o = out;
        for (int64_t j = 0; j < visible; j++) o[j] = bf16_out(s[j] * inv);
        memset(o + visible, 0, (keys - visible) * sizeof(uint16_t));
    }
}

/* Returns 0, or -1 for arguments the kernel does not take. */
int causal_softmax(float *scores, void *out, int64_t rows, int64_t group, int64_t keys, int out_dtype,
                   int num_threads) {
    if (rows < 1 || group < 1 || keys < rows || (out_dtype != OUT_F32 && out_dtype != OUT_BF16)) return -1;
    const int64_t esize = out_dtype == OUT_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows * group; r++) {
        const int64_t visible = keys - rows + r / group + 1;
        softmax_row(scores + r * keys, visible, keys, (char *)out + r * keys * esize, out_dtype);
    }
    return 0;
}
