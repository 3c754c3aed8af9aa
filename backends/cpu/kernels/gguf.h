/*
 * gguf.h: the layout the CPU's GGUF kernels read, and what the kernel files share.
 *
 * A GGUF file stores each row of a weight matrix as a run of blocks (32 weights for Q4_0, Q4_1, Q5_0,
 * Q5_1 and Q8_0, 256 for the K-quants), each with its own scales. A decode step multiplies one to
 * sixteen activation rows by every weight row, so the kernels want many weight rows side by side: at load,
 * gguf_repack.c interleaves the blocks of 16 rows into one "tile" per block column (llama.cpp's
 * repack idea, its block_q4_0x8), keeping every bit of every block and nothing else:
 *
 *   the 16 rows' scales (fp16) side by side, so one vector load gives the scale of every row;
 *   the quants in "k-quads": for 4 consecutive columns, the 16 rows' 4 bytes one after another
 *   (64 bytes), so one int8 dot-product instruction (vpdpbusd) multiplies 16 rows by 4 columns
 *   against 4 activation bytes broadcast to every lane, and the lanes end up one per row.
 *
 * Tiles of 16 rows (zero rows pad the last group), in row-group order, then block-column order:
 *
 *   Q4_0 (288 B = 16 x 18): d[16] fp16 | qs[256]             w = d * (q - 8)
 *   Q4_1 (320 B = 16 x 20): d[16] | m[16] | qs[256]          w = d * q + m
 *   Q5_0 (352 B = 16 x 22): d[16] | qs[256] | qh[64]         w = d * (q - 16)
 *   Q5_1 (384 B = 16 x 24): d[16] | m[16] | qs[256] | qh[64] w = d * q + m
 *   Q8_0 (544 B = 16 x 34): d[16] | qs[512] (q + 128)        w = d * (q - 128)
 *   Q4_K (2368 B = 16 x 148, 256 columns): d[16] | dmin[16] | sc[8][16] | mn[8][16] | 8 x qs[256]
 *                                                            w = d * sc[j] * q - dmin * mn[j], j = column / 32
 *   Q5_K (2880 B = 16 x 180, 256 columns): d[16] | dmin[16] | sc[8][16] | mn[8][16] | 8 x (qs[256] | qh[64])
 *                                                            w as Q4_K's
 *   Q6_K (3360 B = 16 x 210, 256 columns): d[16] | sc[16][16] (int8) | 8 x (ql[256] | qh[128])
 *                                                            w = d * sc[i] * (q - 32), i = column / 16
 *   Q3_K (1824 B = 16 x 114, 256 columns): d[16] | sc[16][16] (int8: the 6-bit scale - 32) | 8 x (ql[128] | qh[64])
 *                                                            w = d * sc[i] * (q - 4), i = column / 16
 *   Q2_K (1344 B = 16 x 84, 256 columns): d[16] | dmin[16] | scm[16][16] (the file's byte: scale | min << 4) | 8 x ql[128]
 *                                                            w = d * sc[i] * q - dmin * mn[i], i = column / 16
 *
 * Every format stores an unsigned quant q per weight with w = a * q + b, a and b per row and per
 * 32 columns (per 16 for Q6_K, Q3_K and Q2_K): a "sub-tile" is 16 rows x 32 columns. In a sub-tile, k-quad t
 * (columns 4t..4t+3) of row r is byte 4r + kk of a 64-byte vector:
 *   4-bit quants (qs[256]): chunk c = bytes 64c..64c+63; low nibbles = k-quad 2c, high = 2c + 1;
 *   Q8_0 (qs[512]): k-quad t = bytes 64t..64t+63, q = w + 128 (so int8 dot products need no sign trick);
 *   Q5_0, Q5_1, Q5_K: the low 4 bits as 4-bit quants; the qh[64] after them holds bit 4 of k-quad t
 *   at bit t of byte 4r + kk (a row's 32 fifth bits in its 4 bytes, as in the file's qh, reordered);
 *   Q6_K: the low 4 bits as 4-bit quants in ql; qh[128] = two 64-byte vectors, vector h holding
 *   bits 4-5 of k-quads 4h..4h+3 at bit pairs 0-1, 2-3, 4-5, 6-7;
 *   Q3_K: q = the file's 2 low bits + 4 * its hmask bit (0..7); ql[128] = two 64-byte vectors laid out
 *   as Q6_K's qh (bits 0-1 of k-quads 4h..4h+3 at bit pairs 0-1, 2-3, 4-5, 6-7 of vector h), the
 *   qh[64] after them bit 2 of k-quad t at bit t, as the Q5 formats' fifth bits;
 *   Q2_K: its 2-bit quants as Q3_K's ql[128].
 * Q4_K's and Q5_K's scales and minimums are unpacked from their 6-bit fields (4 more bytes a row:
 * 148 against 144, 180 against 176), so a kernel reads 16 of them with one load; Q3_K's 16 6-bit
 * scales are widened to int8 (114 bytes a row against 110), as Q6_K's.
 */
#ifndef ENGINE_GGUF_H
#define ENGINE_GGUF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

enum { GG_Q4_0 = 0, GG_Q4_1 = 1, GG_Q8_0 = 2, GG_Q4_K = 3, GG_Q6_K = 4, GG_Q5_0 = 5, GG_Q5_1 = 6, GG_Q5_K = 7, GG_Q3_K = 8,
       GG_Q2_K = 9, GG_NFORMATS = 10 };

/* Code paths, the Python side picks the best this CPU has (backends/cpu/features.py). */
enum { GG_PORTABLE = 0, GG_AVX2 = 1, GG_VNNI256 = 2, GG_AVX512 = 3 };

#define GG_ROWS 16 /* rows of a tile */
#define GG_SUB 32  /* columns of a sub-tile */
#define GG_Q16_MIN_ROWS 2 /* the fewest activation rows any kernel reads gg_act8.q16 for (Q8_0's; 5 for the rest) */

static const int gg_tile_k[GG_NFORMATS] = {32, 32, 32, 256, 256, 32, 32, 256, 256, 256};
static const int gg_tile_bytes[GG_NFORMATS] = {288, 320, 544, 2368, 3360, 352, 384, 2880, 1824, 1344};
static const int gg_block_bytes[GG_NFORMATS] = {18, 20, 34, 144, 210, 22, 24, 176, 110, 84}; /* one row of a tile, in the file */

/* Byte offsets inside a tile. */
#define GG_Q4K_SC 64
#define GG_Q4K_MN 192
#define GG_Q4K_QS 320 /* Q5_K's sub-tiles start there too */
#define GG_Q5K_SUB_BYTES 320
#define GG_Q6K_SC 32 /* Q3_K's scales too */
#define GG_Q6K_SUB 288 /* Q3_K's sub-tiles start there too */
#define GG_Q6K_SUB_BYTES 384
#define GG_Q3K_SUB_BYTES 192
#define GG_Q2K_SC 64 /* scm[16][16]: scale in the low nibble, minimum in the high */
#define GG_Q2K_QS 320
#define GG_Q2K_SUB_BYTES 128

/* A weight matrix in the tiled layout (what the Python side passes through ctypes). */
typedef struct {
    const uint8_t *data;
    int32_t format, rows, cols, reserved;
} gg_matrix;

/* Activation rows quantized to int8 per block of 32 (llama.cpp's numerics): q = round(x / d) with
   d = max|x| / 127; s = d * (sum of the block's q), for the minimum term of Q4_1 and Q4_K (Q2_K's: d * sum16);
   sum16: sums of each 16 quants, for the offsets of Q4_0, Q5_0, Q8_0 (pairs), Q6_K and Q3_K.
   levels 2: each row is two int8 rows, i * 2 and i * 2 + 1: the second quantizes what the first
   left (scale d / 254), so x = d * q1 + d / 254 * q2 to 1/64516 of the block's largest (~16 bits);
   the kernels add both rows' products into output row i. */
typedef struct {
    int8_t *q;      /* [m * levels][k] */
    float *d;       /* [m * levels][k / 32] */
    float *s;       /* [m * levels][k / 32] */
    int32_t *sum16; /* [m * levels][k / 16] */
    int16_t *q16;   /* levels 2: [m][k], 254 * q1 + q2 (|.| <= 32385), the same value at scale d / 254 in one
                       int16: the AVX2 kernel without VNNI multiplies it with vpmaddwd (gguf_matmul_avx2.c);
                       NULL where no kernel will read it (gg_act8_place) */
    int32_t m, k, levels;
} gg_act8;

/* A linear layer: parts side by side along the output (q, k and v of one projection may differ
   in format: Q4_K_M files keep v in Q6_K), each writing its own columns of y. */
typedef struct {
    const gg_matrix *parts;
    const float *bias; /* [rows] or NULL: the decode step adds it */
    int32_t nparts, rows;
} gg_linear;

static inline int gg_groups(int rows) { return (rows + GG_ROWS - 1) / GG_ROWS; }
static inline int64_t gg_group_bytes(int format, int cols) {
    return (int64_t)(cols / gg_tile_k[format]) * gg_tile_bytes[format];
}
/* The int offset of formats stored as w = a * (q - offset); 0 for those with a float minimum. */
static inline int gg_offset(int format) {
    return format == GG_Q4_0 ? 8 : format == GG_Q5_0 ? 16 : format == GG_Q8_0 ? 128 : format == GG_Q6_K ? 32 :
           format == GG_Q3_K ? 4 : 0;
}
/* Formats with a scale per 16 columns (a, and Q2_K's b, differ between a sub-tile's halves). */
static inline int gg_per16(int format) { return format == GG_Q6_K || format == GG_Q3_K || format == GG_Q2_K; }
/* Formats whose quants' low bits are 2-bit pairs in ql[128] (Q3_K adds a third bit from qh[64]). */
static inline int gg_low2(int format) { return format == GG_Q3_K || format == GG_Q2_K; }
/* Formats whose rows have a float minimum: w = a * q + b. */
static inline int gg_has_min(int format) {
    return format == GG_Q4_1 || format == GG_Q5_1 || format == GG_Q4_K || format == GG_Q5_K;
}
/* The K-quants with Q4_K's scales: d, dmin, then sc[8][16] and mn[8][16] unpacked to bytes. */
static inline int gg_q4k_scales(int format) { return format == GG_Q4_K || format == GG_Q5_K; }
/* The Q5 formats: a qh[64] of fifth bits after each sub-tile's 4-bit quants. */
static inline int gg_fifth_bit(int format) { return format == GG_Q5_0 || format == GG_Q5_1 || format == GG_Q5_K; }
/* Where sub-tile `sub`'s 4-bit quants start in a tile (every format but Q8_0, whose quants are bytes):
   every kernel unpacks them from here, the Q5 formats and Q6_K then add their high bits from right after.
   Q3_K, Q2_K: where their 2-bit quants start (ql[128], then Q3_K's qh[64]). */
static inline int gg_nibbles_at(int format, int sub) {
    switch (format) {
    case GG_Q4_0:
    case GG_Q5_0: return 32;
    case GG_Q4_1:
    case GG_Q5_1: return 64;
    case GG_Q4_K: return GG_Q4K_QS + 256 * sub;
    case GG_Q5_K: return GG_Q4K_QS + GG_Q5K_SUB_BYTES * sub;
    case GG_Q3_K: return GG_Q6K_SUB + GG_Q3K_SUB_BYTES * sub;
    case GG_Q2_K: return GG_Q2K_QS + GG_Q2K_SUB_BYTES * sub;
    default: return GG_Q6K_SUB + GG_Q6K_SUB_BYTES * sub; /* GG_Q6_K */
    }
}

static inline uint16_t gg_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

#if defined(__F16C__)
static inline float gg_half(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float gg_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while ((mantissa & 0x400u) == 0) {
                mantissa <<= 1;
                --exponent;
            }
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

/*
 * One row of one sub-tile, read from the tiled layout (the portable kernels and the dequantizer):
 * its 32 quants and, per half of 16 columns, a and b with w = a * q + b. For the offset formats
 * b = -offset * a exactly (the offsets are powers of two), so fmaf(q, a, b) rounds once, to the
 * value the `gguf` package's dequantization computes.
 */
static inline void gg_sub_row(int format, const uint8_t *tile, int sub, int lane, uint8_t q[32], float a[2], float b[2]) {
    const uint8_t *qs = tile + gg_nibbles_at(format, sub);
    switch (format) {
    case GG_Q4_0:
    case GG_Q4_1:
    case GG_Q5_0:
    case GG_Q5_1:
        a[0] = gg_half(gg_u16(tile + 2 * lane));
        b[0] = gg_has_min(format) ? gg_half(gg_u16(tile + 32 + 2 * lane)) : -(float)gg_offset(format) * a[0];
        break;
    case GG_Q8_0:
        a[0] = gg_half(gg_u16(tile + 2 * lane));
        b[0] = -128.0f * a[0];
        for (int t = 0; t < 8; ++t)
            for (int kk = 0; kk < 4; ++kk) q[4 * t + kk] = tile[32 + 64 * t + 4 * lane + kk];
        a[1] = a[0];
        b[1] = b[0];
        return;
    case GG_Q4_K:
    case GG_Q5_K: {
        const float d = gg_half(gg_u16(tile + 2 * lane)), dmin = gg_half(gg_u16(tile + 32 + 2 * lane));
        a[0] = d * (float)tile[GG_Q4K_SC + 16 * sub + lane];
        b[0] = -(dmin * (float)tile[GG_Q4K_MN + 16 * sub + lane]);
        break;
    }
    case GG_Q3_K:
    case GG_Q2_K: {
        const float d = gg_half(gg_u16(tile + 2 * lane));
        for (int h = 0; h < 2; ++h) {
            if (format == GG_Q3_K) {
                a[h] = d * (float)(int8_t)tile[GG_Q6K_SC + 16 * (2 * sub + h) + lane];
                b[h] = -4.0f * a[h];
            } else {
                const uint8_t scm = tile[GG_Q2K_SC + 16 * (2 * sub + h) + lane];
                a[h] = d * (float)(scm & 0x0F);
                b[h] = -(gg_half(gg_u16(tile + 32 + 2 * lane)) * (float)(scm >> 4));
            }
        }
        for (int t = 0; t < 8; ++t)
            for (int kk = 0; kk < 4; ++kk) {
                const uint8_t low = qs[64 * (t / 4) + 4 * lane + kk];
                q[4 * t + kk] = (uint8_t)((low >> (2 * (t & 3))) & 3);
                if (format == GG_Q3_K) q[4 * t + kk] |= (uint8_t)(((qs[128 + 4 * lane + kk] >> t) & 1) << 2);
            }
        return;
    }
    default: { /* GG_Q6_K */
        const float d = gg_half(gg_u16(tile + 2 * lane));
        const uint8_t *ql = qs, *qh = ql + 256;
        for (int h = 0; h < 2; ++h) {
            a[h] = d * (float)(int8_t)tile[GG_Q6K_SC + 16 * (2 * sub + h) + lane];
            b[h] = -32.0f * a[h];
        }
        for (int t = 0; t < 8; ++t)
            for (int kk = 0; kk < 4; ++kk) {
                const uint8_t nib = ql[64 * (t / 2) + 4 * lane + kk], high = qh[64 * (t / 4) + 4 * lane + kk];
                q[4 * t + kk] = (uint8_t)(((t & 1) ? nib >> 4 : nib & 0x0F) | (((high >> (2 * (t & 3))) & 3) << 4));
            }
        return;
    }
    }
    for (int t = 0; t < 8; ++t)
        for (int kk = 0; kk < 4; ++kk) {
            const uint8_t byte = qs[64 * (t / 2) + 4 * lane + kk];
            q[4 * t + kk] = (t & 1) ? byte >> 4 : byte & 0x0F;
            if (gg_fifth_bit(format)) q[4 * t + kk] |= (uint8_t)(((qs[256 + 4 * lane + kk] >> t) & 1) << 4);
        }
    a[1] = a[0];
    b[1] = b[0];
}

/* Per code path, y[i][r] (+)= sum_k w[r][k] x[i][k] for the rows of row groups [g0, g1).
   x: float32 [m][ldx]; y: [m][ldy]; accumulate: add to y instead of storing. */
void gg_f32_portable(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate);
void gg_i8_portable(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate);
int gg_f32_avx2(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate);
int gg_i8_avx2(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate, int vnni);
int gg_f32_avx512(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate);
int gg_i8_avx512(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate);
int gg_avx2_built(void);   /* 1 where this build has the AVX2 path (and 2 with 256-bit VNNI too) */
int gg_avx512_built(void); /* 1 where this build has the AVX512 paths (float; int8 needs VNNI: 2) */

/* The dispatch (gguf_matmul.c): the best of the paths above at or below `isa`. */
void gg_matmul_f32(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate, int isa);
void gg_matmul_i8(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate, int isa);
int64_t gg_act8_bytes(int m, int k, int levels);                /* one buffer for m rows of k ... */
void gg_act8_place(gg_act8 *a, void *buffer, int m, int k, int levels, int isa); /* ... its views (isa: of the int8 matmuls) ... */
void gg_quantize_rows(const float *x, int ldx, gg_act8 *out, int isa); /* ... filled from x [m][ldx] */
void gg_quantize_row(const float *x, gg_act8 *out, int i, int isa);    /* ... or its row i from x [k] */
/* The same quantization per code path, bit for bit (the same float32 operations, rounded to nearest
   even by the same MXCSR mode): tests hold them equal. */
void gg_quantize_row_portable(const float *x, gg_act8 *out, int i);
int gg_quantize_row_avx2(const float *x, gg_act8 *out, int i);
int gg_quantize_row_avx512(const float *x, gg_act8 *out, int i);

/* A linear as work items for an OpenMP loop (chunks of `chunk` row groups of each part), and one
   item: x (float32 activations) or a (int8 activations, when not NULL) -> columns of y. */
int gg_linear_items(const gg_linear *l, int chunk);
void gg_linear_item(const gg_linear *l, int item, int chunk, const float *x, int ldx, const gg_act8 *a, int m, float *y,
                    int ldy, int accumulate, int isa_f32, int isa_i8);

/* Rows of the tiled layout back to float32 (gguf_repack.c): the embedding and the prefill path. */
void gg_dequantize_row(const gg_matrix *w, int row, float *out);

#endif
