/*
 * One decode step of a Llama-family model (Llama, SmolLM2, Mistral, Qwen2's q/k/v bias, Qwen3's
 * q/k norms, sliding windows) with GGUF weights in the tiled layout of gguf.h, in one call.
 *
 * Why: at batch 1 the compiled torch step of SmolLM2 spent ~2/3 of its 21 ms around the matmuls,
 * not in them (121 op calls through Python and ctypes, dynamo's guards, the layer graphs' own small
 * kernels, views, attention setup). Here the whole step (embedding, 30 x [RMSNorm, q/k/v, rotary,
 * KV store into the engine's paged cache, paged GQA attention, o_proj + residual, RMSNorm,
 * gate/up, SiLU x up, down + residual], final norm, LM head) is one OpenMP parallel region: the
 * matmuls hand out chunks of their row groups to the threads, attention its (request, kv head)
 * pairs, and the row-wise steps (norms, rotary and the KV store, SiLU, the int8 copies of the matmul
 * inputs) go one row per iteration: ~8 barriers a layer, 0.3-2 us each with two threads spinning.
 *
 * Numerics: int8 activations (llama.cpp's: each matmul input quantized per block of 32 once, then
 * integer dot products; or two int8 levels, ~16-bit activations at twice the dot products) or
 * float32 activations (the weights' exact values, HF's numerics); norms,
 * rotary, softmax and the residual stream in float32 as the torch path computes them.
 * The caches, page table and slots are the engine's own (graphs/static_buffers.py), so prefill,
 * prefix caching and the torch paths share them. Returns 0, or -2 for inputs it does not take
 * (checked before any thread starts).
 */
#pragma GCC target("prefer-vector-width=512")
#include <omp.h>
#include <stdlib.h>

#include "gguf.h"

typedef struct {
    gg_linear qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm; /* [hidden] */
    const float *q_norm, *k_norm;      /* Qwen3's per-head norms [head_dim], or NULL */
    float *k_cache, *v_cache;          /* [slots][kv_heads][head_dim] */
    const float *cos, *sin;            /* the layer's rotary table [max_positions][head_dim] */
    int32_t window;                    /* sliding window in positions, 0: none */
    int32_t reserved;
} gg_layer;

typedef struct {
    const gg_layer *layers;
    gg_linear head;           /* nparts 0: out gets the final normed hidden state (the caller's head) */
    const gg_matrix *embed;   /* the tiled token embedding, or NULL ... */
    const float *embed_dense; /* ... float32 [vocab][hidden] */
    const float *final_norm;
    int32_t n_layers, hidden, heads, kv_heads, head_dim, inter, vocab, max_positions, page_size;
    int32_t levels; /* activations: 0 float32, 1 int8, 2 int8 in two levels (gguf.h) */
    int32_t isa_f32, isa_i8;
    float eps, scale;
} gg_model;

typedef struct { /* the step's buffers, carved from the caller's scratch */
    float *h, *xn, *qkv, *att, *gu, *act, *scores;
    gg_act8 a_hidden, a_att, a_inter; /* the int8 views of the three matmul inputs (one buffer: one is live at a time) */
    int max_len;
} buffers;

static inline int64_t align64(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

static int widest_input(const gg_model *m) {
    int k = m->hidden > m->heads * m->head_dim ? m->hidden : m->heads * m->head_dim;
    return k > m->inter ? k : m->inter;
}

static int64_t layout(const gg_model *m, int n, int max_len, int threads, uint8_t *base, buffers *b) {
    const int64_t sizes[8] = {
        4LL * n * m->hidden, 4LL * n * m->hidden, 4LL * n * m->layers[0].qkv.rows, 4LL * n * m->heads * m->head_dim,
        4LL * n * 2 * m->inter, 4LL * n * m->inter, 4LL * threads * (m->heads / m->kv_heads) * max_len,
        gg_act8_bytes(n, widest_input(m), 2)};
    int64_t at = 0;
    void *parts[8];
    for (int i = 0; i < 8; ++i) {
        parts[i] = base + at;
        at += align64(sizes[i]);
    }
    if (b != NULL) {
        b->h = parts[0], b->xn = parts[1], b->qkv = parts[2], b->att = parts[3], b->gu = parts[4], b->act = parts[5];
        b->scores = parts[6], b->max_len = max_len;
        const int levels = m->levels ? m->levels : 1;
        gg_act8_place(&b->a_hidden, parts[7], n, m->hidden, levels, m->isa_i8);
        gg_act8_place(&b->a_att, parts[7], n, m->heads * m->head_dim, levels, m->isa_i8);
        gg_act8_place(&b->a_inter, parts[7], n, m->inter, levels, m->isa_i8);
    }
    return at;
}

/* Scratch bytes a step of n rows with contexts up to max_len needs. */
int64_t gguf_decode_scratch(const gg_model *m, int n, int max_len, int threads) {
    return layout(m, n, max_len, threads < 1 ? 1 : threads, NULL, NULL) + 64;
}

static void rms_norm(const float *x, const float *weight, int dim, float eps, float *out) {
    float sum = 0.0f;
    for (int j = 0; j < dim; ++j) sum += x[j] * x[j];
    const float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int j = 0; j < dim; ++j) out[j] = weight[j] * (x[j] * inverse);
}

/* HF's rotate-half rotary on one head, from the model's own cos/sin table row. */
static void rotate(float *x, const float *cos, const float *sin, int dim) {
    const int half = dim / 2;
    for (int j = 0; j < half; ++j) {
        const float x1 = x[j], x2 = x[j + half];
        x[j] = x1 * cos[j] - x2 * sin[j];
        x[j + half] = x2 * cos[j + half] + x1 * sin[j + half];
    }
}

/* Inside the parallel region: the rows of a linear over the team (dynamic: a core another process
   takes for a while does not hold up the step). a: the int8 input (int8 activations) or NULL. */
static void linear(const gg_model *m, const gg_linear *l, const float *x, int ldx, const gg_act8 *a, int n, float *y,
                   int accumulate) {
    int groups = 0;
    for (int p = 0; p < l->nparts; ++p) groups += gg_groups(l->parts[p].rows);
    int chunk = groups / (8 * omp_get_num_threads());
    if (chunk < 1) chunk = 1;
    const int items = gg_linear_items(l, chunk);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; ++item)
        gg_linear_item(l, item, chunk, x, ldx, m->levels ? a : NULL, n, y, l->rows, accumulate, m->isa_f32, m->isa_i8);
}

/* RMSNorm of row r, and its int8 copy (int8 activations). */
static void norm_row(const gg_model *m, const float *h, const float *weight, float *xn, gg_act8 *a, int r) {
    rms_norm(h + (int64_t)r * m->hidden, weight, m->hidden, m->eps, xn + (int64_t)r * m->hidden);
    if (m->levels) gg_quantize_row(xn + (int64_t)r * m->hidden, a, r, m->isa_i8);
}

/* q/k/v of one row: bias, Qwen3's q/k norms, rotary; k and v stored at the row's slot. */
static void qkv_finish(const gg_model *m, const gg_layer *ly, float *qkv, int64_t position, int64_t slot) {
    const int hd = m->head_dim, kv = m->kv_heads * hd;
    float *k = qkv + m->heads * hd, *v = k + kv;
    if (ly->qkv.bias != NULL)
        for (int j = 0; j < ly->qkv.rows; ++j) qkv[j] += ly->qkv.bias[j];
    const float *cos = ly->cos + position * hd, *sin = ly->sin + position * hd;
    for (int h = 0; h < m->heads + m->kv_heads; ++h) {
        float *head = qkv + (int64_t)h * hd;
        const float *norm = h < m->heads ? ly->q_norm : ly->k_norm;
        if (norm != NULL) rms_norm(head, norm, hd, m->eps, head);
        rotate(head, cos, sin, hd);
    }
    memcpy(ly->k_cache + slot * kv, k, sizeof(float) * kv);
    memcpy(ly->v_cache + slot * kv, v, sizeof(float) * kv);
}

/* The K (or V) row of position l of a request, kv head kh. */
static inline const float *cache_row(const gg_model *m, const float *cache, const int32_t *pages, int l, int kh) {
    const int ps = m->page_size;
    return cache + (((int64_t)pages[l / ps] * ps + l % ps) * m->kv_heads + kh) * m->head_dim;
}

static void softmax(float *s, int span) {
    float max = s[0], sum = 0.0f;
    for (int l = 1; l < span; ++l) max = s[l] > max ? s[l] : max;
    for (int l = 0; l < span; ++l) {
        s[l] = expf(s[l] - max);
        sum += s[l];
    }
    const float inverse = 1.0f / sum;
    for (int l = 0; l < span; ++l) s[l] *= inverse;
}

/* VW floats as one vector (gcc's vector extensions): a zmm with AVX512, a ymm otherwise. A 64-byte type
   on AVX2 compiled badly: every scalar splat went through 16 stores to the stack, and the accumulators
   lived there in 16-byte pieces (attention was 22% of a batch-16 step on the AVX2 EPYC). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vfw __attribute__((vector_size(4 * VW)));
typedef int32_t viw __attribute__((vector_size(4 * VW)));
/* Unaligned, aliasing views: a plain dereference compiles to one unaligned vector move (a memcpy here
   went through the stack as two halves, and each reload then stalled on store forwarding). */
typedef float vfwu __attribute__((vector_size(4 * VW), aligned(4), may_alias));
static inline vfw vload(const float *p) { return *(const vfwu *)p; }
static inline void vstore(float *p, vfw v) { *(vfwu *)p = v; }
static inline float vsum(vfw v) { /* halves folded onto each other down to one lane (__builtin_shuffle: any gcc) */
#if VW == 16
    v += __builtin_shuffle(v, (viw){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (viw){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (viw){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (viw){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
#else
    v += __builtin_shuffle(v, (viw){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (viw){2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (viw){1, 0, 1, 0, 1, 0, 1, 0});
#endif
    return v[0];
}

#define AHEAD 8 /* positions between a cache row's prefetch and its use */

/* A position of a request as (index into its page table, offset in the page), walked without dividing
   (page_size is a run-time value: a division per row cost more than the row's FMAs). */
typedef struct {
    int page, offset;
} cursor;
static inline cursor cursor_at(int position, int ps) { return (cursor){position / ps, position % ps}; }
static inline void advance(cursor *c, int ps) {
    if (++c->offset == ps) c->offset = 0, ++c->page;
}
static inline const float *row_at(const float *cache, const int32_t *pages, cursor c, int ps, int64_t row, int64_t head) {
    return cache + ((int64_t)pages[c.page] * ps + c.offset) * row + head;
}
static inline void prefetch_row(const float *p, int lines) {
    for (int v = 0; v < lines; ++v) __builtin_prefetch((const char *)p + 64 * v);
}

/* The query heads of kv head `kh` of one request over its pages (its last `window` positions), for a
   head dimension of VW * C. Scores: each key row loaded once for every query head of the group;
   values: one query head at a time, its C output vectors in registers across the positions (the
   span's value rows come from L1/L2 after the first head). The rows of a long context come from
   memory: each is prefetched AHEAD positions early (batch 16, context 512: 55 -> 37 ms a step). */
static inline __attribute__((always_inline)) void attend_vectors(const int C, const gg_model *m, const gg_layer *ly,
                                                                 const float *q, const int32_t *pages, int start,
                                                                 int len, int kh, float *out, float *scores) {
    const int group = m->heads / m->kv_heads, span = len - start, ps = m->page_size;
    const int64_t row = (int64_t)m->kv_heads * VW * C, head = (int64_t)kh * VW * C;
    const float *qh = q + (int64_t)kh * group * VW * C;
    cursor at = cursor_at(start, ps), ahead = cursor_at(start + AHEAD, ps);
    for (int l = 0; l < span; ++l) {
        const float *key = row_at(ly->k_cache, pages, at, ps, row, head);
        if (l + AHEAD < span) prefetch_row(row_at(ly->k_cache, pages, ahead, ps, row, head), VW * C / 16);
        vfw k[128 / VW]; /* C <= 128 / VW: an array sized by C would be a VLA on the stack, not registers */
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) k[c] = vload(key + VW * c);
        for (int g = 0; g < group; ++g) {
            vfw acc = k[0] * vload(qh + g * VW * C);
#pragma GCC unroll 16
            for (int c = 1; c < C; ++c) acc += k[c] * vload(qh + g * VW * C + VW * c);
            scores[g * span + l] = vsum(acc) * m->scale;
        }
        advance(&at, ps);
        advance(&ahead, ps);
    }
    for (int g = 0; g < group; ++g) {
        float *s = scores + g * span;
        softmax(s, span);
        vfw o[128 / VW];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) o[c] = (vfw){0};
        at = cursor_at(start, ps), ahead = cursor_at(start + AHEAD, ps);
        for (int l = 0; l < span; ++l) {
            const float *value = row_at(ly->v_cache, pages, at, ps, row, head);
            if (g == 0 && l + AHEAD < span) prefetch_row(row_at(ly->v_cache, pages, ahead, ps, row, head), VW * C / 16);
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) o[c] += s[l] * vload(value + VW * c);
            advance(&at, ps);
            advance(&ahead, ps);
        }
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) vstore(out + (int64_t)(kh * group + g) * VW * C + VW * c, o[c]); /* o stays in registers */
    }
}

/* The query heads of kv head `kh` of one request over its pages (its last `window` positions). */
static void attend(const gg_model *m, const gg_layer *ly, const float *q, const int32_t *pages, int len, int kh,
                   float *out, float *scores) {
    const int hd = m->head_dim, group = m->heads / m->kv_heads;
    const int start = ly->window > 0 && len > ly->window ? len - ly->window : 0, span = len - start;
    if (hd == 64) return attend_vectors(64 / VW, m, ly, q, pages, start, len, kh, out, scores);
    if (hd == 128) return attend_vectors(128 / VW, m, ly, q, pages, start, len, kh, out, scores);
    for (int g = 0; g < group; ++g) { /* any other head size: plain loops */
        const float *qh = q + (int64_t)(kh * group + g) * hd;
        float *s = scores + g * span, *o = out + (int64_t)(kh * group + g) * hd;
        for (int l = start; l < len; ++l) {
            const float *key = cache_row(m, ly->k_cache, pages, l, kh);
            float dot = 0.0f;
            for (int d = 0; d < hd; ++d) dot += qh[d] * key[d];
            s[l - start] = dot * m->scale;
        }
        softmax(s, span);
        memset(o, 0, sizeof(float) * hd);
        for (int l = start; l < len; ++l) {
            const float *value = cache_row(m, ly->v_cache, pages, l, kh);
            for (int d = 0; d < hd; ++d) o[d] += s[l - start] * value[d];
        }
    }
}

int gguf_decode_step(const gg_model *m, int n, const int64_t *tokens, const int64_t *positions, const int64_t *slots,
                     const int32_t *page_table, int width, const int32_t *seq_lens, float *out, void *scratch,
                     int64_t scratch_bytes, int threads) {
    if (n < 1 || m->heads % m->kv_heads || m->head_dim % 2 || m->levels < 0 || m->levels > 2) return -2;
    if (threads < 1) threads = 1;
    int max_len = 1;
    for (int b = 0; b < n; ++b) {
        if (tokens[b] < 0 || tokens[b] >= m->vocab || positions[b] < 0 || positions[b] >= m->max_positions) return -2;
        if (seq_lens[b] < 1 || seq_lens[b] > (int64_t)width * m->page_size || slots[b] < 0) return -2;
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    }
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    buffers b;
    if (layout(m, n, max_len, threads, base, &b) + (base - (uint8_t *)scratch) > scratch_bytes) return -2;
    const int H = m->hidden, hd = m->head_dim, attn_width = m->heads * hd, I = m->inter;
    const int group = m->heads / m->kv_heads;

#pragma omp parallel num_threads(threads)
    {
        /* Row-wise steps go one row per iteration: a batch of 16 spreads over the threads. */
#pragma omp for
        for (int r = 0; r < n; ++r) {
            if (m->embed != NULL)
                gg_dequantize_row(m->embed, (int)tokens[r], b.h + (int64_t)r * H);
            else
                memcpy(b.h + (int64_t)r * H, m->embed_dense + tokens[r] * H, sizeof(float) * H);
        }
        for (int L = 0; L < m->n_layers; ++L) {
            const gg_layer *ly = &m->layers[L];
#pragma omp for
            for (int r = 0; r < n; ++r) norm_row(m, b.h, ly->attn_norm, b.xn, &b.a_hidden, r);
            linear(m, &ly->qkv, b.xn, H, &b.a_hidden, n, b.qkv, 0);
#pragma omp for
            for (int r = 0; r < n; ++r) qkv_finish(m, ly, b.qkv + (int64_t)r * ly->qkv.rows, positions[r], slots[r]);
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < n * m->kv_heads; ++item) {
                const int r = item / m->kv_heads, kh = item % m->kv_heads;
                attend(m, ly, b.qkv + (int64_t)r * ly->qkv.rows, page_table + (int64_t)r * width, seq_lens[r], kh,
                       b.att + (int64_t)r * attn_width, b.scores + (int64_t)omp_get_thread_num() * group * max_len);
            }
            if (m->levels) {
#pragma omp for
                for (int r = 0; r < n; ++r) gg_quantize_row(b.att + (int64_t)r * attn_width, &b.a_att, r, m->isa_i8);
            }
            linear(m, &ly->o, b.att, attn_width, &b.a_att, n, b.h, 1);
#pragma omp for
            for (int r = 0; r < n; ++r) norm_row(m, b.h, ly->ffn_norm, b.xn, &b.a_hidden, r);
            linear(m, &ly->gate_up, b.xn, H, &b.a_hidden, n, b.gu, 0);
#pragma omp for
            for (int r = 0; r < n; ++r) {
                const float *gate = b.gu + (int64_t)r * 2 * I, *up = gate + I;
                float *act = b.act + (int64_t)r * I;
                for (int j = 0; j < I; ++j) act[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
                if (m->levels) gg_quantize_row(act, &b.a_inter, r, m->isa_i8);
            }
            linear(m, &ly->down, b.act, I, &b.a_inter, n, b.h, 1);
        }
        float *normed = m->head.nparts ? b.xn : out;
#pragma omp for
        for (int r = 0; r < n; ++r) norm_row(m, b.h, m->final_norm, normed, &b.a_hidden, r);
        if (m->head.nparts) linear(m, &m->head, b.xn, H, &b.a_hidden, n, out, 0);
    }
    return 0;
}
