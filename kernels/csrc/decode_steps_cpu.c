/* Several greedy decode steps of a batch in one call (vLLM's multi-step
 * scheduling, `num_scheduler_steps`, with the argmax done here): per step,
 * the rows' token embeddings, the decoder stack (decoder_forward_bf16), the
 * output head's float32 logits (linear_q8 on the head's 8-bit copy, or
 * linear_bf16 on its panels) and each row's first maximum; the token chosen
 * is the next step's input. The same kernels on the same inputs as the
 * engine's per-step path (kernels/cpu_decoder.py, the model's head method,
 * the sampler's argmax_rows), so the same tokens; what it saves is the
 * Python between two steps, which on a small model costs ~15 % of a
 * one-sequence step (the weights' pass evicts the interpreter's code and
 * data from the last-level cache every step: docs/benchmarks/decode-roofline.md).
 *
 * Called from kernels/cpu_decoder.py (decode_greedy).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* The maximum of the numbers of x [n] float32 (NaNs skipped; -inf where there are none) into *m, and whether
 * any NaN is there: 16 lanes at a time where the build has AVX-512, 8 with AVX2 (MAXPS returns its second
 * operand when the first is a NaN, so a NaN never enters the maximum), else one at a time. */
static int max_and_nan(const float *x, int64_t n, float *m) {
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-__builtin_inff());
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = tail_mask(n - i);
        const __m512 v = _mm512_mask_loadu_ps(vm, mask, x + i);
        vm = _mm512_max_ps(v, vm);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    *m = _mm512_reduce_max_ps(vm);
    return nan != 0;
#else
    float best = -__builtin_inff();
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX2__)
    __m256 vm = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vm = _mm256_max_ps(v, vm);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
#endif
    for (; i < n; i++) {
        best = x[i] > best ? x[i] : best;
        nan |= x[i] != x[i];
    }
    *m = best;
    return nan;
#endif
}

/* The index of the first maximum of x [n] float32, a NaN before any number (numpy's argmax, which the
 * sampler's argmax_rows uses): the maximum first (max_and_nan), then the first index holding it (the zeros
 * -0 and +0 compare equal, as numpy's `>` sees them) or the first NaN. The serial loop with its early exit
 * took ~60 us of a 49,152-logit row, 2 % of a one-row step. */
static int64_t first_max(const float *x, int64_t n) {
    float m;
    const int nan = max_and_nan(x, n, &m);
    for (int64_t i = 0; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;
}

/* tokens [steps + 1, rows] int64: row 0 holds each sequence's next input token, and step k writes the token
 * it chose into row k + 1. Sequence r's input at step k sits at position start_positions[r] + k, its key and
 * value go to that position's slot of block_tables[r] [bt_stride] (int32, long enough), and it attends over
 * the positions before and at it. embed [vocab, hidden] bfloat16 (a row per token); the head is head_q8_codes
 * / head_q8_scales / head_q8_group (linear_q8_pack) when head_q8_codes is not NULL, else head_panels
 * (linear_bf16_pack), [vocab, hidden]. Returns 0; 1 for a position outside the RoPE tables or shapes the
 * attention does not take; 2 when out of memory; 3 for a token outside the vocabulary. */
int decode_greedy_bf16(const decoder_shape *shape, const decoder_layer *layers, const uint16_t *final_norm,
                       const uint16_t *embed, const int8_t *head_q8_codes, const float *head_q8_scales,
                       int64_t head_q8_group, const uint16_t *head_panels, int64_t vocab, int64_t *tokens,
                       int64_t rows, int64_t steps, const int64_t *start_positions, const float *cos_tab,
                       const float *sin_tab, const int32_t *block_tables, int64_t bt_stride, int num_threads) {
    const int64_t hd = shape->hidden, bs = shape->block_size;
    /* Scratch: logits [rows, vocab] float32, then x and out [rows, hd] bfloat16, positions and slots [rows]
     * int64, seq_lens [rows] and query_start_loc [rows + 1] int32. */
    float *logits = malloc(sizeof(float) * (size_t)(rows * vocab) + sizeof(uint16_t) * (size_t)(2 * rows * hd)
                           + sizeof(int64_t) * (size_t)(2 * rows) + sizeof(int32_t) * (size_t)(2 * rows + 1));
    if (!logits) return 2;
    uint16_t *x = (uint16_t *)(logits + rows * vocab), *out = x + rows * hd;
    int64_t *positions = (int64_t *)(out + rows * hd), *slots = positions + rows;
    int32_t *seq_lens = (int32_t *)(slots + rows), *qsl = seq_lens + rows;
    for (int64_t r = 0; r <= rows; r++) qsl[r] = (int32_t)r;
    int rc = 0;
    for (int64_t k = 0; k < steps && rc == 0; k++) {
        const int64_t *in = tokens + k * rows;
        for (int64_t r = 0; r < rows; r++) {
            if (in[r] < 0 || in[r] >= vocab) {
                rc = 3;
                break;
            }
            memcpy(x + r * hd, embed + in[r] * hd, sizeof(uint16_t) * (size_t)hd);
            const int64_t p = start_positions[r] + k;
            positions[r] = p;
            slots[r] = (int64_t)block_tables[r * bt_stride + p / bs] * bs + p % bs;
            seq_lens[r] = (int32_t)(p + 1);
        }
        if (rc) break;
        rc = decoder_forward_bf16(shape, layers, final_norm, x, out, rows, positions, cos_tab, sin_tab, slots,
                                  block_tables, bt_stride, seq_lens, qsl, rows, num_threads);
        if (rc) break;
        rc = head_q8_codes ? linear_q8(out, hd, head_q8_codes, head_q8_scales, head_q8_group, NULL, NULL, 0, logits,
                                       vocab, rows, vocab, hd, 1, num_threads)
                           : linear_bf16(out, hd, head_panels, NULL, NULL, 0, logits, vocab, rows, vocab, hd, 1,
                                         num_threads);
        if (rc) break;
        for (int64_t r = 0; r < rows; r++) tokens[(k + 1) * rows + r] = first_max(logits + r * vocab, vocab);
    }
    free(logits);
    return rc;
}
