/* Which of the kernels' instruction-set forms this library was compiled with: the forms are chosen at
 * build time by the compiler's target macros (-march), and the Python side reports and tests by this.
 * "plain" is the portable C loops, which the compiler vectorises for the target (NEON on ARM). */
const char *kernel_isa(void) {
#if defined(__AVX512BF16__)
    return "avx512-bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2-fma";
#else
    return "plain";
#endif
}
