/* An FP8 KV pool (models/kv_quant.py): float8_e4m3fn values, 1 sign, 4 exponent (bias 7) and 3 mantissa
 * bits, no infinities, 0x7f and 0xff NaN, 448 the largest finite value, 2^-9 the smallest subnormal.
 *
 * Reading: the kernels look each byte up in a 256-entry table of what it reads back as (the layer's
 * scale applied, and rounded to the compute dtype as kv_quant.dequantize rounds), which the Python side
 * builds with that very function (kv_quant.dequant_tables): the kernels see the PyTorch path's values.
 * Writing: fp8_e4m3_out(x / scale), saturating, as kv_quant.quantize.
 */
#ifndef PDSERVE_FP8_H
#define PDSERVE_FP8_H

#include <stdint.h>
#include <string.h>

/* Rounded to the nearest e4m3 value (ties to even); beyond +-448 (infinities too) saturated to +-448,
 * NaN a NaN: what torch's clamp(x, -448, 448).to(float8_e4m3fn) gives. Integer arithmetic only, so
 * -ffast-math cannot change it. */
static inline uint8_t fp8_e4m3_out(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;   /* NaN */
    if (a >= 0x43e00000u) return sign | 0x7e;  /* 448 and past it: saturate */
    if (a >= 0x3c800000u) {                    /* 2^-6 and up: a normal e4m3 value */
        /* Round the 23-bit mantissa to 3 bits, half to even (a carry moves into the exponent, as it
         * should), then rebias the exponent from 127 to 7 (120 in units of the 8 mantissa steps). */
        const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
        return sign | (uint8_t)((r >> 20) - (120u << 3));
    }
    /* Below 2^-6: a multiple m of 2^-9 (m = 8 is 2^-6 itself, whose code is 8 too). */
    const int32_t e = (int32_t)(a >> 23) - 127;
    const int32_t shift = 14 - e; /* a = M * 2^(e - 23), so m = M / 2^shift */
    if (a < 0x00800000u || shift >= 25) return sign; /* below half of 2^-9: zero */
    const uint32_t M = (a & 0x7fffffu) | 0x800000u, m = M >> shift, rest = M & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    return sign | (uint8_t)(m + (rest > half || (rest == half && (m & 1u))));
}

#endif
