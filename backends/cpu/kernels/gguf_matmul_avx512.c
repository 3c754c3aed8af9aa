/*
 * The GGUF matmuls with AVX512 (zmm, 16 weight rows a vector: one tile of gguf.h's layout).
 *
 * int8 activations (AVX512-VNNI): a sub-tile's 8 k-quad vectors are unpacked once (nibbles split,
 * the Q5 formats' fifth bits, Q6_K's high bits or Q3_K's third bits or'ed in) and, for every activation row,
 * multiplied by 4 activation bytes broadcast to the 16 lanes (vpdpbusd: 64 multiply-adds per
 * instruction, the sums landing one lane per weight row): 8 instructions for 16 rows x 32 columns,
 * then one float scale per row. This is why int8 activations are the fast path: the float path
 * below spends ~5 instructions per 16 weights converting and scaling before its FMA.
 *
 * float32 activations (AVX512F): each k-quad vector gives 4 columns of 16 rows as int32 lanes
 * (shift and mask), converted and dequantized with one FMA (w = a * q + b, rounded once, so the
 * weights are exactly the `gguf` package's), then one FMA per activation row.
 *
 * Activation rows go through in passes of 4 (then 1), reusing each unpacked sub-tile.
 * Functions return -1 where this build lacks the instructions (the dispatch falls through).
 */
#include "gguf.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define HAVE_AVX512 1
#define INLINE static inline __attribute__((always_inline))

INLINE __m512 half16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* The weights stream from memory once per step, in runs of a few hundred KiB (a thread's rows of one
   matrix): asking for them 8 KiB ahead, into L2, keeps more misses in flight than the hardware
   prefetcher does, which stops at every 4 KiB page (one core: ~10 -> ~13 GB/s over 90 MiB). */
#define PREFETCH_BYTES 8192
INLINE void prefetch_ahead(const uint8_t *tile, int bytes) {
    for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)tile + PREFETCH_BYTES + at, _MM_HINT_T1);
}

INLINE __m512i load64(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }

/* The 8 k-quad vectors of sub-tile `sub`: v[t] = rows 0-15 x columns 4t..4t+3, unsigned bytes. */
INLINE void quads(const int format, const uint8_t *tile, int sub, __m512i v[8]) {
    if (format == GG_Q8_0) {
        for (int t = 0; t < 8; ++t) v[t] = load64(tile + 32 + 64 * t);
        return;
    }
    const uint8_t *qs = tile + gg_nibbles_at(format, sub);
    if (gg_low2(format)) { /* bits 0-1 of k-quad 4h + j at bit pair j of vector h; Q3_K's bit 2 of k-quad t at
                              bit t of the third (16-bit shifts: no bit of the neighbouring byte lands there) */
        const __m512i two = _mm512_set1_epi8(0x03), bit2 = _mm512_set1_epi8(0x04);
        for (int h = 0; h < 2; ++h) {
            const __m512i low2 = load64(qs + 64 * h);
            v[4 * h] = _mm512_and_si512(low2, two);
            v[4 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(low2, 2), two);
            v[4 * h + 2] = _mm512_and_si512(_mm512_srli_epi16(low2, 4), two);
            v[4 * h + 3] = _mm512_and_si512(_mm512_srli_epi16(low2, 6), two);
        }
        if (format == GG_Q2_K) return;
        const __m512i third = load64(qs + 128);
        for (int t = 0; t < 8; ++t) {
            const __m512i bit = t < 2 ? _mm512_slli_epi16(third, 2 - t) : _mm512_srli_epi16(third, t - 2);
            v[t] = _mm512_or_si512(v[t], _mm512_and_si512(bit, bit2));
        }
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
        const __m512i packed = load64(qs + 64 * c);
        v[2 * c] = _mm512_and_si512(packed, low);
        v[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    if (format == GG_Q6_K) { /* bits 4-5 of k-quad 4h + j sit at bit pair j of vector h */
        const __m512i mask = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; ++h) {
            const __m512i high = load64(qs + 256 + 64 * h);
            v[4 * h] = _mm512_or_si512(v[4 * h], _mm512_and_si512(_mm512_slli_epi16(high, 4), mask));
            v[4 * h + 1] = _mm512_or_si512(v[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(high, 2), mask));
            v[4 * h + 2] = _mm512_or_si512(v[4 * h + 2], _mm512_and_si512(high, mask));
            v[4 * h + 3] = _mm512_or_si512(v[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(high, 2), mask));
        }
    }
    if (gg_fifth_bit(format)) { /* bit 4 of k-quad t sits at bit t: shifted to bit 4 (16-bit shifts of at
                                   most 4 bring no bit of the neighbouring byte there) */
        const __m512i high = load64(qs + 256), mask = _mm512_set1_epi8(0x10);
        for (int t = 0; t < 8; ++t) {
            const __m512i bit = t < 4 ? _mm512_slli_epi16(high, 4 - t) : _mm512_srli_epi16(high, t - 4);
            v[t] = _mm512_or_si512(v[t], _mm512_and_si512(bit, mask));
        }
    }
}

/* Per row of sub-tile `sub`: w = a * q + b, a and b per half of 16 columns (they differ only for the
   per-16 formats: Q6_K, Q3_K, Q2_K). b is the float minimum of Q4_1, Q5_1, Q4_K, Q5_K and Q2_K,
   -offset * a (exact) for the others. */
INLINE void scales(const int format, const uint8_t *tile, int sub, __m512 *a0, __m512 *a1, __m512 *b0, __m512 *b1) {
    const __m512 d = half16(tile);
    if (format == GG_Q2_K) { /* scale in the low nibble, minimum in the high */
        const __m512 dmin = half16(tile + 32);
        const __m512i nibble = _mm512_set1_epi32(0x0F);
        for (int h = 0; h < 2; ++h) {
            const __m512i scm = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + GG_Q2K_SC + 32 * sub + 16 * h)));
            const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(scm, nibble)));
            const __m512 b = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(scm, 4))));
            *(h ? a1 : a0) = a;
            *(h ? b1 : b0) = b;
        }
        return;
    }
    if (gg_q4k_scales(format)) {
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + GG_Q4K_SC + 16 * sub))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + GG_Q4K_MN + 16 * sub))));
        *a0 = *a1 = _mm512_mul_ps(d, sc);
        *b0 = *b1 = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(half16(tile + 32), mn));
        return;
    }
    if (gg_per16(format)) { /* Q6_K, Q3_K (Q2_K above) */
        const uint8_t *sc = tile + GG_Q6K_SC + 32 * sub;
        *a0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
        *a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16)))));
        *b0 = _mm512_mul_ps(*a0, _mm512_set1_ps(-(float)gg_offset(format)));
        *b1 = _mm512_mul_ps(*a1, _mm512_set1_ps(-(float)gg_offset(format)));
        return;
    }
    *a0 = *a1 = d;
    *b0 = *b1 = gg_has_min(format) ? half16(tile + 32) : _mm512_mul_ps(d, _mm512_set1_ps(-(float)gg_offset(format)));
}

/* acc[i] (16 rows) stored to y's row i0 + i, columns 16g.., only the rows the matrix has. */
INLINE void store_rows(const int MR, const __m512 *acc, float *y, int ldy, int i0, int g, int rows, int accumulate) {
    const int valid = rows - g * GG_ROWS < GG_ROWS ? rows - g * GG_ROWS : GG_ROWS;
    const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
    for (int i = 0; i < MR; ++i) {
        float *dst = y + (int64_t)(i0 + i) * ldy + g * GG_ROWS;
        __m512 value = acc[i];
        if (accumulate) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, dst));
        _mm512_mask_storeu_ps(dst, mask, value);
    }
}

INLINE void f32_rows(const int format, const int MR, const gg_matrix *w, const float *x, int ldx, int i0, int g,
                     float *y, int ldy, int accumulate) {
    const int tile_k = gg_tile_k[format], tiles = w->cols / tile_k, subs = tile_k / GG_SUB;
    const uint8_t *group = w->data + g * gg_group_bytes(format, w->cols);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    __m512 acc[4]; /* MR <= 4; a fixed size: an array sized by MR is a VLA on the stack, not registers */
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int t = 0; t < tiles; ++t) {
        const uint8_t *tile = group + (int64_t)t * gg_tile_bytes[format];
        for (int sub = 0; sub < subs; ++sub) {
            __m512i v[8];
            __m512 a0, a1, b0, b1;
            quads(format, tile, sub, v);
            scales(format, tile, sub, &a0, &a1, &b0, &b1);
            const float *xs = x + (int64_t)i0 * ldx + t * tile_k + sub * GG_SUB;
            for (int quad = 0; quad < 8; ++quad) {
                const __m512 a = quad < 4 ? a0 : a1, bb = quad < 4 ? b0 : b1;
                for (int kk = 0; kk < 4; ++kk) {
                    const __m512i q = kk == 3 ? _mm512_srli_epi32(v[quad], 24)
                                              : _mm512_and_si512(_mm512_srli_epi32(v[quad], 8 * kk), byte);
                    const __m512 wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), a, bb);
                    for (int i = 0; i < MR; ++i)
                        acc[i] = _mm512_fmadd_ps(wv, _mm512_set1_ps(xs[(int64_t)i * ldx + 4 * quad + kk]), acc[i]);
                }
            }
        }
    }
    store_rows(MR, acc, y, ldy, i0, g, w->rows, accumulate);
}

INLINE void f32_format(const int format, const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0,
                       int g1, int accumulate) {
    for (int g = g0; g < g1; ++g) {
        int i0 = 0;
        for (; i0 + 4 <= m; i0 += 4) f32_rows(format, 4, w, x, ldx, i0, g, y, ldy, accumulate);
        for (; i0 < m; ++i0) f32_rows(format, 1, w, x, ldx, i0, g, y, ldy, accumulate);
    }
}

/* gg_quantize_row_portable's operations, 16 lanes at a time (cvtps2dq rounds to nearest even, as
   the scalar conversion there does under the same MXCSR). */
int gg_quantize_row_avx512(const float *x, gg_act8 *out, int i) {
    const int k = out->k, blocks = k / GG_SUB, levels = out->levels;
    const __m512 scale = _mm512_set1_ps(254.0f);
    for (int b = 0; b < blocks; ++b) {
        const __m512 x0 = _mm512_loadu_ps(x + b * GG_SUB), x1 = _mm512_loadu_ps(x + b * GG_SUB + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        __m512 v0 = _mm512_mul_ps(x0, _mm512_set1_ps(inverse)), v1 = _mm512_mul_ps(x1, _mm512_set1_ps(inverse));
        for (int level = 0; level < levels; ++level) {
            const int64_t row = (int64_t)i * levels + level;
            if (level > 0) {
                v0 = _mm512_mul_ps(v0, scale);
                v1 = _mm512_mul_ps(v1, scale);
            }
            const __m512i q0 = _mm512_cvtps_epi32(v0), q1 = _mm512_cvtps_epi32(v1);
            int8_t *dst = out->q + row * k + b * GG_SUB;
            _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtsepi32_epi8(q1));
            const int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
            const float d_level = level == 0 ? d : d / 254.0f;
            out->d[row * blocks + b] = d_level;
            out->s[row * blocks + b] = d_level * (float)(s0 + s1);
            out->sum16[(row * blocks + b) * 2] = s0;
            out->sum16[(row * blocks + b) * 2 + 1] = s1;
            v0 = _mm512_sub_ps(v0, _mm512_cvtepi32_ps(q0)); /* what this level left, exact */
            v1 = _mm512_sub_ps(v1, _mm512_cvtepi32_ps(q1));
        }
    }
    return 0;
}

int gg_f32_avx512(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate) {
    switch (w->format) {
    case GG_Q4_0: f32_format(GG_Q4_0, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q4_1: f32_format(GG_Q4_1, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q8_0: f32_format(GG_Q8_0, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q4_K: f32_format(GG_Q4_K, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q6_K: f32_format(GG_Q6_K, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q5_0: f32_format(GG_Q5_0, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q5_1: f32_format(GG_Q5_1, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q5_K: f32_format(GG_Q5_K, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q3_K: f32_format(GG_Q3_K, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q2_K: f32_format(GG_Q2_K, w, x, ldx, m, y, ldy, g0, g1, accumulate); return 0;
    default: return -1;
    }
}

#if defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI 1

INLINE __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

INLINE void i8_rows(const int format, const int MR, const int LEVELS, const gg_matrix *w, const gg_act8 *x, int i0, int g, float *y,
                    int ldy, int accumulate) {
    const int tile_k = gg_tile_k[format], tiles = w->cols / tile_k, subs = tile_k / GG_SUB;
    const int k = x->k, blocks = k / GG_SUB, offset = gg_offset(format);
    const uint8_t *group = w->data + g * gg_group_bytes(format, w->cols);
    __m512 acc[4]; /* MR <= 4; a fixed size: an array sized by MR is a VLA on the stack, not registers */
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int t = 0; t < tiles; ++t) {
        const uint8_t *tile = group + (int64_t)t * gg_tile_bytes[format];
        prefetch_ahead(tile, gg_tile_bytes[format]);
        for (int sub = 0; sub < subs; ++sub) {
            __m512i v[8];
            __m512 a0, a1, b0, b1;
            quads(format, tile, sub, v);
            scales(format, tile, sub, &a0, &a1, &b0, &b1);
            const int block = t * (tile_k / GG_SUB) + sub;
            for (int i = 0; i < MR * LEVELS; ++i) { /* activation row i / LEVELS, level i % LEVELS */
                const int64_t row = (int64_t)i0 * LEVELS + i;
                const int8_t *xq = x->q + row * k + block * GG_SUB;
                __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], broadcast4(xq));
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], broadcast4(xq + 16));
                s0 = _mm512_dpbusd_epi32(s0, v[1], broadcast4(xq + 4));
                s1 = _mm512_dpbusd_epi32(s1, v[5], broadcast4(xq + 20));
                s0 = _mm512_dpbusd_epi32(s0, v[2], broadcast4(xq + 8));
                s1 = _mm512_dpbusd_epi32(s1, v[6], broadcast4(xq + 24));
                s0 = _mm512_dpbusd_epi32(s0, v[3], broadcast4(xq + 12));
                s1 = _mm512_dpbusd_epi32(s1, v[7], broadcast4(xq + 28));
                const __m512 xd = _mm512_set1_ps(x->d[row * blocks + block]);
                const int32_t *sums = x->sum16 + (row * blocks + block) * 2;
                if (gg_per16(format)) { /* a differs per half: the offset too */
                    s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(offset * sums[0]));
                    s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(offset * sums[1]));
                    acc[i / LEVELS] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(a0, xd), acc[i / LEVELS]);
                    acc[i / LEVELS] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(a1, xd), acc[i / LEVELS]);
                    if (format == GG_Q2_K) { /* the minimums times each half's sum of quantized activations */
                        const float xs = x->d[row * blocks + block];
                        acc[i / LEVELS] = _mm512_fmadd_ps(b0, _mm512_set1_ps(xs * (float)sums[0]), acc[i / LEVELS]);
                        acc[i / LEVELS] = _mm512_fmadd_ps(b1, _mm512_set1_ps(xs * (float)sums[1]), acc[i / LEVELS]);
                    }
                } else if (offset) { /* exact: sum (q - offset) xq */
                    const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(offset * (sums[0] + sums[1])));
                    acc[i / LEVELS] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(a0, xd), acc[i / LEVELS]);
                } else { /* the minimum times the block's sum of quantized activations */
                    acc[i / LEVELS] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(a0, xd), acc[i / LEVELS]);
                    acc[i / LEVELS] = _mm512_fmadd_ps(b0, _mm512_set1_ps(x->s[row * blocks + block]), acc[i / LEVELS]);
                }
            }
        }
    }
    store_rows(MR, acc, y, ldy, i0, g, w->rows, accumulate);
}

INLINE void i8_format(const int format, const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1,
                      int accumulate) {
    for (int g = g0; g < g1; ++g) {
        int i0 = 0;
        if (x->levels == 2) { /* the level count as a constant: the row loop unrolls, no division */
            for (; i0 + 4 <= x->m; i0 += 4) i8_rows(format, 4, 2, w, x, i0, g, y, ldy, accumulate);
            for (; i0 < x->m; ++i0) i8_rows(format, 1, 2, w, x, i0, g, y, ldy, accumulate);
        } else {
            for (; i0 + 4 <= x->m; i0 += 4) i8_rows(format, 4, 1, w, x, i0, g, y, ldy, accumulate);
            for (; i0 < x->m; ++i0) i8_rows(format, 1, 1, w, x, i0, g, y, ldy, accumulate);
        }
    }
}

int gg_i8_avx512(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate) {
    switch (w->format) {
    case GG_Q4_0: i8_format(GG_Q4_0, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q4_1: i8_format(GG_Q4_1, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q8_0: i8_format(GG_Q8_0, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q4_K: i8_format(GG_Q4_K, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q6_K: i8_format(GG_Q6_K, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q5_0: i8_format(GG_Q5_0, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q5_1: i8_format(GG_Q5_1, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q5_K: i8_format(GG_Q5_K, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q3_K: i8_format(GG_Q3_K, w, x, y, ldy, g0, g1, accumulate); return 0;
    case GG_Q2_K: i8_format(GG_Q2_K, w, x, y, ldy, g0, g1, accumulate); return 0;
    default: return -1;
    }
}
#endif /* __AVX512VNNI__ */
#endif /* AVX512 */

#ifndef HAVE_AVX512
int gg_quantize_row_avx512(const float *x, gg_act8 *out, int i) {
    (void)x, (void)out, (void)i;
    return -1;
}
int gg_f32_avx512(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate) {
    (void)w, (void)x, (void)ldx, (void)m, (void)y, (void)ldy, (void)g0, (void)g1, (void)accumulate;
    return -1;
}
#endif
#ifndef HAVE_AVX512_VNNI
int gg_i8_avx512(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate) {
    (void)w, (void)x, (void)y, (void)ldy, (void)g0, (void)g1, (void)accumulate;
    return -1;
}
#endif

int gg_avx512_built(void) {
#if defined(HAVE_AVX512_VNNI)
    return 2;
#elif defined(HAVE_AVX512)
    return 1;
#else
    return 0;
#endif
}
