/*
 * The GGUF matmuls in plain C: what every CPU can run (and the reference layout reader for the
 * SIMD files). y[i][r] (+)= sum_k w[r][k] x[i][k] over the tiled layout of gguf.h, one weight row
 * and one sub-tile at a time: float32 activations (each weight dequantized, w = a * q + b with one
 * rounding, then multiplied) or int8 activations (exact integer dot products per half sub-tile,
 * scaled as llama.cpp scales them). -O3 vectorises the inner loops for whatever CPU builds it.
 */
#include "gguf.h"

#define CHUNK 16 /* activation rows per pass over a weight row */

void gg_f32_portable(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1,
                     int accumulate) {
    const int format = w->format, tile_k = gg_tile_k[format], tiles = w->cols / tile_k, subs = tile_k / GG_SUB;
    uint8_t q[GG_SUB];
    float a[2], b[2], wv[GG_SUB], acc[CHUNK];
    for (int g = g0; g < g1; ++g) {
        const uint8_t *group = w->data + g * gg_group_bytes(format, w->cols);
        for (int lane = 0; lane < GG_ROWS && g * GG_ROWS + lane < w->rows; ++lane) {
            const int row = g * GG_ROWS + lane;
            for (int i0 = 0; i0 < m; i0 += CHUNK) {
                const int rows = m - i0 < CHUNK ? m - i0 : CHUNK;
                for (int i = 0; i < rows; ++i) acc[i] = 0.0f;
                for (int t = 0; t < tiles; ++t)
                    for (int sub = 0; sub < subs; ++sub) {
                        gg_sub_row(format, group + (int64_t)t * gg_tile_bytes[format], sub, lane, q, a, b);
                        for (int j = 0; j < GG_SUB; ++j) wv[j] = fmaf((float)q[j], a[j / 16], b[j / 16]);
                        const int col = t * tile_k + sub * GG_SUB;
                        for (int i = 0; i < rows; ++i) {
                            const float *xr = x + (int64_t)(i0 + i) * ldx + col;
                            float s = 0.0f;
                            for (int j = 0; j < GG_SUB; ++j) s += wv[j] * xr[j];
                            acc[i] += s;
                        }
                    }
                for (int i = 0; i < rows; ++i) {
                    float *out = y + (int64_t)(i0 + i) * ldy + row;
                    *out = accumulate ? *out + acc[i] : acc[i];
                }
            }
        }
    }
}

void gg_i8_portable(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate) {
    const int format = w->format, tile_k = gg_tile_k[format], tiles = w->cols / tile_k, subs = tile_k / GG_SUB;
    const int offset = gg_offset(format), k = x->k, m = x->m;
    uint8_t q[GG_SUB];
    float a[2], b[2], acc[CHUNK];
    for (int g = g0; g < g1; ++g) {
        const uint8_t *group = w->data + g * gg_group_bytes(format, w->cols);
        for (int lane = 0; lane < GG_ROWS && g * GG_ROWS + lane < w->rows; ++lane) {
            const int row = g * GG_ROWS + lane;
            for (int i0 = 0; i0 < m; i0 += CHUNK) {
                const int rows = m - i0 < CHUNK ? m - i0 : CHUNK;
                for (int i = 0; i < rows; ++i) acc[i] = 0.0f;
                for (int t = 0; t < tiles; ++t)
                    for (int sub = 0; sub < subs; ++sub) {
                        gg_sub_row(format, group + (int64_t)t * gg_tile_bytes[format], sub, lane, q, a, b);
                        const int col = t * tile_k + sub * GG_SUB, block = col / GG_SUB;
                        for (int i = 0; i < rows * x->levels; ++i) { /* row i / levels, level i % levels */
                            const int64_t xrow = (int64_t)i0 * x->levels + i, at = xrow * k + col;
                            const int8_t *xq = x->q + at;
                            int dot[2] = {0, 0};
                            for (int h = 0; h < 2; ++h)
                                for (int j = 16 * h; j < 16 * h + 16; ++j) dot[h] += (int)q[j] * (int)xq[j];
                            const float xd = x->d[xrow * (k / GG_SUB) + block];
                            if (format == GG_Q2_K) { /* per-16 scales and minimums */
                                const int32_t *sums = x->sum16 + at / 16;
                                acc[i / x->levels] += a[0] * xd * (float)dot[0] + a[1] * xd * (float)dot[1] +
                                                      xd * (b[0] * (float)sums[0] + b[1] * (float)sums[1]);
                            } else if (offset) {
                                const int32_t *sums = x->sum16 + at / 16;
                                acc[i / x->levels] += a[0] * xd * (float)(dot[0] - offset * sums[0]) +
                                                      a[1] * xd * (float)(dot[1] - offset * sums[1]);
                            } else {
                                acc[i / x->levels] += a[0] * xd * (float)(dot[0] + dot[1]) + b[0] * x->s[xrow * (k / GG_SUB) + block];
                            }
                        }
                    }
                for (int i = 0; i < rows; ++i) {
                    float *out = y + (int64_t)(i0 + i) * ldy + row;
                    *out = accumulate ? *out + acc[i] : acc[i];
                }
            }
        }
    }
}
