/*
 * y = x @ W.T with W in the tiled GGUF layout (gguf.h): the code-path dispatch, the int8
 * quantization of activation rows, and the entry point of the engine::gguf_linear op.
 *
 * The Python side passes `isa`, the best code path this CPU has and the environment does not hide
 * (ENGINE_CPU_HIDE_FEATURES); a path this build lacks (gcc targets the CPU with -march=native)
 * falls through to the next one down, so every call lands on code the CPU can run. The fused
 * decode step (gguf_decode.c) calls the same dispatch from inside its own parallel region.
 */
#include <stdlib.h>

#include "gguf.h"

void gg_matmul_f32(const gg_matrix *w, const float *x, int ldx, int m, float *y, int ldy, int g0, int g1, int accumulate,
                   int isa) {
    if (isa >= GG_AVX512 && gg_f32_avx512(w, x, ldx, m, y, ldy, g0, g1, accumulate) == 0) return;
    if (isa >= GG_AVX2 && gg_f32_avx2(w, x, ldx, m, y, ldy, g0, g1, accumulate) == 0) return;
    gg_f32_portable(w, x, ldx, m, y, ldy, g0, g1, accumulate);
}

void gg_matmul_i8(const gg_matrix *w, const gg_act8 *x, float *y, int ldy, int g0, int g1, int accumulate, int isa) {
    if (isa >= GG_AVX512 && gg_i8_avx512(w, x, y, ldy, g0, g1, accumulate) == 0) return;
    if (isa >= GG_VNNI256 && gg_i8_avx2(w, x, y, ldy, g0, g1, accumulate, 1) == 0) return;
    if (isa >= GG_AVX2 && gg_i8_avx2(w, x, y, ldy, g0, g1, accumulate, 0) == 0) return;
    gg_i8_portable(w, x, y, ldy, g0, g1, accumulate);
}

/* Each block of 32 activations of row i to int8 with one scale (max|x| / 127), rounded to nearest
   even; with two levels, the rounding error again, to int8 at 1/254 of that scale. No FMA may fuse
   x * inverse with the subtraction after it: the SIMD quantizers round that product, and all must
   agree bit for bit. */
__attribute__((optimize("fp-contract=off"))) void gg_quantize_row_portable(const float *x, gg_act8 *out, int i) {
    const int k = out->k, blocks = k / GG_SUB, levels = out->levels;
    for (int b = 0; b < blocks; ++b) {
        const float *src = x + b * GG_SUB;
        float amax = 0.0f;
        for (int j = 0; j < GG_SUB; ++j) amax = fmaxf(amax, fabsf(src[j]));
        const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        float rest[GG_SUB];
        for (int level = 0; level < levels; ++level) {
            const int64_t row = (int64_t)i * levels + level;
            int8_t *dst = out->q + row * k + b * GG_SUB;
            int sums[2] = {0, 0};
            for (int j = 0; j < GG_SUB; ++j) {
                const float value = level == 0 ? src[j] * inverse : rest[j] * 254.0f;
                const int q = (int)rintf(value);
                dst[j] = (int8_t)q;
                rest[j] = value - (float)q;
                sums[j / 16] += q;
            }
            const float scale = level == 0 ? d : d / 254.0f;
            out->d[row * blocks + b] = scale;
            out->s[row * blocks + b] = scale * (float)(sums[0] + sums[1]);
            out->sum16[(row * blocks + b) * 2] = sums[0];
            out->sum16[(row * blocks + b) * 2 + 1] = sums[1];
        }
    }
}

void gg_quantize_row(const float *x, gg_act8 *out, int i, int isa) {
    if (!(isa >= GG_AVX512 && gg_quantize_row_avx512(x, out, i) == 0) && !(isa >= GG_AVX2 && gg_quantize_row_avx2(x, out, i) == 0))
        gg_quantize_row_portable(x, out, i);
    if (out->q16 != NULL) { /* both levels in one int16 (exact: 254 * 127 + 127 < 32768); see gg_act8_place */
        const int k = out->k;
        const int8_t *first = out->q + (int64_t)i * 2 * k, *second = first + k;
        int16_t *both = out->q16 + (int64_t)i * k;
        for (int j = 0; j < k; ++j) both[j] = (int16_t)(254 * first[j] + second[j]);
    }
}

void gg_quantize_rows(const float *x, int ldx, gg_act8 *out, int isa) {
    for (int i = 0; i < out->m; ++i) gg_quantize_row(x + (int64_t)i * ldx, out, i, isa);
}

/* The activations the int8 kernels multiply: x [m][k] -> out [m][k] float64, each value the sum of
   its levels' d * q (what the tests hold the kernels' products to). Returns -2 for a bad shape. */
int gguf_quantized_activations(const float *x, int m, int k, int levels, int isa, double *out) {
    if (m < 1 || k % GG_SUB || levels < 1 || levels > 2) return -2;
    void *buffer = malloc((size_t)gg_act8_bytes(m, k, levels));
    if (buffer == NULL) return -3;
    gg_act8 a;
    gg_act8_place(&a, buffer, m, k, levels, isa);
    gg_quantize_rows(x, k, &a, isa);
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < k; ++j) {
            double value = 0.0;
            for (int level = 0; level < levels; ++level) {
                const int64_t row = (int64_t)i * levels + level;
                value += (double)a.d[row * (k / GG_SUB) + j / GG_SUB] * a.q[row * k + j];
            }
            out[(int64_t)i * k + j] = value;
        }
    free(buffer);
    return 0;
}

/* Bytes of the int8 activation buffers for m rows of k columns, and their layout in one buffer. */
int64_t gg_act8_bytes(int m, int k, int levels) {
    return (int64_t)m * levels * k + (int64_t)m * levels * (k / GG_SUB) * 16 + (levels == 2 ? 2LL * m * k : 0);
}
/* Whether gg_matmul_i8 at `isa` lands on the AVX2 kernel without VNNI, the one that reads q16 (the
   dispatch above: a path this build lacks falls through to the next one down). */
static int i8_lands_on_avx2_without_vnni(int isa) {
    if (isa >= GG_AVX512 && gg_avx512_built() >= 2) return 0;
    if (isa >= GG_VNNI256 && gg_avx2_built() >= 2) return 0;
    return isa >= GG_AVX2 && gg_avx2_built() >= 1;
}

/* q16 (two levels as one int16) only where a kernel will read it: two levels, a batch of rows
   (GG_Q16_MIN_ROWS), and the dispatch landing on AVX2 without VNNI. Elsewhere (one row, VNNI, AVX512,
   portable) no quantized row pays for writing it. */
void gg_act8_place(gg_act8 *a, void *buffer, int m, int k, int levels, int isa) {
    uint8_t *p = (uint8_t *)buffer;
    const int64_t blocks = (int64_t)m * levels * (k / GG_SUB);
    a->d = (float *)p;
    a->s = a->d + blocks;
    a->sum16 = (int32_t *)(a->s + blocks);
    a->q16 = levels == 2 && m >= GG_Q16_MIN_ROWS && i8_lands_on_avx2_without_vnni(isa) ? (int16_t *)(a->sum16 + 2 * blocks)
                                                                                        : NULL;
    a->q = (int8_t *)(a->sum16 + 2 * blocks) + (levels == 2 ? 2LL * m * k : 0);
    a->m = m;
    a->k = k;
    a->levels = levels;
}

/* Which code paths this build has: bit 0 portable, 1 AVX2, 2 256-bit VNNI, 3 AVX512 float, 4 AVX512 VNNI. */
int gguf_paths(void) {
    const int avx2 = gg_avx2_built(), avx512 = gg_avx512_built();
    return 1 | (avx2 >= 1) << 1 | (avx2 >= 2) << 2 | (avx512 >= 1) << 3 | (avx512 >= 2) << 4;
}

int gg_linear_items(const gg_linear *l, int chunk) {
    int items = 0;
    for (int p = 0; p < l->nparts; ++p) items += (gg_groups(l->parts[p].rows) + chunk - 1) / chunk;
    return items;
}

void gg_linear_item(const gg_linear *l, int item, int chunk, const float *x, int ldx, const gg_act8 *a, int m, float *y,
                    int ldy, int accumulate, int isa_f32, int isa_i8) {
    int column = 0;
    for (int p = 0; p < l->nparts; ++p) {
        const gg_matrix *w = &l->parts[p];
        const int groups = gg_groups(w->rows), items = (groups + chunk - 1) / chunk;
        if (item < items) {
            const int g0 = item * chunk, g1 = g0 + chunk < groups ? g0 + chunk : groups;
            if (a != NULL)
                gg_matmul_i8(w, a, y + column, ldy, g0, g1, accumulate, isa_i8);
            else
                gg_matmul_f32(w, x, ldx, m, y + column, ldy, g0, g1, accumulate, isa_f32);
            return;
        }
        item -= items;
        column += w->rows;
    }
}

/*
 * The op's entry: x float32 [m][cols] -> y float32 [m][sum of the parts' rows], every part of the
 * same width; row groups spread over `threads` OpenMP threads (torch's count: the library runs on
 * torch's libgomp pool). levels: 0 float32 activations, 1 int8 (llama.cpp's numerics), 2 int8 in
 * two levels (gguf.h). Returns 0, -2 for shapes it does not take, -3 when the activation buffer
 * cannot be allocated.
 */
int gguf_matmul(const gg_matrix *parts, int nparts, const float *x, int m, float *y, int levels, int isa, int threads) {
    if (m < 1 || nparts < 1) return -2;
    const int cols = parts[0].cols;
    int rows = 0, groups = 0;
    for (int p = 0; p < nparts; ++p) {
        const gg_matrix *w = &parts[p];
        if (w->format < 0 || w->format >= GG_NFORMATS || w->cols != cols || cols % gg_tile_k[w->format]) return -2;
        rows += w->rows;
        groups += gg_groups(w->rows);
    }
    const gg_linear linear = {parts, NULL, nparts, rows};
    gg_act8 act;
    void *buffer = NULL;
    const int int8 = levels > 0;
    if (levels < 0 || levels > 2) return -2;
    if (int8) {
        buffer = malloc((size_t)gg_act8_bytes(m, cols, levels));
        if (buffer == NULL) return -3;
        gg_act8_place(&act, buffer, m, cols, levels, isa);
        gg_quantize_rows(x, cols, &act, isa);
    }
    if (threads < 1) threads = 1;
    if ((int64_t)groups * cols * m < 65536) threads = 1; /* a tiny matrix: the fork would cost more */
    /* A few items per thread: a core another process takes for a while does not hold up the call. */
    int chunk = groups / (4 * threads);
    if (chunk < 1) chunk = 1;
    const int items = gg_linear_items(&linear, chunk);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int item = 0; item < items; ++item)
        gg_linear_item(&linear, item, chunk, x, cols, int8 ? &act : NULL, m, y, rows, 0, isa, isa);
    free(buffer);
    return 0;
}
