/*
 * Causal attention of one request's prefill rows with bf16 dot products (AVX512-BF16's vdpbf16ps).
 *
 * Why: on a CPU with AVX512-BF16 but no AMX, ATen's CPU flash attention runs at float32's rate in float32 and
 * in bf16 alike (its bf16 path converts around small oneDNN GEMMs), and it computes whole 256 x 512 blocks
 * across the causal diagonal: a 1,500-token prompt spent ~24 ms a layer there, 43% of its time to first token.
 * vdpbf16ps does twice float32's multiply-adds a cycle; this kernel runs both products (q k^T and p v) on it
 * over 32-query x 64-key tiles, skips every tile above the diagonal, and keeps the softmax in float32.
 *
 * Numerics: q (pre-scaled), k, v and the softmax weights p rounded to bf16 at the products' inputs, products
 * and sums accumulated in float32; the online softmax (running max and sum) in float32. That is the rounding
 * of HF transformers' and ATen's bf16 attention, with the softmax kept in float32.
 *
 * q: float32 [n, heads, dim] (q_stride floats from one token to the next), k and v: float32 [len, kv_heads,
 * dim] (kv_stride), out: float32 [n, heads, dim] (out_stride). Query i sees keys 0 .. len - n + i (the
 * request's cached prefix, then the causal part). dim % 64 == 0 and dim <= 256; heads % kv_heads == 0.
 * Returns 0; -1 where the compiler or CPU lacks AVX512-BF16 (the caller falls back); -2 for shapes it does
 * not take; -3 when its scratch memory cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define QB 32              /* query rows a task holds: its tiles (q, scores, p, acc) stay in a 32 KiB L1 */
#define KB 64              /* keys a tile: four vectors of 16 scores a query row */
#define MASKED (-1.0e30f)  /* a finite "minus infinity": -ffast-math assumes no infinities */

/* 2^x for x <= 0 (0 below -126): x = n + f, |f| <= 1/2, 2^f by its Taylor series to degree 6
 * (relative error ~1e-7, below float32's rounding), then scaled by 2^n. */
static inline __m512 exp2_neg(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* 16 floats of a and of b -> 16 bf16 pairs (a[i], b[i]) as 32-bit words, a in the low half. */
static inline __m512i pair_bf16(__m512 a, __m512 b) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* k -> kp[kv_head][key / 16][dim / 2][16 keys] of bf16 pairs (two dims a word): one load a (key tile, dim pair)
 * feeds 16 scores. v -> vp[kv_head][key / 2][dim] of bf16 pairs (two keys a word): one load feeds 16 dims of
 * the output. Keys past len are zero (their weights are masked to 0). */
static void pack_kv(const float *k, const float *v, int64_t kv_stride, int len, int padded, int kv_heads, int dim,
                    uint32_t *kp, uint32_t *vp, int threads) {
    const int half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) collapse(2)
    for (int h = 0; h < kv_heads; ++h) {
        for (int j = 0; j < padded; j += 2) {
            uint32_t *kt0 = kp + ((int64_t)h * (padded / 16) + j / 16) * half * 16 + (j % 16);
            uint32_t *vt = vp + ((int64_t)h * (padded / 2) + j / 2) * dim;
            for (int e = 0; e < 2; ++e) { /* keys j and j + 1 into the key tiles */
                uint32_t row[128];
                if (j + e < len) {
                    const float *src = k + (int64_t)(j + e) * kv_stride + (int64_t)h * dim;
                    for (int d = 0; d < dim; d += 32) {
                        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                                          _mm512_loadu_ps(src + d));
                        _mm512_storeu_si512(row + d / 2, both);
                    }
                } else {
                    memset(row, 0, sizeof(uint32_t) * half);
                }
                for (int p = 0; p < half; ++p) kt0[p * 16 + e] = row[p];
            }
            for (int d = 0; d < dim; d += 16) { /* values of keys j and j + 1, interleaved */
                const __m512 a = j < len ? _mm512_loadu_ps(v + (int64_t)j * kv_stride + (int64_t)h * dim + d)
                                         : _mm512_setzero_ps();
                const __m512 b = j + 1 < len
                                     ? _mm512_loadu_ps(v + (int64_t)(j + 1) * kv_stride + (int64_t)h * dim + d)
                                     : _mm512_setzero_ps();
                _mm512_storeu_si512(vt + d, pair_bf16(a, b));
            }
        }
    }
}

/* scores[QB][KB] = q tile (bf16 pairs, [QB][dim / 2]) x 64 keys of the packed k, four rows at a time. */
static inline void tile_scores(const uint32_t *qp, const uint32_t *kt, int half, float *scores) {
    for (int r = 0; r < QB; r += 4) {
        __m512 acc[4][4];
        for (int a = 0; a < 4; ++a)
            for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_setzero_ps();
        const uint32_t *q0 = qp + r * half;
        for (int p = 0; p < half; ++p) {
            __m512bh key[4];
            for (int c = 0; c < 4; ++c) key[c] = (__m512bh)_mm512_loadu_si512(kt + ((int64_t)c * half + p) * 16);
            for (int a = 0; a < 4; ++a) {
                const __m512bh query = (__m512bh)_mm512_set1_epi32((int)q0[a * half + p]);
                for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_dpbf16_ps(acc[a][c], query, key[c]);
            }
        }
        for (int a = 0; a < 4; ++a)
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(scores + (r + a) * KB + 16 * c, acc[a][c]);
    }
}

/* acc[QB][dim] = acc * rescale (per row) + weights ([QB][KB / 2] bf16 pairs) x 64 keys of the packed v. */
static inline void tile_values(const uint32_t *weights, const uint32_t *vt, int dim, const float *rescale,
                               float *acc) {
    for (int d0 = 0; d0 < dim; d0 += 64) {
        for (int r = 0; r < QB; r += 4) {
            __m512 out[4][4];
            for (int a = 0; a < 4; ++a) {
                const __m512 s = _mm512_set1_ps(rescale[r + a]);
                for (int c = 0; c < 4; ++c) out[a][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r + a) * dim + d0 + 16 * c), s);
            }
            for (int t = 0; t < KB / 2; ++t) {
                __m512bh value[4];
                for (int c = 0; c < 4; ++c) value[c] = (__m512bh)_mm512_loadu_si512(vt + (int64_t)t * dim + d0 + 16 * c);
                for (int a = 0; a < 4; ++a) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)weights[(r + a) * (KB / 2) + t]);
                    for (int c = 0; c < 4; ++c) out[a][c] = _mm512_dpbf16_ps(out[a][c], w, value[c]);
                }
            }
            for (int a = 0; a < 4; ++a)
                for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (r + a) * dim + d0 + 16 * c, out[a][c]);
        }
    }
}

int prefill_attention_bf16(const float *q, const float *k, const float *v, float *out, int n, int len, int heads,
                           int kv_heads, int dim, int64_t q_stride, int64_t kv_stride, int64_t out_stride, float scale,
                           int threads) {
    if (dim % 64 != 0 || dim > 256 || n < 1 || len < n || kv_heads < 1 || heads % kv_heads != 0) return -2;
    if (threads < 1) threads = 1;
    const int half = dim / 2, group = heads / kv_heads, prefix = len - n;
    const int padded = (len + KB - 1) / KB * KB;
    uint32_t *kp = aligned_alloc(64, sizeof(uint32_t) * (size_t)kv_heads * padded * half);
    uint32_t *vp = aligned_alloc(64, sizeof(uint32_t) * (size_t)kv_heads * padded * half);
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return -3;
    }
    pack_kv(k, v, kv_stride, len, padded, kv_heads, dim, kp, vp, threads);
    const int blocks = (n + QB - 1) / QB;
    const float log2e_scale = scale * 1.4426950408889634f; /* scores in base 2: exp2 instead of exp */
#pragma omp parallel num_threads(threads)
    {
        uint32_t qp[QB * 128];
        uint32_t weights[QB * KB / 2];
        float scores[QB * KB];
        float acc[QB * 256];
        float row_max[QB], row_sum[QB], rescale[QB];
        /* Longest tasks (the last query blocks see the most keys) first, so the threads finish together. */
#pragma omp for schedule(dynamic, 1)
        for (int task = blocks * heads - 1; task >= 0; --task) {
            const int block = task / heads, h = task % heads, kvh = h / group;
            const int i0 = block * QB, rows = n - i0 < QB ? n - i0 : QB;
            for (int r = 0; r < QB; ++r) {
                row_max[r] = MASKED;
                row_sum[r] = 0.0f;
                if (r < rows) {
                    const float *src = q + (int64_t)(i0 + r) * q_stride + (int64_t)h * dim;
                    const __m512 s = _mm512_set1_ps(log2e_scale);
                    for (int d = 0; d < dim; d += 32) {
                        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d + 16), s),
                                                                          _mm512_mul_ps(_mm512_loadu_ps(src + d), s));
                        _mm512_storeu_si512(qp + r * half + d / 2, both);
                    }
                } else {
                    memset(qp + r * half, 0, sizeof(uint32_t) * half);
                }
            }
            memset(acc, 0, sizeof(float) * QB * dim);
            const int last_key = prefix + i0 + rows - 1; /* the block's last row sees keys up to here */
            for (int j0 = 0; j0 <= last_key; j0 += KB) {
                tile_scores(qp, kp + ((int64_t)kvh * (padded / 16) + j0 / 16) * half * 16, half, scores);
                for (int r = 0; r < QB; ++r) {
                    float *s = scores + r * KB;
                    const int visible = prefix + i0 + r - j0 + 1; /* keys of this tile row r sees */
                    if (visible < KB) /* the diagonal (and padded rows): mask the keys after the row's own */
                        for (int c = visible < 0 ? 0 : visible; c < KB; ++c) s[c] = MASKED;
                    __m512 x[4];
                    __m512 top = _mm512_set1_ps(row_max[r]);
                    for (int c = 0; c < 4; ++c) {
                        x[c] = _mm512_loadu_ps(s + 16 * c);
                        top = _mm512_max_ps(top, x[c]);
                    }
                    const float new_max = _mm512_reduce_max_ps(top);
                    /* rows masked to here keep MASKED: their weights are 0 (exp2_neg's clamp) and sum stays 0 */
                    const __m512 m = _mm512_set1_ps(new_max);
                    __m512 sum = _mm512_setzero_ps();
                    for (int c = 0; c < 4; ++c) {
                        x[c] = exp2_neg(_mm512_sub_ps(x[c], m));
                        sum = _mm512_add_ps(sum, x[c]);
                    }
                    const float factor = row_max[r] == MASKED ? 0.0f : exp2f(row_max[r] - new_max);
                    rescale[r] = factor;
                    row_sum[r] = row_sum[r] * factor + _mm512_reduce_add_ps(sum);
                    row_max[r] = new_max;
                    _mm512_storeu_si512(weights + r * (KB / 2), (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
                    _mm512_storeu_si512(weights + r * (KB / 2) + 16, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
                }
                tile_values(weights, vp + ((int64_t)kvh * (padded / 2) + j0 / 2) * dim, dim, rescale, acc);
            }
            for (int r = 0; r < rows; ++r) {
                float *dst = out + (int64_t)(i0 + r) * out_stride + (int64_t)h * dim;
                const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
                for (int d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + d), inv));
            }
        }
    }
    free(kp);
    free(vp);
    return 0;
}

#else

int prefill_attention_bf16(const float *q, const float *k, const float *v, float *out, int n, int len, int heads,
                           int kv_heads, int dim, int64_t q_stride, int64_t kv_stride, int64_t out_stride, float scale,
                           int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)n, (void)len, (void)heads, (void)kv_heads, (void)dim;
    (void)q_stride, (void)kv_stride, (void)out_stride, (void)scale, (void)threads;
    return -1;
}

#endif
