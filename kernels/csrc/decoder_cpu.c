/* A Llama-family decoder stack in one call: RoPE with the KV-cache write, and
 * the layers' sequence of kernels (RMSNorm, fused q/k/v projection, RoPE and
 * cache write, paged attention, output projection plus residual, RMSNorm,
 * fused gate/up projection, SwiGLU, down projection plus residual), then the
 * final RMSNorm, for bfloat16 (on whichever body each kernel has for the
 * build's ISA: AVX512-BF16, AVX2/FMA or portable C).
 *
 * Built with the other kernels by kernels/cpu_build.py, called from
 * kernels/cpu_decoder.py. The per-layer work is the same kernels the model's
 * per-operation path calls (linear_cpu.c, linear_q4_cpu.c, norm_act_cpu.c,
 * paged_attention_cpu.c, rope_cache_bf16 below) on the same inputs, so the
 * hidden states have the same bits either way; one call instead of ~10
 * Python-level operations per layer removes the interpreter and dispatch time
 * that dominated a small model's decode step, and the GIL is released for the
 * whole forward pass (ctypes drops it during foreign calls). A decode step of
 * up to LINEAR_Q4_DIRECT_ROWS rows on 4-bit weights runs its layers in one
 * OpenMP parallel region (decode_team) instead of five per layer, with every
 * thread busy in every phase.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* RoPE (Su et al. 2021, rotate-half layout as HF Llama) on one head x [head_dim] of a row, in place, in
 * float32 with the row's cos/sin [head_dim], one rounding. */
static inline void rope_head(uint16_t *x, const float *c, const float *s, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        x[i] = f32_to_bf16(a * c[i] - b * s[i]);
        x[i + half] = f32_to_bf16(b * c[i + half] + a * s[i + half]);
    }
}

/* Positions outside [0, max_positions): 1, else 0. */
static int positions_outside(const int64_t *positions, int64_t t, int64_t max_positions) {
    for (int64_t r = 0; r < t; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return 1;
    return 0;
}

/* RoPE (rope_head) on the first num_heads + num_kv_heads heads of each row of qkv [t, ld] (q heads, then k
 * heads, then v heads, each head_dim wide) with the float32 cos/sin tables [*, head_dim] at positions[row];
 * then the row's rotated keys and its values are copied into key_cache / value_cache [num_blocks *
 * block_size, num_kv_heads, head_dim] at slot slot_mapping[row] (-1: not written). Returns 0, or 1 when a
 * position is negative or not below max_positions. */
int rope_cache_bf16(uint16_t *qkv, int64_t ld, int64_t t, const int64_t *positions, const float *cos_tab,
                    const float *sin_tab, int64_t max_positions, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, const int64_t *slot_mapping, uint16_t *key_cache, uint16_t *value_cache,
                    int num_threads) {
    if (positions_outside(positions, t, max_positions)) return 1;
    const int64_t kv_width = num_kv_heads * head_dim;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (t > 1)")
    for (int64_t r = 0; r < t; r++) {
        uint16_t *row = qkv + r * ld;
        const float *c = cos_tab + positions[r] * head_dim, *s = sin_tab + positions[r] * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) rope_head(row + h * head_dim, c, s, head_dim);
        if (slot_mapping[r] >= 0) {
            uint16_t *kd = key_cache + slot_mapping[r] * kv_width, *vd = value_cache + slot_mapping[r] * kv_width;
            const uint16_t *k = row + num_heads * head_dim, *v = k + kv_width;
            for (int64_t i = 0; i < kv_width; i++) {
                kd[i] = k[i];
                vd[i] = v[i];
            }
        }
    }
    return 0;
}

/* Whether a call of m rows of layer w's projection i reads its 4-bit panels (see project). */
static int reads_q4(const decoder_layer *w, int i, int64_t m) {
    if (w->i8_codes[i] || w->fp8_codes[i]) return 0;
#if defined(QUANT_COPY_EVERY_ROW)
    return w->q4_codes[i] != 0; /* integer dots: other bits than the bfloat16 panels */
#else
    return w->q4_codes[i] && (m <= QUANT_COPY_MAX_ROWS || !w->bf16[i]);
#endif
}

/* Projection i of layer w: its int8 (W8A8, W8A16) or FP8 panels when it has them; else its 4-bit
 * panels for every row count on the x86 builds (integer dots: QUANT_COPY_EVERY_ROW, kernels.h); on
 * the portable build, with both forms, calls of at most QUANT_COPY_MAX_ROWS rows read the 4-bit
 * panels (bound by reading the weights: fewer bytes) and larger ones the bfloat16 panels (bound by
 * arithmetic: no dequantization), both with the same bits. */
static int project(const decoder_layer *w, int i, const uint16_t *x, int64_t ldx, const float *bias,
                   const uint16_t *residual, int64_t ldr, uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                   int num_threads) {
    if (w->i8_codes[i] && w->i8_sums[i])
        return linear_w8a8(x, ldx, w->i8_codes[i], w->i8_sums[i], w->i8_scales[i], bias, residual, ldr, y, ldy, m, n,
                           k, 0, num_threads);
    if (w->i8_codes[i])
        return linear_q8(x, ldx, w->i8_codes[i], w->i8_scales[i], w->i8_group[i], bias, residual, ldr, y, ldy, m, n,
                         k, 0, num_threads);
    if (w->fp8_codes[i])
        return linear_fp8(x, ldx, w->fp8_codes[i], w->fp8_scales[i], w->fp8_group[i], bias, residual, ldr, y, ldy,
                          m, n, k, 0, num_threads);
    if (reads_q4(w, i, m))
        return linear_q4(x, ldx, w->q4_codes[i], w->q4_scales[i], w->q4_group[i], w->q4_perm[i], bias, residual,
                         ldr, y, ldy, m, n, k, 0, num_threads);
    return linear_bf16(x, ldx, w->bf16[i], bias, residual, ldr, y, ldy, m, n, k, 0, num_threads);
}

/* Whether a step of t rows runs in one parallel region (decode_team): t decode rows, one per sequence
 * (query_start_loc [s] = s), at most LINEAR_Q4_DIRECT_ROWS of them, every projection read from its 4-bit
 * panels in their input order (linear_q4_team), on an integer build (QUANT_COPY_EVERY_ROW), attention
 * shapes that paged_attention_bf16 takes. */
static int team_step(const decoder_shape *shape, const decoder_layer *layers, int64_t t,
                     const int32_t *query_start_loc, int64_t num_seqs) {
#if defined(QUANT_COPY_EVERY_ROW)
    if (t > LINEAR_Q4_DIRECT_ROWS || num_seqs != t || shape->head_dim % 16 || shape->num_kv_heads <= 0
        || shape->num_heads % shape->num_kv_heads)
        return 0;
    for (int64_t s = 0; s <= num_seqs; s++)
        if (query_start_loc[s] != s) return 0;
    for (int64_t l = 0; l < shape->num_layers; l++)
        for (int i = 0; i < 4; i++) {
            const decoder_layer *w = layers + l;
            if (!reads_q4(w, i, t) || w->q4_perm[i] || w->q4_group[i] <= 0 || w->q4_group[i] % 32) return 0;
        }
    return 1;
#else
    (void)shape, (void)layers, (void)t, (void)query_start_loc, (void)num_seqs;
    return 0;
#endif
}

/* The layers of a decode step (team_step) in one OpenMP parallel region instead of five per layer: each
 * projection's and the attention's work items shared by the team (linear_q4_team,
 * paged_attention_bf16_team: the same items as their own regions run), RoPE and the cache write one item
 * per head (the same per-head arithmetic as rope_cache_bf16), and the RMSNorms and SwiGLU, a few microseconds each, computed by every thread into its own
 * buffer rather than by one thread while the others wait. Each operation is the same arithmetic on the
 * same inputs as in decoder_forward_bf16's loop, so the same bits; five barriers per layer (six where the
 * attention runs in two rounds), no fork. qkv, attn, gate_up, x2, scores [t][num_heads][ld]: the step's
 * shared scratch. Returns 0, or 2 when out of memory. */
static int decode_team(const decoder_shape *shape, const decoder_layer *layers, uint16_t *x, int64_t t,
                       const int64_t *positions, const float *cos_tab, const float *sin_tab,
                       const int64_t *slot_mapping, const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *seq_lens, const int32_t *query_start_loc, uint16_t *qkv, uint16_t *attn,
                       uint16_t *gate_up, uint16_t *x2, float *scores, int64_t ld, int num_threads) {
    const int64_t hd = shape->hidden, dh = shape->head_dim, q = shape->num_heads * dh;
    const int64_t kv_width = shape->num_kv_heads * dh, qkv_w = q + 2 * kv_width, inter = shape->intermediate;
    const int64_t kv = shape->num_kv_heads, rope_heads = shape->num_heads + kv;
    const float eps = shape->rms_norm_eps;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)") {
        static __thread void *buf;
        static __thread size_t cap;
        /* this thread's normed rows h [t, hd] and SwiGLU rows act [t, inter] */
        uint16_t *h = scratch_grow(&buf, &cap, sizeof(uint16_t) * (size_t)(t * (hd + inter))), *act = h + t * hd;
        int mine = h ? 0 : 2;
        _Pragma("omp atomic update") failed |= mine;
        _Pragma("omp barrier")
        int stop;
        _Pragma("omp atomic read") stop = failed;
        for (int64_t l = 0; l < shape->num_layers && !stop; l++) {
            const decoder_layer *w = layers + l;
            rms_norm_bf16(x, hd, w->input_norm, h, hd, t, hd, eps, 1);
            mine = linear_q4_team(h, hd, w->q4_codes[0], w->q4_scales[0], w->q4_group[0], w->qkv_bias, 0, 0, qkv,
                                  qkv_w, t, qkv_w, hd);
            _Pragma("omp for schedule(static)") for (int64_t item = 0; item < t * (rope_heads + kv); item++) {
                /* one head of row r: q and k heads rotated, k and v heads then copied to the caches */
                const int64_t r = item / (rope_heads + kv), head = item % (rope_heads + kv);
                uint16_t *x_head = qkv + r * qkv_w + head * dh;
                if (head < rope_heads)
                    rope_head(x_head, cos_tab + positions[r] * dh, sin_tab + positions[r] * dh, dh);
                if (head >= shape->num_heads && slot_mapping[r] >= 0) {
                    const int64_t j = head - shape->num_heads; /* k heads, then v heads */
                    uint16_t *cache = j < kv ? w->key_cache : w->value_cache;
                    memcpy(cache + slot_mapping[r] * kv_width + j % kv * dh, x_head, sizeof(uint16_t) * (size_t)dh);
                }
            }
            mine |= paged_attention_bf16_team(qkv, qkv_w, w->key_cache, w->value_cache, attn, block_tables,
                                              bt_stride, seq_lens, query_start_loc, t, shape->num_heads,
                                              shape->num_kv_heads, dh, shape->block_size, shape->scale, scores, ld);
            mine |= linear_q4_team(attn, q, w->q4_codes[1], w->q4_scales[1], w->q4_group[1], 0, x, hd, x2, hd, t, hd,
                                   q);
            rms_norm_bf16(x2, hd, w->post_norm, h, hd, t, hd, eps, 1);
            mine |= linear_q4_team(h, hd, w->q4_codes[2], w->q4_scales[2], w->q4_group[2], 0, 0, 0, gate_up,
                                   2 * inter, t, 2 * inter, hd);
            silu_mul_bf16(gate_up, 2 * inter, act, inter, t, inter, 1);
            mine |= linear_q4_team(act, inter, w->q4_codes[3], w->q4_scales[3], w->q4_group[3], 0, x2, hd, x, hd, t,
                                   hd, inter);
            if (mine) {
                _Pragma("omp atomic update") failed |= mine;
            }
        }
    }
    return failed;
}

/* out [t, hidden] = final_norm(layers(x)) for x [t, hidden] bfloat16 (the
 * token embeddings; overwritten: it carries the residual stream). positions,
 * slot_mapping [t] int64; block_tables [num_seqs, bt_stride], seq_lens
 * [num_seqs], query_start_loc [num_seqs + 1] int32 as paged_attention_bf16
 * reads them. Returns 0; 1 for a position outside the RoPE tables or shapes
 * the attention does not take; 2 when out of memory. */
int decoder_forward_bf16(const decoder_shape *shape, const decoder_layer *layers, const uint16_t *final_norm,
                         uint16_t *x, uint16_t *out, int64_t t, const int64_t *positions, const float *cos_tab,
                         const float *sin_tab, const int64_t *slot_mapping, const int32_t *block_tables,
                         int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                         int64_t num_seqs, int num_threads) {
    const int64_t hd = shape->hidden, q = shape->num_heads * shape->head_dim;
    const int64_t qkv_w = q + 2 * shape->num_kv_heads * shape->head_dim, inter = shape->intermediate;
    if (t == 0) return 0;
    const int team = team_step(shape, layers, t, query_start_loc, num_seqs);
    int64_t ld = 1; /* a team step's attention scores: [t][num_heads][ld], ld the longest context */
    for (int64_t s = 0; team && s < num_seqs; s++) ld = seq_lens[s] > ld ? seq_lens[s] : ld;
    const int64_t nscores = team ? t * shape->num_heads * ld : 0;
    /* Scratch: the scores, then h [t, hd], x2 [t, hd], qkv [t, qkv_w], attn [t, q], gate_up [t, 2 inter], act
     * [t, inter]. */
    float *scores = malloc(sizeof(float) * (size_t)nscores
                           + sizeof(uint16_t) * (size_t)(t * (2 * hd + qkv_w + q + 3 * inter)));
    if (!scores) return 2;
    uint16_t *scratch = (uint16_t *)(scores + nscores);
    uint16_t *h = scratch, *x2 = h + t * hd, *qkv = x2 + t * hd, *attn = qkv + t * qkv_w, *gate_up = attn + t * q;
    uint16_t *act = gate_up + t * 2 * inter;
    int rc = 0;
    if (team) {
        rc = positions_outside(positions, t, shape->max_positions)
                 ? 1
                 : decode_team(shape, layers, x, t, positions, cos_tab, sin_tab, slot_mapping, block_tables, bt_stride,
                               seq_lens, query_start_loc, qkv, attn, gate_up, x2, scores, ld, num_threads);
        if (rc == 0) rms_norm_bf16(x, hd, final_norm, out, hd, t, hd, shape->rms_norm_eps, num_threads);
        free(scores);
        return rc;
    }
    for (int64_t l = 0; l < shape->num_layers && rc == 0; l++) {
        const decoder_layer *w = layers + l;
        rms_norm_bf16(x, hd, w->input_norm, h, hd, t, hd, shape->rms_norm_eps, num_threads);
        rc = project(w, 0, h, hd, w->qkv_bias, 0, 0, qkv, qkv_w, t, qkv_w, hd, num_threads);
        if (rc) break;
        rc = rope_cache_bf16(qkv, qkv_w, t, positions, cos_tab, sin_tab, shape->max_positions, shape->num_heads,
                             shape->num_kv_heads, shape->head_dim, slot_mapping, w->key_cache, w->value_cache,
                             num_threads);
        if (rc) break;
        rc = paged_attention_bf16(qkv, qkv_w, w->key_cache, w->value_cache, attn, block_tables, bt_stride, seq_lens,
                                  query_start_loc, num_seqs, shape->num_heads, shape->num_kv_heads, shape->head_dim,
                                  shape->block_size, shape->scale, num_threads);
        if (rc) break;
        rc = project(w, 1, attn, q, 0, x, hd, x2, hd, t, hd, q, num_threads);
        if (rc) break;
        rms_norm_bf16(x2, hd, w->post_norm, h, hd, t, hd, shape->rms_norm_eps, num_threads);
        rc = project(w, 2, h, hd, 0, 0, 0, gate_up, 2 * inter, t, 2 * inter, hd, num_threads);
        if (rc) break;
        silu_mul_bf16(gate_up, 2 * inter, act, inter, t, inter, num_threads);
        rc = project(w, 3, act, inter, 0, x2, hd, x, hd, t, hd, inter, num_threads);
    }
    if (rc == 0) rms_norm_bf16(x, hd, final_norm, out, hd, t, hd, shape->rms_norm_eps, num_threads);
    free(scores);
    return rc;
}
