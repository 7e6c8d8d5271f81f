/* A decode step of few sequences over a team of threads, in two rounds
 * (paged_attention_bf16_team). Its work items (query row,
 * KV head) are too few to share (one sequence of SmolLM2: 3 KV heads on 2
 * threads), and splitting them by query head made each thread widen the
 * head's keys and values for one head instead of its group's, and wait on
 * their fetch alone. Instead:
 *   1. scores: items (row, KV head, part of the row's cache blocks), each the
 *      group's scaled dot products at its positions into the team's shared
 *      scores [num_seqs][num_heads][ld];
 *   2. (after the loop's barrier) outputs: items (row, KV head, chunk of
 *      output columns), each a copy of the group's scores, their softmax, and
 *      the weighted values of its columns (the chunks of one KV head each
 *      compute the same softmax: a few hundred exponentials, cheaper than a
 *      third round and its barrier).
 * Each score, softmax and output column is computed by the same functions on
 * the same operands in the same order as attend_item's (qk16_bf16 or qk_block,
 * softmax, pv_columns: the build's), so the
 * bits are the one-item path's: a row's output does not depend on how it was
 * shared. Included by paged_attention_cpu.c only. */
#ifndef TANDEM_ATTENTION_DECODE_H
#define TANDEM_ATTENTION_DECODE_H

/* num_seqs decode rows (row s: sequence s's new token, its context seq_lens[s] positions) over the
 * enclosing team; every thread calls it with the same arguments. shared: floats [num_seqs][num_heads][ld]
 * (ld >= every seq_len), the team's; p [group][max seq_len], qf and acc [group][head_dim]: this thread's
 * scratch (p NULL: none could be allocated, the thread's items are skipped). Returns after the second
 * round's barrier. */
static void decode_rounds(const uint16_t *query, int64_t ldq, const uint16_t *key_cache,
                          const uint16_t *value_cache, uint16_t *out, const int32_t *block_tables, int64_t bt_stride,
                          const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, float *shared, int64_t ld, float *p,
                          float *qf, float *acc, int64_t threads) {
    const int64_t group = num_heads / num_kv_heads, pairs = num_seqs * num_kv_heads, ss = num_kv_heads * head_dim;
    const int fast_qk = qk_fast(1, head_dim, block_size), fast_pv = pv_fast(1, head_dim, group);
    const int64_t parts = (2 * threads + pairs - 1) / pairs; /* items per (row, KV head): two a thread at least */
    _Pragma("omp for schedule(static)") for (int64_t it = 0; it < pairs * parts; it++) {
        const int64_t s = it / (num_kv_heads * parts), g = it / parts % num_kv_heads, j = it % parts;
        const int64_t ctx = seq_lens[s], blocks = (ctx + block_size - 1) / block_size;
        const int64_t i0 = blocks * j / parts * block_size, i1e = blocks * (j + 1) / parts * block_size;
        const int64_t i1 = i1e < ctx ? i1e : ctx;
        const int32_t *table = block_tables + s * bt_stride;
        const uint16_t *q = query + s * ldq + g * group * head_dim;
        float *sc = shared + (s * num_heads + g * group) * ld;
        prefetch_part((const char *)key_cache, table, g, i0, i1, 0, head_dim, head_dim, block_size, ss, 2);
#if defined(__AVX512BF16__)
        if (fast_qk) {
            for (int64_t i = i0; i < i1; i += block_size) {
                const uint16_t *k = key_cache + ((int64_t)table[i / block_size] * block_size) * ss + g * head_dim;
                const int64_t n = i1 - i < block_size ? i1 - i : block_size;
                if (i + block_size < i1)  /* the next block is elsewhere in memory: ask for it while this one runs */
                    prefetch_rows(key_cache + ((int64_t)table[i / block_size + 1] * block_size) * ss + g * head_dim,
                                  ss, i1 - i - block_size < block_size ? i1 - i - block_size : block_size, head_dim * 2);
                for (int64_t o = 0; o < n; o += 16)
                    qk16_bf16(q, k + o * ss, ss, n - o < 16 ? n - o : 16, group, head_dim, scale, sc + i + o, ld);
            }
            continue;
        }
#endif
        if (!p) continue; /* the query in float32 (qf): this thread's scratch */
        for (int64_t j = 0; j < group * head_dim; j++) qf[j] = bf16_to_f32(q[j]);
        for (int64_t i = i0; i < i1; i += block_size) {
            const uint16_t *k = key_cache + ((int64_t)table[i / block_size] * block_size) * ss + g * head_dim;
            qk_block(1, qf, (const char *)k, ss, i1 - i < block_size ? i1 - i : block_size, group, head_dim, scale,
                     sc + i, ld);
        }
    }
    /* output columns per item: a multiple of pv_bf16's chunk of 32 (else of LANES), about head_dim / parts */
    const int64_t unit = fast_pv ? 32 : LANES, col_blocks = head_dim / unit;
    const int64_t per = (col_blocks + parts - 1) / parts, cols = unit * (per < 1 ? 1 : per);
    const int64_t chunks = (head_dim + cols - 1) / cols;
    _Pragma("omp for schedule(static)") for (int64_t it = 0; it < pairs * chunks; it++) {
        const int64_t s = it / (num_kv_heads * chunks), g = it / chunks % num_kv_heads, c = it % chunks;
        if (!p) continue;
        const int64_t ctx = seq_lens[s], d0 = c * cols, d1 = d0 + cols < head_dim ? d0 + cols : head_dim;
        const int32_t *table = block_tables + s * bt_stride;
        prefetch_part((const char *)value_cache, table, g, 0, ctx, d0, d1, head_dim, block_size, ss, 2);
        for (int64_t h = 0; h < group; h++) {
            memcpy(p + h * ctx, shared + (s * num_heads + g * group + h) * ld, sizeof(float) * (size_t)ctx);
            softmax(p + h * ctx, ctx);
        }
        pv_columns(1, fast_pv, p, value_cache, table, g, ctx, group, d0, d1, head_dim, block_size, ss, acc);
        uint16_t *o = out + (s * num_heads + g * group) * head_dim;
        for (int64_t h = 0; h < group; h++)
            for (int64_t d = d0; d < d1; d++) o[h * head_dim + d] = f32_to_bf16(acc[h * head_dim + d]);
    }
}

#endif
