/* RMSNorm of each row: out = x / sqrt(mean(x^2) + eps) * weight, in one pass per row; optionally
 * after a residual add, h = x + residual, which is written out too (the decoder block's
 * "h = x + attn; norm(h)" in one call).
 *
 * PyTorch's CPU rms_norm runs as five element-wise ops (square, mean, add, rsqrt, two products), and
 * for bf16 the model adds a cast to fp32 and back and a product by the weight: at a decode step, where
 * a row is 576 values, the dispatch of those ops costs more than the arithmetic. The rounding
 * follows the model's PyTorch form: for fp32, one fp32 result; for bf16, the normalised row is
 * rounded to bf16 before the product by the bf16 weight, and the product rounded again.
 *
 * x, out, and residual and h_out when given: [rows, hidden] contiguous; weight: [hidden]; all of one
 * dtype, fp32 or bf16. The sum is rounded to that dtype before it is normalised, as PyTorch's add
 * rounds it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

enum { NORM_F32 = 0, NORM_BF16 = 1 };

static void row_f32(const float *x, const float *w, float *out, int64_t hidden, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < hidden; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) out[i] = x[i] * inv * w[i];
}

static void row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t hidden, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < hidden; i++) sum += bf16_in(x[i]) * bf16_in(x[i]);
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) out[i] = bf16_out(bf16_in(bf16_out(bf16_in(x[i]) * inv)) * bf16_in(w[i]));
}

/* residual and h_out: both NULL, or both given. Returns 0, or -1 for a dtype the kernel does not take.
 * A few rows (a decode step) stay on the calling thread. */
int rms_norm(const void *x, const void *residual, void *h_out, const void *weight, void *out, int64_t rows,
             int64_t hidden, float eps, int dtype, int num_threads) {
    if ((dtype != NORM_F32 && dtype != NORM_BF16) || hidden < 1) return -1;
    const int64_t esize = dtype == NORM_F32 ? 4 : 2;
    const int threads = rows < 32 ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * hidden * esize;
        char *o = (char *)out + r * hidden * esize;
        if (residual) { /* h = x + residual, rounded to the dtype, is the row to normalise */
            char *h = (char *)h_out + r * hidden * esize;
            const char *res = (const char *)residual + r * hidden * esize;
            if (dtype == NORM_F32)
                for (int64_t i = 0; i < hidden; i++) ((float *)h)[i] = ((const float *)xr)[i] + ((const float *)res)[i];
            else
                for (int64_t i = 0; i < hidden; i++)
                    ((uint16_t *)h)[i] = bf16_out(bf16_in(((const uint16_t *)xr)[i]) + bf16_in(((const uint16_t *)res)[i]));
            xr = h;
        }
        if (dtype == NORM_F32)
            row_f32((const float *)xr, weight, (float *)o, hidden, eps);
        else
            row_bf16((const uint16_t *)xr, weight, (uint16_t *)o, hidden, eps);
    }
    return 0;
}
