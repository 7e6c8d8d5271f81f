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
 * whole forward pass (ctypes drops it during foreign calls).
 */

#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

/* RoPE (Su et al. 2021, rotate-half layout as HF Llama) on the first
 * num_heads + num_kv_heads heads of each row of qkv [t, ld] (q heads, then k
 * heads, then v heads, each head_dim wide), in place, in float32 with the
 * float32 cos/sin tables [*, head_dim] at positions[row], one rounding; then
 * the row's rotated keys and its values are copied into key_cache /
 * value_cache [num_blocks * block_size, num_kv_heads, head_dim] at slot
 * slot_mapping[row] (-1: not written). Returns 0, or 1 when a position is
 * negative or not below max_positions. */
int rope_cache_bf16(uint16_t *qkv, int64_t ld, int64_t t, const int64_t *positions, const float *cos_tab,
                    const float *sin_tab, int64_t max_positions, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, const int64_t *slot_mapping, uint16_t *key_cache, uint16_t *value_cache,
                    int num_threads) {
    for (int64_t r = 0; r < t; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return 1;
    const int64_t half = head_dim / 2, kv_width = num_kv_heads * head_dim;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (t > 1)")
    for (int64_t r = 0; r < t; r++) {
        uint16_t *row = qkv + r * ld;
        const float *c = cos_tab + positions[r] * head_dim, *s = sin_tab + positions[r] * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            uint16_t *x = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
                x[i] = f32_to_bf16(a * c[i] - b * s[i]);
                x[i + half] = f32_to_bf16(b * c[i + half] + a * s[i + half]);
            }
        }
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

/* Projection i of layer w: its int8 (W8A8, W8A16) or FP8 panels when it has them; else, with both
 * forms, calls of at most QUANT_COPY_MAX_ROWS rows read the 4-bit panels (bound by reading the
 * weights: fewer bytes) and larger ones the bfloat16 panels (bound by
 * arithmetic: no dequantization); both give the same bits. The AVX2 build
 * reads the copy for every row count (QUANT_COPY_EVERY_ROW, kernels.h). */
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
#if defined(QUANT_COPY_EVERY_ROW)
    const int use_copy = w->q4_codes[i] != 0; /* integer dots: other bits than the bfloat16 panels */
#else
    const int use_copy = w->q4_codes[i] && (m <= QUANT_COPY_MAX_ROWS || !w->bf16[i]);
#endif
    if (use_copy)
        return linear_q4(x, ldx, w->q4_codes[i], w->q4_scales[i], w->q4_group[i], w->q4_perm[i], bias, residual,
                         ldr, y, ldy, m, n, k, 0, num_threads);
    return linear_bf16(x, ldx, w->bf16[i], bias, residual, ldr, y, ldy, m, n, k, 0, num_threads);
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
    /* Scratch: h [t, hd], x2 [t, hd], qkv [t, qkv_w], attn [t, q], gate_up [t, 2 inter], act [t, inter]. */
    uint16_t *scratch = malloc(sizeof(uint16_t) * (size_t)(t * (2 * hd + qkv_w + q + 3 * inter)));
    if (!scratch) return 2;
    uint16_t *h = scratch, *x2 = h + t * hd, *qkv = x2 + t * hd, *attn = qkv + t * qkv_w, *gate_up = attn + t * q;
    uint16_t *act = gate_up + t * 2 * inter;
    int rc = 0;
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
    free(scratch);
    return rc;
}
