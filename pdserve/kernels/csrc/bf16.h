/* bf16 <-> fp32 for the CPU kernels, bit for bit as PyTorch converts: widening is exact; narrowing
 * rounds to nearest even and keeps NaN a (quiet) NaN. */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_in(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_out(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
