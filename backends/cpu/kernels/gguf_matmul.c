/*
 * y = x @ W.T with W kept in its GGUF blocks (Q4_1, Q8_0), dequantized in registers.
 *
 * Decode on a CPU streams the weights once per token, so bytes are time: a Q4_1 block holds 32
 * weights in 20 bytes (5 bits a weight) against 64 bytes in bf16. Each block is unpacked once and
 * used for every row of x (a decode batch), then dropped.
 *
 *   Q4_1 block (20 bytes): d (fp16), m (fp16), qs[16]; weight j = d * q_j + m, q_j the low nibble
 *                          of qs[j] for j < 16, the high nibble of qs[j - 16] otherwise (ggml's layout).
 *   Q8_0 block (34 bytes): d (fp16), qs[32] int8; weight j = d * qs[j].
 *
 * x: [m, k] float32, W: [n rows, k / 32 blocks], y: [m, n] float32; k % 32 == 0.
 * simd: 1 for the AVX2 path where this build has it, 0 for the portable C path (tests run both;
 * a CPU without AVX2 gets a build without that path and the portable one, which -O3 vectorises).
 * Rows of W are split over torch's OpenMP threads. Returns 0, or -2 for shapes it does not take.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
#define MAX_ROWS 16 /* rows of x per call in the fused path; more take the dequantize + GEMM path */
#define MAX_BLOCKS 1024 /* k up to 32768 columns */

#if defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while ((mantissa & 0x400u) == 0) { mantissa <<= 1; --exponent; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#endif

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* The 32 quants of a block as floats (Q4_1: before d and m). */
static inline void unpack_q4_1(const uint8_t *qs, float *out) {
    for (int j = 0; j < 16; ++j) {
        out[j] = (float)(qs[j] & 0x0F);
        out[j + 16] = (float)(qs[j] >> 4);
    }
}

static inline float dot32(const float *a, const float *b) {
    float s = 0.0f;
    for (int j = 0; j < 32; ++j) s += a[j] * b[j];
    return s;
}

#if HAVE_AVX2
/* The four 8-wide float vectors of a block's 32 quants against 32 activations. */
static inline __m256 dot32_avx2(__m256 q0, __m256 q1, __m256 q2, __m256 q3, const float *xb) {
    __m256 dot = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
    dot = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), dot);
    dot = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), dot);
    return _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), dot);
}

/* A Q4_1 block's 32 quants as bytes: lo = elements 0..15 (low nibbles), hi = 16..31 (high nibbles). */
static inline void q4_1_nibbles(const uint8_t *block, __m128i *lo, __m128i *hi) {
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + 4));
    *lo = _mm_and_si128(packed, low_mask);
    *hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

int gguf_q4_1_matmul(const uint8_t *w, const float *x, float *y, int m, int n, int k, int threads, int simd) {
    if (k % 32 != 0 || m < 1 || m > MAX_ROWS) return -2;
    const int blocks = k / 32;
    if (threads < 1) threads = 1;
    if (blocks > MAX_BLOCKS) return -2;
    /* Per row of x, the sum of each block's 32 activations: the m term of Q4_1 is m * sum(x). */
    float sums[MAX_ROWS * MAX_BLOCKS];
    for (int i = 0; i < m; ++i)
        for (int b = 0; b < blocks; ++b) {
            float s = 0.0f;
            for (int j = 0; j < 32; ++j) s += x[(int64_t)i * k + b * 32 + j];
            sums[i * blocks + b] = s;
        }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < n; ++r) {
        const uint8_t *row = w + (int64_t)r * blocks * Q4_1_BYTES;
        float acc[MAX_ROWS];
        for (int i = 0; i < m; ++i) acc[i] = 0.0f;
#if HAVE_AVX2
        if (simd) {
            __m256 vacc[MAX_ROWS];
            for (int i = 0; i < m; ++i) vacc[i] = _mm256_setzero_ps();
            for (int b = 0; b < blocks; ++b) {
                const uint8_t *block = row + b * Q4_1_BYTES;
                const float d = half_to_float(load_u16(block)), mn = half_to_float(load_u16(block + 2));
                __m128i lo, hi;
                q4_1_nibbles(block, &lo, &hi);
                const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                const __m256 vd = _mm256_set1_ps(d);
                for (int i = 0; i < m; ++i) {
                    vacc[i] = _mm256_fmadd_ps(vd, dot32_avx2(q0, q1, q2, q3, x + (int64_t)i * k + b * 32), vacc[i]);
                    acc[i] += mn * sums[i * blocks + b];
                }
            }
            for (int i = 0; i < m; ++i) y[(int64_t)i * n + r] = acc[i] + hsum256(vacc[i]);
            continue;
        }
#endif
        float q[32];
        for (int b = 0; b < blocks; ++b) {
            const uint8_t *block = row + b * Q4_1_BYTES;
            const float d = half_to_float(load_u16(block)), mn = half_to_float(load_u16(block + 2));
            unpack_q4_1(block + 4, q);
            for (int i = 0; i < m; ++i)
                acc[i] += d * dot32(q, x + (int64_t)i * k + b * 32) + mn * sums[i * blocks + b];
        }
        for (int i = 0; i < m; ++i) y[(int64_t)i * n + r] = acc[i];
    }
    return 0;
}

int gguf_q8_0_matmul(const uint8_t *w, const float *x, float *y, int m, int n, int k, int threads, int simd) {
    if (k % 32 != 0 || m < 1 || m > MAX_ROWS) return -2;
    const int blocks = k / 32;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < n; ++r) {
        const uint8_t *row = w + (int64_t)r * blocks * Q8_0_BYTES;
#if HAVE_AVX2
        if (simd) {
            __m256 vacc[MAX_ROWS];
            for (int i = 0; i < m; ++i) vacc[i] = _mm256_setzero_ps();
            for (int b = 0; b < blocks; ++b) {
                const uint8_t *block = row + b * Q8_0_BYTES;
                const __m256 vd = _mm256_set1_ps(half_to_float(load_u16(block)));
                const __m128i b0 = _mm_loadu_si128((const __m128i *)(block + 2));
                const __m128i b1 = _mm_loadu_si128((const __m128i *)(block + 18));
                const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
                const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
                const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
                const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
                for (int i = 0; i < m; ++i)
                    vacc[i] = _mm256_fmadd_ps(vd, dot32_avx2(q0, q1, q2, q3, x + (int64_t)i * k + b * 32), vacc[i]);
            }
            for (int i = 0; i < m; ++i) y[(int64_t)i * n + r] = hsum256(vacc[i]);
            continue;
        }
#endif
        float acc[MAX_ROWS], q[32];
        for (int i = 0; i < m; ++i) acc[i] = 0.0f;
        for (int b = 0; b < blocks; ++b) {
            const uint8_t *block = row + b * Q8_0_BYTES;
            const float d = half_to_float(load_u16(block));
            for (int j = 0; j < 32; ++j) q[j] = (float)(int8_t)block[2 + j];
            for (int i = 0; i < m; ++i) acc[i] += d * dot32(q, x + (int64_t)i * k + b * 32);
        }
        for (int i = 0; i < m; ++i) y[(int64_t)i * n + r] = acc[i];
    }
    return 0;
}

/* W as float32 [n, k]: the path for many rows of x (prefill), where a GEMM library wins. */
int gguf_dequantize(const uint8_t *w, float *out, int n, int k, int q8, int threads) {
    if (k % 32 != 0) return -2;
    const int blocks = k / 32, bytes = q8 ? Q8_0_BYTES : Q4_1_BYTES;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < n; ++r) {
        for (int b = 0; b < blocks; ++b) {
            const uint8_t *block = w + ((int64_t)r * blocks + b) * bytes;
            float *dest = out + (int64_t)r * k + b * 32;
            const float d = half_to_float(load_u16(block));
            if (q8) {
                for (int j = 0; j < 32; ++j) dest[j] = d * (float)(int8_t)block[2 + j];
            } else {
                const float mn = half_to_float(load_u16(block + 2));
                float q[32];
                unpack_q4_1(block + 4, q);
                for (int j = 0; j < 32; ++j) dest[j] = d * q[j] + mn;
            }
        }
    }
    return 0;
}

/*
 * The same products with the activations quantized too, as llama.cpp computes them: each block of 32
 * activations becomes int8 with one float scale (xd = max|x| / 127), so a block's dot product is an
 * exact integer sum (AVX2: one maddubs + one madd per 32 weights, against four converts and four
 * FMAs in the float path) times d * xd. Q4_1's m term uses xd * sum(xq), the sum of the quantized
 * activations (llama.cpp's Q8_1 `s`). Less exact than the float path (each activation is rounded to
 * one part in 254 of its block's largest), so the engine uses it only when asked (--gguf-activations int8).
 */
static void quantize_rows_int8(const float *x, int8_t *xq, float *xd, float *xs, int m, int k) {
    const int blocks = k / 32;
    for (int i = 0; i < m; ++i)
        for (int b = 0; b < blocks; ++b) {
            const float *src = x + (int64_t)i * k + b * 32;
            int8_t *dst = xq + (int64_t)i * k + b * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(src[j]));
            const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; ++j) {
                const int q = (int)lrintf(src[j] * inverse);
                dst[j] = (int8_t)q;
                sum += q;
            }
            xd[i * blocks + b] = d;
            xs[i * blocks + b] = d * (float)sum;
        }
}

/* The 32 quants of a weight block as bytes in element order: Q4_1 unsigned nibbles, Q8_0 signed. */
static inline void weight_quants(const uint8_t *block, int q8, int8_t *out) {
    if (q8) {
        memcpy(out, block + 2, 32);
    } else {
        for (int j = 0; j < 16; ++j) {
            out[j] = (int8_t)(block[4 + j] & 0x0F);
            out[j + 16] = (int8_t)(block[4 + j] >> 4);
        }
    }
}

int gguf_matmul_int8(const uint8_t *w, const float *x, float *y, int m, int n, int k, int q8, int threads, int simd) {
    if (k % 32 != 0 || m < 1 || m > MAX_ROWS) return -2;
    const int blocks = k / 32, bytes = q8 ? Q8_0_BYTES : Q4_1_BYTES;
    if (blocks > MAX_BLOCKS) return -2;
    if (threads < 1) threads = 1;
    int8_t *xq = (int8_t *)malloc((size_t)m * k);
    float *scales = (float *)malloc(sizeof(float) * 2 * (size_t)m * blocks);
    if (xq == NULL || scales == NULL) {
        free(xq);
        free(scales);
        return -3;
    }
    float *xd = scales, *xs = scales + (size_t)m * blocks;
    quantize_rows_int8(x, xq, xd, xs, m, k);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < n; ++r) {
        const uint8_t *row = w + (int64_t)r * blocks * bytes;
        float acc[MAX_ROWS];
        for (int i = 0; i < m; ++i) acc[i] = 0.0f;
#if HAVE_AVX2
        if (simd) {
            __m256 vacc[MAX_ROWS];
            for (int i = 0; i < m; ++i) vacc[i] = _mm256_setzero_ps();
            const __m256i ones = _mm256_set1_epi16(1);
            for (int b = 0; b < blocks; ++b) {
                const uint8_t *block = row + b * bytes;
                const float d = half_to_float(load_u16(block));
                __m256i wq, wabs = _mm256_setzero_si256();
                float mn = 0.0f;
                if (q8) {
                    wq = _mm256_loadu_si256((const __m256i *)(block + 2));
                    wabs = _mm256_sign_epi8(wq, wq); /* maddubs takes unsigned x signed: |w| and sign(w) * x */
                } else {
                    mn = half_to_float(load_u16(block + 2));
                    __m128i lo, hi;
                    q4_1_nibbles(block, &lo, &hi);
                    wq = _mm256_set_m128i(hi, lo);
                }
                for (int i = 0; i < m; ++i) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)i * k + b * 32));
                    /* pairwise products fit int16: 15 * 127 * 2 (Q4_1), 128 * 127 * 2 (Q8_0) */
                    const __m256i pairs = q8 ? _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(a, wq))
                                             : _mm256_maddubs_epi16(wq, a);
                    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                    vacc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[i * blocks + b]), dots, vacc[i]);
                    if (!q8) acc[i] += mn * xs[i * blocks + b];
                }
            }
            for (int i = 0; i < m; ++i) y[(int64_t)i * n + r] = acc[i] + hsum256(vacc[i]);
            continue;
        }
#endif
        int8_t q[32];
        for (int b = 0; b < blocks; ++b) {
            const uint8_t *block = row + b * bytes;
            const float d = half_to_float(load_u16(block)), mn = q8 ? 0.0f : half_to_float(load_u16(block + 2));
            weight_quants(block, q8, q);
            for (int i = 0; i < m; ++i) {
                const int8_t *a = xq + (int64_t)i * k + b * 32;
                int dot = 0;
                for (int j = 0; j < 32; ++j) dot += (q8 ? (int)q[j] : (int)(uint8_t)q[j]) * (int)a[j];
                acc[i] += d * xd[i * blocks + b] * (float)dot + mn * xs[i * blocks + b];
            }
        }
        for (int i = 0; i < m; ++i) y[(int64_t)i * n + r] = acc[i];
    }
    free(xq);
    free(scales);
    return 0;
}

int gguf_has_avx2(void) { return HAVE_AVX2; }
