/*
 * The GGUF matmuls with AVX2 (ymm): the baseline SIMD path, for CPUs without AVX512 (the AMD EPYC
 * of an earlier session). The same scheme as gguf_matmul_avx512.c on half a tile at a time
 * (8 weight rows: 32 bytes of each 64-byte k-quad vector of gguf.h's layout).
 *
 * int8 activations: with 256-bit VNNI (AVX-VNNI, or AVX512-VNNI's ymm form) one vpdpbusd per
 * k-quad; without it maddubs + madd, as llama.cpp's AVX2 code does: pairs of maddubs products
 * summed in int16 first where they cannot overflow (4-, 5- and 6-bit quants), and Q8_0's unsigned
 * q + 128 turned back into signed bytes with the sign trick (maddubs saturates above 32767).
 * float32 activations: shift, mask, convert, one FMA to dequantize, one FMA per activation row.
 * Functions return -1 where this build lacks the instructions (the dispatch falls through).
 */
#include "gguf.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2 1
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVXVNNI__)
#define HAVE_VNNI256 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI256 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif

INLINE __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* As in gguf_matmul_avx512.c: the weights 8 KiB ahead, into L2. */
#define PREFETCH_BYTES 8192
INLINE void prefetch_ahead(const uint8_t *tile, int bytes) {
    for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)tile + PREFETCH_BYTES + at, _MM_HINT_T1);
}

INLINE __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* The 8 k-quad vectors of sub-tile `sub` for rows 8h..8h+7: v[t] = 8 rows x columns 4t..4t+3. */
INLINE void quads(const int format, const uint8_t *tile, int sub, int half, __m256i v[8]) {
    const int at = 32 * half;
    if (format == GG_Q8_0) {
        for (int t = 0; t < 8; ++t) v[t] = load32(tile + 32 + 64 * t + at);
        return;
    }
    const uint8_t *qs = tile + gg_nibbles_at(format, sub);
    if (gg_low2(format)) { /* bits 0-1 of k-quad 4h + j at bit pair j of vector h; Q3_K's bit 2 of k-quad t at
                              bit t of the third (16-bit shifts: no bit of the neighbouring byte lands there) */
        const __m256i two = _mm256_set1_epi8(0x03), bit2 = _mm256_set1_epi8(0x04);
        for (int h = 0; h < 2; ++h) {
            const __m256i low2 = load32(qs + 64 * h + at);
            v[4 * h] = _mm256_and_si256(low2, two);
            v[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(low2, 2), two);
            v[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(low2, 4), two);
            v[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(low2, 6), two);
        }
        if (format == GG_Q2_K) return;
        const __m256i third = load32(qs + 128 + at);
        for (int t = 0; t < 8; ++t) {
            const __m256i bit = t < 2 ? _mm256_slli_epi16(third, 2 - t) : _mm256_srli_epi16(third, t - 2);
            v[t] = _mm256_or_si256(v[t], _mm256_and_si256(bit, bit2));
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
        const __m256i packed = load32(qs + 64 * c + at);
        v[2 * c] = _mm256_and_si256(packed, low);
        v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    if (format == GG_Q6_K) {
        const __m256i mask = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; ++h) {
            const __m256i high = load32(qs + 256 + 64 * h + at);
            v[4 * h] = _mm256_or_si256(v[4 * h], _mm256_and_si256(_mm256_slli_epi16(high, 4), mask));
            v[4 * h + 1] = _mm256_or_si256(v[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(high, 2), mask));
            v[4 * h + 2] = _mm256_or_si256(v[4 * h + 2], _mm256_and_si256(high, mask));
            v[4 * h + 3] = _mm256_or_si256(v[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(high, 2), mask));
        }
    }
    if (gg_fifth_bit(format)) { /* as in the AVX512 file: bit t of the qh vector to bit 4 of k-quad t */
        const __m256i high = load32(qs + 256 + at), mask = _mm256_set1_epi8(0x10);
        for (int t = 0; t < 8; ++t) {
            const __m256i bit = t < 4 ? _mm256_slli_epi16(high, 4 - t) : _mm256_srli_epi16(high, t - 4);
            v[t] = _mm256_or_si256(v[t], _mm256_and_si256(bit, mask));
        }
    }
}

/* As in the AVX512 file, for rows 8h..8h+7. */
INLINE void scales(const int format, const uint8_t *tile, int sub, int half, __m256 *a0, __m256 *a1, __m256 *b0,
                   __m256 *b1) {
    const int lane = 8 * half;
    const __m256 d = half8(tile + 2 * lane);
    if (format == GG_Q2_K) {
        const __m256 dmin = half8(tile + 32 + 2 * lane);
        const __m256i nibble = _mm256_set1_epi32(0x0F);
        for (int h = 0; h < 2; ++h) {
            const __m256i scm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + GG_Q2K_SC + 32 * sub + 16 * h + lane)));
            const __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(scm, nibble)));
            const __m256 b = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(scm, 4))));
            *(h ? a1 : a0) = a;
            *(h ? b1 : b0) = b;
        }
        return;
    }
    if (gg_q4k_scales(format)) {
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + GG_Q4K_SC + 16 * sub + lane))));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + GG_Q4K_MN + 16 * sub + lane))));
        *a0 = *a1 = _mm256_mul_ps(d, sc);
        *b0 = *b1 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(half8(tile + 32 + 2 * lane), mn));
        return;
    }
    if (gg_per16(format)) { /* Q6_K, Q3_K (Q2_K above) */
        const uint8_t *sc = tile + GG_Q6K_SC + 32 * sub + lane;
        *a0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
        *a1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16)))));
        *b0 = _mm256_mul_ps(*a0, _mm256_set1_ps(-(float)gg_offset(format)));
        *b1 = _mm256_mul_ps(*a1, _mm256_set1_ps(-(float)gg_offset(format)));
        return;
    }
    *a0 = *a1 = d;
    *b0 = *b1 = gg_has_min(format) ? half8(tile + 32 + 2 * lane) : _mm256_mul_ps(d, _mm256_set1_ps(-(float)gg_offset(format)));
}

INLINE void store_rows(const int MR, const __m256 *acc, float *y, int ldy, int i0, int first_row, int rows, int accumulate) {
    const int valid = rows - first_row < 8 ? rows - first_row : 8;
    for (int i = 0; i < MR; ++i) {
        float *dst = y + (int64_t)(i0 + i) * ldy + first_row;
        if (valid == 8) {
            _mm256_storeu_ps(dst, accumulate ? _mm256_add_ps(acc[i], _mm256_loadu_ps(dst)) : acc[i]);
        } else {
            float out[8];
            _mm256_storeu_ps(out, acc[i]);
            for (int r = 0; r < valid; ++r) dst[r] = accumulate ? dst[r] + out[r] : out[r];
        }
    }
}

INLINE void f32_rows(const int format, const int MR, const gg_matrix *w, const float *x, int ldx, int i0, int g, int half,
                     float *y, int ldy, int accumulate) {
    const int tile_k = gg_tile_k[format], tiles = w->cols / tile_k, subs = tile_k / GG_SUB;
    const uint8_t *group = w->data + g * gg_group_bytes(format, w->cols);
    const __m256i byte = _mm256_set1_epi32(0xFF);
    __m256 acc[4]; /* MR <= 4; a fixed size: an array sized by MR is a VLA on the stack, not registers */
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    for (int t = 0; t < tiles; ++t) {
        const uint8_t *tile = group + (int64_t)t * gg_tile_bytes[format];
        for (int sub = 0; sub < subs; ++sub) {
            __m256i v[8];
            __m256 a0, a1, b0, b1;
            quads(format, tile, sub, half, v);
            scales(format, tile, sub, half, &a0, &a1, &b0, &b1);
            const float *xs = x + (int64_t)i0 * ldx + t * tile_k + sub * GG_SUB;
            for (int quad = 0; quad < 8; ++quad) {
                const __m256 a = quad < 4 ? a0 : a1, bb = quad < 4 ? b0 : b1;
                for (int kk = 0; kk < 4; ++kk) {
                    const __m256i q = kk == 3 ? _mm256_srli_epi32(v[quad], 24)
                                              : _mm256_and_si256(_mm256_srli_epi32(v[quad], 8 * kk), byte);
                    const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), a, bb);
                    for (int i = 0; i < MR; ++i)
                        acc[i] = _mm256_fmadd_ps(wv, _mm256_broadcast_ss(xs + (int64_t)i * ldx + 4 * quad + kk), acc[i]);
                }
            }
        }
    }
    store_rows(MR, acc, y, ldy, i0, g * GG_ROWS + 8 * half, w->rows, accumulate);
}

INLINE void f32_format(const int format, const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0,
                       int g1, int accumulate) {
    for (int g = g0; g < g1; ++g)
        for (int half = 0; half < 2 && g * GG_ROWS + 8 * half < w->rows; ++half) {
            int i0 = 0;
            for (; i0 + 4 <= m; i0 += 4) f32_rows(format, 4, w, x, ldx, i0, g, half, y, ldy, accumulate);
            for (; i0 < m; ++i0) f32_rows(format, 1, w, x, ldx, i0, g, half, y, ldy, accumulate);
        }
}

int gg_f32_avx2(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate) {
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

INLINE int hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* gg_quantize_row_portable's operations, 8 lanes at a time (cvtps2dq rounds to nearest even, as the
   scalar conversion there does under the same MXCSR). */
int gg_quantize_row_avx2(const float *x, gg_act8 *out, int i) {
    const int k = out->k, blocks = k / GG_SUB, levels = out->levels;
    const __m256 sign = _mm256_set1_ps(-0.0f), scale = _mm256_set1_ps(254.0f);
    for (int b = 0; b < blocks; ++b) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(x + b * GG_SUB + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 4; ++j) v[j] = _mm256_mul_ps(v[j], _mm256_set1_ps(inverse));
        for (int level = 0; level < levels; ++level) {
            const int64_t row = (int64_t)i * levels + level;
            __m256i q[4];
            for (int j = 0; j < 4; ++j) {
                if (level > 0) v[j] = _mm256_mul_ps(v[j], scale);
                q[j] = _mm256_cvtps_epi32(v[j]);
            }
            /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
            const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(out->q + row * k + b * GG_SUB), bytes);
            const int s0 = hsum8(_mm256_add_epi32(q[0], q[1])), s1 = hsum8(_mm256_add_epi32(q[2], q[3]));
            const float d_level = level == 0 ? d : d / 254.0f;
            out->d[row * blocks + b] = d_level;
            out->s[row * blocks + b] = d_level * (float)(s0 + s1);
            out->sum16[(row * blocks + b) * 2] = s0;
            out->sum16[(row * blocks + b) * 2 + 1] = s1;
            for (int j = 0; j < 4; ++j) v[j] = _mm256_sub_ps(v[j], _mm256_cvtepi32_ps(q[j]));
        }
    }
    return 0;
}

INLINE __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The two half sums (k-quads 0-3, 4-7) of a sub-tile row block against 32 activation bytes. */
INLINE void dots(const int format, const int vnni, const __m256i v[8], const int8_t *xq, __m256i *s0, __m256i *s1) {
#if defined(HAVE_VNNI256)
    if (vnni) {
        __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
        for (int t = 0; t < 4; ++t) {
            a = DPBUSD(a, v[t], broadcast4(xq + 4 * t));
            c = DPBUSD(c, v[t + 4], broadcast4(xq + 16 + 4 * t));
        }
        *s0 = a;
        *s1 = c;
        return;
    }
#else
    (void)vnni;
#endif
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[2];
    for (int h = 0; h < 2; ++h) {
        __m256i acc = _mm256_setzero_si256();
        for (int p = 0; p < 2; ++p) {
            const int t = 4 * h + 2 * p;
            const __m256i x0 = broadcast4(xq + 4 * t), x1 = broadcast4(xq + 4 * t + 4);
            if (format == GG_Q8_0) { /* signed weights again; |w| x sign(x, w) keeps maddubs below saturation */
                const __m256i flip = _mm256_set1_epi8((char)0x80);
                const __m256i w0 = _mm256_xor_si256(v[t], flip), w1 = _mm256_xor_si256(v[t + 1], flip);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0)), ones));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1)), ones));
            } else { /* two pairs of products of 4- to 6-bit quants: at most 4 * 63 * 128 < 32768 */
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(v[t], x0), _mm256_maddubs_epi16(v[t + 1], x1));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
            }
        }
        sums[h] = acc;
    }
    *s0 = sums[0];
    *s1 = sums[1];
}

INLINE void i8_rows(const int format, const int MR, const int LEVELS, const int vnni, const gg_matrix *w, const gg_act8 *x, int i0, int g,
                    int half, float *y, int ldy, int accumulate) {
    const int tile_k = gg_tile_k[format], tiles = w->cols / tile_k, subs = tile_k / GG_SUB;
    const int k = x->k, blocks = k / GG_SUB;
    /* Q8_0 without VNNI: the sign trick already took the signed weights, nothing to subtract */
    const int offset = format == GG_Q8_0 && !vnni ? 0 : gg_offset(format);
    const uint8_t *group = w->data + g * gg_group_bytes(format, w->cols);
    __m256 acc[4]; /* MR <= 4; a fixed size: an array sized by MR is a VLA on the stack, not registers */
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    for (int t = 0; t < tiles; ++t) {
        const uint8_t *tile = group + (int64_t)t * gg_tile_bytes[format];
        if (half == 0) prefetch_ahead(tile, gg_tile_bytes[format]);
        for (int sub = 0; sub < subs; ++sub) {
            __m256i v[8];
            __m256 a0, a1, b0, b1;
            quads(format, tile, sub, half, v);
            scales(format, tile, sub, half, &a0, &a1, &b0, &b1);
            const int block = t * (tile_k / GG_SUB) + sub;
            for (int i = 0; i < MR * LEVELS; ++i) { /* activation row i / LEVELS, level i % LEVELS */
                const int64_t row = (int64_t)i0 * LEVELS + i;
                __m256i s0, s1;
                dots(format, vnni, v, x->q + row * k + block * GG_SUB, &s0, &s1);
                const __m256 xd = _mm256_set1_ps(x->d[row * blocks + block]);
                const int32_t *sums = x->sum16 + (row * blocks + block) * 2;
                if (gg_per16(format)) {
                    s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(offset * sums[0]));
                    s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(offset * sums[1]));
                    acc[i / LEVELS] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(a0, xd), acc[i / LEVELS]);
                    acc[i / LEVELS] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(a1, xd), acc[i / LEVELS]);
                    if (format == GG_Q2_K) { /* the minimums times each half's sum of quantized activations */
                        const float xs = x->d[row * blocks + block];
                        acc[i / LEVELS] = _mm256_fmadd_ps(b0, _mm256_set1_ps(xs * (float)sums[0]), acc[i / LEVELS]);
                        acc[i / LEVELS] = _mm256_fmadd_ps(b1, _mm256_set1_ps(xs * (float)sums[1]), acc[i / LEVELS]);
                    }
                } else if (offset || format == GG_Q8_0) {
                    const __m256i s = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), _mm256_set1_epi32(offset * (sums[0] + sums[1])));
                    acc[i / LEVELS] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(a0, xd), acc[i / LEVELS]);
                } else {
                    acc[i / LEVELS] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), _mm256_mul_ps(a0, xd), acc[i / LEVELS]);
                    acc[i / LEVELS] = _mm256_fmadd_ps(b0, _mm256_set1_ps(x->s[row * blocks + block]), acc[i / LEVELS]);
                }
            }
        }
    }
    store_rows(MR, acc, y, ldy, i0, g * GG_ROWS + 8 * half, w->rows, accumulate);
}

/*
 * int8x2 activations without VNNI, many rows: both levels of a block as one int16 (gg_act8.q16,
 * 254 * q1 + q2 at scale d / 254: the same value), the weights widened to int16 once per sub-tile for
 * every activation row, and one vpmaddwd per 2 columns x 8 rows, against the maddubs path's two
 * levels of maddubs and madd per 4 columns (Q8_0's signed weights two signs more, without the pair
 * trick), which unpacks the weights again for every 4 activation rows. One core of the AVX2 EPYC
 * (Zen 3), a 3072 x 1024 matrix, best of 5: at 16 rows Q4_0 1.42 ms against 1.60, Q4_1 1.40 / 1.67,
 * Q4_K 1.37 / 1.65, Q6_K 1.25 / 1.91, Q5_K 1.37 / 1.82; at 6 rows Q4_1 0.58 / 0.63; at 4 rows the
 * maddubs path is ahead (Q4_1 0.41 / 0.43). Q8_0 (SmolLM2's LM head, 49152 x 576) gains from 2 rows:
 * 16 rows 13.3 ms against 22.4. One row stays on maddubs: no batch shares the widened weights.
 *
 * Lanes: widening the low 16 bytes of k-quad vector v[t] of half h gives weight rows 8h..8h+3 (a
 * "quarter") as [row, columns 4t,4t+1 | row, columns 4t+2,4t+3] int16 pairs, the high 16 bytes rows
 * 8h+4..8h+7; madd against the activation row's 4 int16 values broadcast leaves two partial sums per
 * weight row side by side, and one phaddd per half adds them: lanes [8h + 0 1 4 5 | 2 3 6 7] (ORDER).
 * Each half's float accumulator per activation row stays in a stack block across the k loop.
 */
#define I16_ROWS 16
#define I16_MIN_ROWS 5 /* activation rows from which this path wins (by the figures above) */
#define I16_MIN_ROWS_Q8_0 GG_Q16_MIN_ROWS
#define I16_ORDER 0, 1, 4, 5, 2, 3, 6, 7

INLINE __m256i widen16(const int format, __m128i bytes) {
    if (format == GG_Q8_0) return _mm256_cvtepi8_epi16(_mm_xor_si128(bytes, _mm_set1_epi8((char)0x80))); /* q - 128 */
    return _mm256_cvtepu8_epi16(bytes);
}

/* MR activation rows (from i0) by one sub-tile's 16 weight rows (w16 [k-quad][quarter], a and b per
   part of 16 columns and half, in ORDER) into acc [row][half]. */
INLINE void i16_block(const int format, const int MR, const __m256i w16[8][4], const __m256 a[2][2], const __m256 b[2][2],
                      const gg_act8 *x, int i0, int block, __m256 *acc) {
    const int k = x->k, blocks = k / GG_SUB;
    const int16_t *q16 = x->q16 + (int64_t)i0 * k + block * GG_SUB;
    const int offset = format == GG_Q8_0 ? 0 : gg_offset(format); /* Q8_0: widened signed */
    const int parts = gg_per16(format) ? 2 : 1;
    for (int part = 0; part < parts; ++part) {
        __m256i sums[2][4]; /* MR <= 2 */
        for (int i = 0; i < MR; ++i)
            for (int q = 0; q < 4; ++q) sums[i][q] = _mm256_setzero_si256();
        for (int t = 8 / parts * part; t < 8 / parts * (part + 1); ++t) {
            __m256i xs[2];
            for (int i = 0; i < MR; ++i) {
                int64_t four;
                memcpy(&four, q16 + (int64_t)i * k + 4 * t, 8);
                xs[i] = _mm256_set1_epi64x(four);
            }
            for (int q = 0; q < 4; ++q)
                for (int i = 0; i < MR; ++i) sums[i][q] = _mm256_add_epi32(sums[i][q], _mm256_madd_epi16(w16[t][q], xs[i]));
        }
        for (int i = 0; i < MR; ++i) {
            const int64_t row = (int64_t)(i0 + i) * 2 + 1; /* level 2's scale is d / 254: q16's */
            const float xd = x->d[row * blocks + block];
            const int32_t *first = x->sum16 + ((row - 1) * blocks + block) * 2, *second = x->sum16 + (row * blocks + block) * 2;
            int32_t total = 0; /* the int16 values' sum over this part's columns */
            for (int h = parts == 2 ? part : 0; h < (parts == 2 ? part + 1 : 2); ++h) total += 254 * first[h] + second[h];
            const float min_factor = format == GG_Q2_K ? xd * (float)total
                                     : gg_has_min(format) ? x->s[(row - 1) * blocks + block] + x->s[row * blocks + block] : 0.0f;
            for (int half = 0; half < 2; ++half) {
                __m256i dot = _mm256_hadd_epi32(sums[i][2 * half], sums[i][2 * half + 1]);
                if (offset) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * total));
                __m256 out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(a[part][half], _mm256_set1_ps(xd)), acc[2 * i + half]);
                if (gg_has_min(format) || format == GG_Q2_K) out = _mm256_fmadd_ps(b[part][half], _mm256_set1_ps(min_factor), out);
                acc[2 * i + half] = out;
            }
        }
    }
}

INLINE void i16_format(const int format, const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate) {
    const int tile_k = gg_tile_k[format], tiles = w->cols / tile_k, subs = tile_k / GG_SUB;
    const __m256i order = _mm256_setr_epi32(I16_ORDER);
    __m256 acc[I16_ROWS * 2]; /* [activation row][half of the 16 weight rows], lanes in ORDER */
    for (int g = g0; g < g1; ++g) {
        const uint8_t *group = w->data + g * gg_group_bytes(format, w->cols);
        for (int r0 = 0; r0 < x->m; r0 += I16_ROWS) {
            const int rows = x->m - r0 < I16_ROWS ? x->m - r0 : I16_ROWS;
            for (int i = 0; i < 2 * rows; ++i) acc[i] = _mm256_setzero_ps();
            for (int t = 0; t < tiles; ++t) {
                const uint8_t *tile = group + (int64_t)t * gg_tile_bytes[format];
                if (r0 == 0) prefetch_ahead(tile, gg_tile_bytes[format]);
                for (int sub = 0; sub < subs; ++sub) {
                    __m256i w16[8][4];
                    __m256 a[2][2], b[2][2];
                    for (int half = 0; half < 2; ++half) {
                        __m256i v[8];
                        __m256 a0, a1, b0, b1;
                        quads(format, tile, sub, half, v);
                        scales(format, tile, sub, half, &a0, &a1, &b0, &b1);
                        for (int t8 = 0; t8 < 8; ++t8) {
                            w16[t8][2 * half] = widen16(format, _mm256_castsi256_si128(v[t8]));
                            w16[t8][2 * half + 1] = widen16(format, _mm256_extracti128_si256(v[t8], 1));
                        }
                        a[0][half] = _mm256_permutevar8x32_ps(a0, order);
                        a[1][half] = _mm256_permutevar8x32_ps(a1, order);
                        b[0][half] = _mm256_permutevar8x32_ps(b0, order);
                        b[1][half] = _mm256_permutevar8x32_ps(b1, order);
                    }
                    const int block = t * (tile_k / GG_SUB) + sub;
                    int i = 0;
                    for (; i + 2 <= rows; i += 2) i16_block(format, 2, w16, a, b, x, r0 + i, block, acc + 2 * i);
                    for (; i < rows; ++i) i16_block(format, 1, w16, a, b, x, r0 + i, block, acc + 2 * i);
                }
            }
            const int first = g * GG_ROWS, valid = w->rows - first < GG_ROWS ? w->rows - first : GG_ROWS;
            static const int lane_row[8] = {I16_ORDER};
            for (int i = 0; i < rows; ++i) {
                float out[16], lanes[8];
                for (int half = 0; half < 2; ++half) {
                    _mm256_storeu_ps(lanes, acc[2 * i + half]);
                    for (int l = 0; l < 8; ++l) out[8 * half + lane_row[l]] = lanes[l];
                }
                float *dst = y + (int64_t)(r0 + i) * ldy + first;
                for (int r = 0; r < valid; ++r) dst[r] = accumulate ? dst[r] + out[r] : out[r];
            }
        }
    }
}

INLINE void i8_format(const int format, const int vnni, const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0,
                      int g1, int accumulate) {
    if (!vnni && x->levels == 2 && x->q16 != NULL && x->m >= (format == GG_Q8_0 ? I16_MIN_ROWS_Q8_0 : I16_MIN_ROWS)) {
        i16_format(format, w, x, y, ldy, g0, g1, accumulate);
        return;
    }
    for (int g = g0; g < g1; ++g)
        for (int half = 0; half < 2 && g * GG_ROWS + 8 * half < w->rows; ++half) {
            int i0 = 0;
            if (x->levels == 2) {
                for (; i0 + 4 <= x->m; i0 += 4) i8_rows(format, 4, 2, vnni, w, x, i0, g, half, y, ldy, accumulate);
                for (; i0 < x->m; ++i0) i8_rows(format, 1, 2, vnni, w, x, i0, g, half, y, ldy, accumulate);
            } else {
                for (; i0 + 4 <= x->m; i0 += 4) i8_rows(format, 4, 1, vnni, w, x, i0, g, half, y, ldy, accumulate);
                for (; i0 < x->m; ++i0) i8_rows(format, 1, 1, vnni, w, x, i0, g, half, y, ldy, accumulate);
            }
        }
}

#define I8_CASES(VNNI)                                                                                \
    switch (w->format) {                                                                              \
    case GG_Q4_0: i8_format(GG_Q4_0, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q4_1: i8_format(GG_Q4_1, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q8_0: i8_format(GG_Q8_0, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q4_K: i8_format(GG_Q4_K, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q6_K: i8_format(GG_Q6_K, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q5_0: i8_format(GG_Q5_0, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q5_1: i8_format(GG_Q5_1, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q5_K: i8_format(GG_Q5_K, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q3_K: i8_format(GG_Q3_K, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    case GG_Q2_K: i8_format(GG_Q2_K, VNNI, w, x, y, ldy, g0, g1, accumulate); return 0;               \
    default: return -1;                                                                               \
    }

int gg_i8_avx2(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate, int vnni) {
#if defined(HAVE_VNNI256)
    if (vnni) I8_CASES(1)
#else
    if (vnni) return -1;
#endif
    I8_CASES(0)
}
#endif /* AVX2 */

#ifndef HAVE_AVX2
int gg_quantize_row_avx2(const float *x, gg_act8 *out, int i) {
    (void)x, (void)out, (void)i;
    return -1;
}
int gg_f32_avx2(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate) {
    (void)w, (void)x, (void)ldx, (void)m, (void)y, (void)ldy, (void)g0, (void)g1, (void)accumulate;
    return -1;
}
int gg_i8_avx2(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate, int vnni) {
    (void)w, (void)x, (void)y, (void)ldy, (void)g0, (void)g1, (void)accumulate, (void)vnni;
    return -1;
}
#endif

int gg_avx2_built(void) {
#if defined(HAVE_VNNI256)
    return 2;
#elif defined(HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}
