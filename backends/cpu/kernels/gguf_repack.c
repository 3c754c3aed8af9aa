/*
 * GGUF blocks -> the tiled layout of gguf.h (at load), and tiled rows -> float32 (the embedding's
 * gathered rows, and the prefill path, where one dequantized matrix serves every row of a GEMM).
 *
 * Repacking moves bits, it computes nothing: every scale stays the fp16 the file holds (Q4_K's and
 * Q5_K's 6-bit scales and minimums are widened to bytes, Q3_K's 6-bit scales to int8 scale - 32; Q2_K's
 * 4-bit scale and minimum stay the file's byte), every
 * quant the file's (Q8_0's stored + 128, Q3_K's 2 low bits + 4 * its hmask bit).
 * Dequantizing rounds once per weight, as the `gguf` package does (tests hold them equal).
 */
#include <stdlib.h>

#include "gguf.h"

/* The scale and minimum of sub-block j of a Q4_K or Q5_K block (ggml's get_scale_min_k4). */
static void q4k_scale_min(const uint8_t *scales, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = scales[j] & 63;
        *mn = scales[j + 4] & 63;
    } else {
        *sc = (uint8_t)((scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4));
        *mn = (uint8_t)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

/* The scale of sub-block j (16 columns) of a Q3_K block, minus 32 (ggml's dequantize_row_q3_K):
   low 4 bits from scales[j % 8] (its low nibble for j < 8, high after), high 2 from scales[8 + j % 4]. */
static int8_t q3k_scale(const uint8_t *scales, int j) {
    const int low = (scales[j % 8] >> (4 * (j / 8))) & 0x0F, high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (int8_t)((low | high << 4) - 32);
}

/* The stored quant of column `idx` (within the block) of one GGUF block. */
static uint8_t block_quant(int format, const uint8_t *block, int idx) {
    switch (format) {
    case GG_Q4_0:
    case GG_Q4_1: {
        const uint8_t *qs = block + (format == GG_Q4_1 ? 4 : 2);
        return idx < 16 ? qs[idx] & 0x0F : qs[idx - 16] >> 4;
    }
    case GG_Q5_0:
    case GG_Q5_1: { /* d [m] qh[4] qs[16]: bit 4 of weight idx is bit idx of qh, little-endian */
        const uint8_t *qh = block + (format == GG_Q5_1 ? 4 : 2), *qs = qh + 4;
        const uint8_t low = idx < 16 ? qs[idx] & 0x0F : qs[idx - 16] >> 4;
        return (uint8_t)(low | ((qh[idx / 8] >> (idx % 8)) & 1) << 4);
    }
    case GG_Q8_0:
        return block[2 + idx] ^ 0x80; /* int8 w -> unsigned w + 128 */
    case GG_Q4_K: {
        const uint8_t byte = block[16 + 32 * (idx / 64) + idx % 32];
        return (idx / 32) % 2 ? byte >> 4 : byte & 0x0F;
    }
    case GG_Q5_K: { /* d dmin scales[12] qh[32] qs[128]: bit 4 of sub-block j's weight l is bit j of qh[l] */
        const uint8_t byte = block[48 + 32 * (idx / 64) + idx % 32], high = block[16 + idx % 32];
        return (uint8_t)(((idx / 32) % 2 ? byte >> 4 : byte & 0x0F) | ((high >> (idx / 32)) & 1) << 4);
    }
    case GG_Q3_K: { /* hmask[32] qs[64] scales[12] d: weight 128n + 32j + l is bits 2j..2j+1 of qs[32n + l],
                       its hmask bit bit 4n + j of hmask[l] (set: no -4) */
        const int n = idx / 128, j = (idx % 128) / 32, l = idx % 32;
        const uint8_t low = (block[32 + 32 * n + l] >> (2 * j)) & 3, high = (block[l] >> (idx / 32)) & 1;
        return (uint8_t)(low | high << 2);
    }
    case GG_Q2_K: /* scales[16] qs[64] d dmin: weight 128n + 32j + l is bits 2j..2j+1 of qs[32n + l] */
        return (block[16 + 32 * (idx / 128) + idx % 32] >> (2 * ((idx % 128) / 32))) & 3;
    default: { /* GG_Q6_K: ql[128] qh[64] scales[16] d */
        const int n = idx / 128, t4 = (idx % 128) / 32, l = idx % 32;
        const uint8_t low = block[64 * n + l + 32 * (t4 & 1)], high = block[128 + 32 * n + l];
        return (uint8_t)((t4 < 2 ? low & 0x0F : low >> 4) | (((high >> (2 * t4)) & 3) << 4));
    }
    }
}

/* Row `lane` of one tile from one GGUF block (NULL: a padding row, all zero). */
static void fill_tile_row(int format, uint8_t *tile, int lane, const uint8_t *block) {
    const int k = gg_tile_k[format];
    uint8_t zero[210] = {0};
    if (block == NULL) block = zero;
    /* scales */
    switch (format) {
    case GG_Q4_0:
    case GG_Q5_0:
    case GG_Q8_0:
        memcpy(tile + 2 * lane, block, 2);
        break;
    case GG_Q4_1:
    case GG_Q5_1:
        memcpy(tile + 2 * lane, block, 2);
        memcpy(tile + 32 + 2 * lane, block + 2, 2);
        break;
    case GG_Q4_K:
    case GG_Q5_K:
        memcpy(tile + 2 * lane, block, 2);
        memcpy(tile + 32 + 2 * lane, block + 2, 2);
        for (int j = 0; j < 8; ++j)
            q4k_scale_min(block + 4, j, tile + GG_Q4K_SC + 16 * j + lane, tile + GG_Q4K_MN + 16 * j + lane);
        break;
    case GG_Q3_K:
        memcpy(tile + 2 * lane, block + 108, 2);
        for (int i = 0; i < 16; ++i) tile[GG_Q6K_SC + 16 * i + lane] = (uint8_t)q3k_scale(block + 96, i);
        break;
    case GG_Q2_K:
        memcpy(tile + 2 * lane, block + 80, 2);
        memcpy(tile + 32 + 2 * lane, block + 82, 2);
        for (int i = 0; i < 16; ++i) tile[GG_Q2K_SC + 16 * i + lane] = block[i];
        break;
    default: /* GG_Q6_K */
        memcpy(tile + 2 * lane, block + 208, 2);
        for (int i = 0; i < 16; ++i) tile[GG_Q6K_SC + 16 * i + lane] = block[192 + i];
        break;
    }
    /* quants, sub-tile by sub-tile */
    for (int idx = 0; idx < k; ++idx) {
        const int sub = idx / 32, t = (idx % 32) / 4, kk = idx % 4;
        const uint8_t q = block_quant(format, block, idx);
        const int at = 4 * lane + kk;
        if (format == GG_Q8_0) {
            tile[32 + 64 * t + at] = q;
            continue;
        }
        if (gg_low2(format)) { /* 2 low bits as Q6_K's high bits, Q3_K's third as the Q5 formats' fifth */
            uint8_t *low = tile + gg_nibbles_at(format, sub) + 64 * (t / 4) + at, *third = tile + gg_nibbles_at(format, sub) + 128 + at;
            *low = (uint8_t)((*low & ~(3u << (2 * (t & 3)))) | ((q & 3u) << (2 * (t & 3))));
            if (format == GG_Q3_K) *third = (uint8_t)((*third & ~(1u << t)) | (((q >> 2) & 1u) << t));
            continue;
        }
        uint8_t *nibbles = tile + gg_nibbles_at(format, sub), *high = nibbles + 256;
        uint8_t *byte = nibbles + 64 * (t / 2) + at;
        *byte = (t & 1) ? (uint8_t)((*byte & 0x0F) | ((q & 0x0F) << 4)) : (uint8_t)((*byte & 0xF0) | (q & 0x0F));
        if (format == GG_Q6_K) {
            uint8_t *bits = high + 64 * (t / 4) + at;
            *bits = (uint8_t)((*bits & ~(3u << (2 * (t & 3)))) | (((q >> 4) & 3u) << (2 * (t & 3))));
        } else if (gg_fifth_bit(format)) {
            high[at] = (uint8_t)((high[at] & ~(1u << t)) | (((q >> 4) & 1u) << t));
        }
    }
}

/* Bytes of a [rows, cols] matrix in the tiled layout; -1 for a shape the layout does not take. */
int64_t gguf_tiled_bytes(int format, int rows, int cols) {
    if (format < 0 || format >= GG_NFORMATS || rows < 1 || cols < 1 || cols % gg_tile_k[format]) return -1;
    return (int64_t)gg_groups(rows) * gg_group_bytes(format, cols);
}

/* src: the file's [rows][cols / tile_k blocks]; dst: gguf_tiled_bytes() bytes. */
int gguf_repack(int format, const uint8_t *src, uint8_t *dst, int rows, int cols, int threads) {
    if (gguf_tiled_bytes(format, rows, cols) < 0) return -2;
    const int tiles = cols / gg_tile_k[format], groups = gg_groups(rows);
    const int64_t row_bytes = (int64_t)tiles * gg_block_bytes[format];
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; ++g) {
        uint8_t *group = dst + g * gg_group_bytes(format, cols);
        memset(group, 0, (size_t)gg_group_bytes(format, cols));
        for (int t = 0; t < tiles; ++t)
            for (int lane = 0; lane < GG_ROWS; ++lane) {
                const int row = g * GG_ROWS + lane;
                const uint8_t *block = row < rows ? src + row * row_bytes + (int64_t)t * gg_block_bytes[format] : NULL;
                fill_tile_row(format, group + (int64_t)t * gg_tile_bytes[format], lane, block);
            }
    }
    return 0;
}

void gg_dequantize_row(const gg_matrix *w, int row, float *out) {
    const int format = w->format, tile_k = gg_tile_k[format], tiles = w->cols / tile_k;
    const uint8_t *group = w->data + (row / GG_ROWS) * gg_group_bytes(format, w->cols);
    uint8_t q[32];
    float a[2], b[2];
    for (int t = 0; t < tiles; ++t)
        for (int sub = 0; sub < tile_k / GG_SUB; ++sub) {
            gg_sub_row(format, group + (int64_t)t * gg_tile_bytes[format], sub, row % GG_ROWS, q, a, b);
            float *dest = out + t * tile_k + sub * GG_SUB;
            for (int j = 0; j < GG_SUB; ++j) dest[j] = fmaf((float)q[j], a[j / 16], b[j / 16]);
        }
}

/* The whole matrix as float32 [rows][cols]. */
int gguf_dequantize(const gg_matrix *w, float *out, int threads) {
    if (gguf_tiled_bytes(w->format, w->rows, w->cols) < 0) return -2;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < w->rows; ++r) gg_dequantize_row(w, r, out + (int64_t)r * w->cols);
    return 0;
}

/* Rows ids[0..n) as float32 [n][cols] (an embedding lookup); -1 for an id out of range. */
int gguf_dequantize_rows(const gg_matrix *w, const int64_t *ids, int n, float *out) {
    for (int i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= w->rows) return -1;
        gg_dequantize_row(w, (int)ids[i], out + (int64_t)i * w->cols);
    }
    return 0;
}
