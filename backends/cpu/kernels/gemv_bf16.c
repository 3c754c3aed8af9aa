/*
 * y = x @ w.T (+ bias) for a few rows of x, bfloat16 in and out, float32 accumulation.
 *
 * Decode at batch 1-4 is a matrix-vector product bound by streaming the weights.
 * Across the ~120 small projections of a decode step, oneDNN's packed GEMV
 * streams ~18 GB/s on this class of CPU; this kernel reads w in its own row-major
 * layout four rows at a time with AVX512-BF16 dot products (vdpbf16ps) and a
 * software prefetch a few rows ahead, ~21 GB/s. Rows of w are split over
 * torch's OpenMP threads (see native.py).
 *
 * x: [m, k], w: [n, k], bias: [n] or NULL, y: [m, n]; k % 32 == 0, n % 4 == 0.
 * threads: torch's intra-op thread count (omp_set_num_threads is per calling thread).
 * Returns 0, or -1 where the CPU or compiler lacks AVX512-BF16 (the caller falls back).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define PREFETCH_ROWS 8

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0; /* NaN: the rounding below would carry into inf */
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even, as torch's conversion does */
    return (uint16_t)(bits >> 16);
}

static inline float from_bf16(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m, int n, int k, int threads) {
    if (k % 32 != 0 || n % 4 != 0) return -2;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int row = 0; row < n; row += 4) {
        const uint16_t *w0 = w + (int64_t)row * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        if (row + PREFETCH_ROWS + 4 <= n) {
            const char *ahead = (const char *)(w + (int64_t)(row + PREFETCH_ROWS) * k);
            for (int byte = 0; byte < 4 * k * 2; byte += 64) _mm_prefetch(ahead + byte, _MM_HINT_T0);
        }
        for (int i = 0; i < m; ++i) {
            const uint16_t *xi = x + (int64_t)i * k;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (int c = 0; c < k; c += 32) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xi + c));
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w0 + c)), xv);
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w1 + c)), xv);
                a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(w2 + c)), xv);
                a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(w3 + c)), xv);
            }
            float sums[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),
                             _mm512_reduce_add_ps(a3)};
            uint16_t *yi = y + (int64_t)i * n + row;
            for (int j = 0; j < 4; ++j)  /* bias in float32, one rounding: oneDNN's fused bias does the same */
                yi[j] = to_bf16(bias != NULL ? sums[j] + from_bf16(bias[row + j]) : sums[j]);
        }
    }
    return 0;
}

#else

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m, int n, int k, int threads) {
    (void)x; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return -1;
}

#endif
