/* An FP8 KV pool (kernels/kv_quant.py): float8_e4m3fn values, 1 sign, 4 exponent (bias 7) and 3 mantissa
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

/* 16 e4m3 bytes -> what they read back as: times `scale` in fp32, then rounded to bf16 when `to_bf16` (the
 * numbers the tables hold, computed, for a hot loop: no lookups). The byte's bits placed in an fp32 with the
 * exponent rebiased from 7 to 127 (normal values), or its 3-bit mantissa times 2^-9 (subnormals and zero);
 * 0x7f / 0xff a NaN. Integer and exact-float steps only, in GCC vector types of FP8_LANES lanes, which the
 * compiler lowers to the target's vectors (16 for AVX-512; 8 elsewhere, as wider ones go lane by lane on
 * AVX2). */
#ifdef __AVX512F__
#define FP8_LANES 16
#else
#define FP8_LANES 8
#endif
typedef uint32_t fp8_u32v __attribute__((vector_size(FP8_LANES * 4)));
typedef int32_t fp8_i32v __attribute__((vector_size(FP8_LANES * 4)));
typedef float fp8_f32v __attribute__((vector_size(FP8_LANES * 4)));

static inline __attribute__((always_inline)) void fp8_e4m3_in_lanes(const uint8_t *src, float *dst, float scale,
                                                                    int to_bf16) {
    uint32_t wide[FP8_LANES]; /* (a loop GCC widens in one instruction; its convertvector goes lane by lane) */
    for (int i = 0; i < FP8_LANES; i++) wide[i] = src[i];
    fp8_u32v u;
    memcpy(&u, wide, sizeof u);
    const fp8_u32v mag = u & 0x7fu;
    const fp8_u32v tiny = (fp8_u32v)(mag < 8u); /* all ones where the exponent field is 0 */
    const fp8_f32v sub = __builtin_convertvector((fp8_i32v)mag, fp8_f32v) * (1.0f / 512.0f);
    fp8_u32v bits = (((mag << 20) + (120u << 23)) & ~tiny) | ((fp8_u32v)sub & tiny);
    bits |= (fp8_u32v)(mag == 0x7fu) & 0x7fc00000u;
    fp8_f32v v = (fp8_f32v)(bits | ((u & 0x80u) << 24)) * scale;
    if (to_bf16) { /* round to nearest even, as bf16_out (a NaN stays a NaN) */
        const fp8_u32v w = (fp8_u32v)v;
        v = (fp8_f32v)((w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u);
    }
    memcpy(dst, &v, sizeof v);
}

static inline __attribute__((always_inline)) void fp8_e4m3_in16(const uint8_t *src, float *dst, float scale,
                                                                int to_bf16) {
    for (int i = 0; i < 16; i += FP8_LANES) fp8_e4m3_in_lanes(src + i, dst + i, scale, to_bf16);
}

#endif
