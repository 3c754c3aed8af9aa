/*
 * Paged decode attention on the CPU, float32, read straight from the paged KV cache.
 *
 * The torch path gathers every request's context out of the pages (index_select)
 * before SDPA: a copy of the whole context per layer per step. Here each
 * request walks its page table and reads keys and values in place, a whole
 * cache row (all kv heads, contiguous) at a time, so the hardware prefetcher
 * sees one sequential stream per page; query heads that share a kv head (GQA)
 * share each row read. Requests are spread over OpenMP threads; loaded into a
 * process that already holds torch's libgomp, this uses torch's thread pool
 * (as inductor's generated C++ does).
 *
 * q, out:        [batch, heads, dim]
 * k/v caches:    [num_slots, kv_heads, dim], slot = page * page_size + offset
 * page_table:    [batch, width] int32;  seq_lens: [batch] int32 (0: the row is padding)
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef PARALLEL_MIN_ROWS
#define PARALLEL_MIN_ROWS 1024
#endif

static inline int64_t slot_of(const int32_t *pages, int position, int page_size) {
    return (int64_t)pages[position / page_size] * page_size + position % page_size;
}

/* One request, all heads: each cache row (every kv head's k or v, contiguous) is read once. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *pages, int len,
                   int heads, int kv_heads, int dim, int page_size, float scale, float *out, float *scores) {
    const int group = heads / kv_heads;
    const int64_t row_size = (int64_t)kv_heads * dim;
    for (int l = 0; l < len; ++l) {
        const float *k_row = k_cache + slot_of(pages, l, page_size) * row_size;
        for (int h = 0; h < heads; ++h) {
            const float *qh = q + (int64_t)h * dim, *k = k_row + (int64_t)(h / group) * dim;
            float acc = 0.f;
            for (int d = 0; d < dim; ++d) acc += qh[d] * k[d];
            scores[(int64_t)h * len + l] = acc * scale;
        }
    }
    for (int h = 0; h < heads; ++h) {
        float *s = scores + (int64_t)h * len;
        float max = s[0];
        for (int l = 1; l < len; ++l) max = s[l] > max ? s[l] : max;
        float sum = 0.f;
        for (int l = 0; l < len; ++l) {
            s[l] = expf(s[l] - max);
            sum += s[l];
        }
        const float inv = 1.f / sum;
        for (int l = 0; l < len; ++l) s[l] *= inv;
    }
    memset(out, 0, sizeof(float) * heads * dim);
    for (int l = 0; l < len; ++l) {
        const float *v_row = v_cache + slot_of(pages, l, page_size) * row_size;
        for (int h = 0; h < heads; ++h) {
            const float p = scores[(int64_t)h * len + l], *v = v_row + (int64_t)(h / group) * dim;
            float *o = out + (int64_t)h * dim;
            for (int d = 0; d < dim; ++d) o[d] += p * v[d];
        }
    }
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *page_table,
                     int width, const int32_t *seq_lens, int batch, int heads, int kv_heads, int dim,
                     int page_size, float scale, float *out, int threads) {
    int max_len = 1;
    int64_t work = 0;
    for (int b = 0; b < batch; ++b) {
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
        work += seq_lens[b];
    }
    /* torch's thread count, passed in: omp_set_num_threads is per calling thread, and a thread
       that has not run a torch op yet would otherwise get the OpenMP default. */
    if (threads < 1) threads = 1;
    /* One scores row per head, per thread; allocated once, before the fork. */
    float *scratch = (float *)malloc(sizeof(float) * (size_t)threads * heads * max_len);
    if (scratch == NULL) return -1;
    /* Small steps (a lone short context) run on the calling thread: the fork/join would cost more. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (work * kv_heads >= PARALLEL_MIN_ROWS)
    for (int b = 0; b < batch; ++b) {
        const int len = seq_lens[b];
        const int64_t offset = (int64_t)b * heads * dim;
        float *scores = scratch + (size_t)omp_get_thread_num() * heads * max_len;
        if (len <= 0) {
            memset(out + offset, 0, sizeof(float) * heads * dim);
            continue;
        }
        attend(q + offset, k_cache, v_cache, page_table + (int64_t)b * width, len, heads, kv_heads, dim, page_size,
               scale, out + offset, scores);
    }
    free(scratch);
    return 0;
}
