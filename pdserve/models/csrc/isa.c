/* Which of the kernels' instruction-set forms this library was compiled with: the forms are chosen at
 * build time by the compiler's target macros (-march), and the Python side reports and tests by this. */
const char *kernel_isa(void) {
#if defined(__AVX512BF16__)
    return "avx512-bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2-fma";
#elif defined(__ARM_NEON)
    return "neon";
#else
    return "plain";
#endif
}
