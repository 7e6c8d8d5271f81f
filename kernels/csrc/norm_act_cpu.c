/* bfloat16 RMSNorm and SwiGLU's silu(gate) * up, one pass per row.
 *
 * Built with the other kernels by kernels/cpu_build.py, called from
 * kernels/cpu_norm_act.py. Each row is computed by one thread, in the same
 * order whatever the number of rows: batch-invariant. Arithmetic in float32,
 * one rounding to bfloat16 (nearest even) per output.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* y[r] = bf16(weight * x[r] / sqrt(mean(x[r]^2) + eps)) for rows r < rows,
 * float32 throughout and one rounding (HF Llama rounds the normalised value
 * to bfloat16 before the weight multiplies it: one more rounding error);
 * x, y: bfloat16 with row strides ldx, ldy; weight: bfloat16 [n]; n a
 * multiple of 16. Returns 0, or 1 when n is not a multiple of 16. */
int rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *weight, uint16_t *y, int64_t ldy, int64_t rows,
                  int64_t n, float eps, int num_threads) {
    if (n % LANES) return 1;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *yr = y + r * ldy;
        float lanes[LANES] = {0};
        for (int64_t i = 0; i < n; i += LANES)
            for (int l = 0; l < LANES; l++) {
                const float v = bf16_to_f32(xr[i + l]);
                lanes[l] += v * v;
            }
        const float inv = 1.0f / sqrtf(lane_sum(lanes) / (float)n + eps);
        for (int64_t i = 0; i < n; i++)
            yr[i] = f32_to_bf16(bf16_to_f32(weight[i]) * (bf16_to_f32(xr[i]) * inv));
    }
    return 0;
}

/* y[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j] for j < inter (SwiGLU,
 * Shazeer 2020): bfloat16 in and out, float32 inside, one rounding. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t ld, uint16_t *y, int64_t ldy, int64_t rows, int64_t inter,
                   int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * inter >= 16384)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * ld, *u = gate_up + r * ld + inter;
        uint16_t *yr = y + r * ldy;
#if defined(__AVX512BF16__)
        for (int64_t j = 0; j < inter; j += 16) {
            const __mmask16 mask = tail_mask(inter - j);
            const __m512 a = bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, g + j));
            const __m512 b = bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, u + j));
            const __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 t = exp_neg16(_mm512_min_ps(a, _mm512_sub_ps(_mm512_setzero_ps(), a))); /* e^-|a| */
            const __m512 num = _mm512_mask_mul_ps(a, neg, a, t);                                  /* a or a e^a */
            const __m512 silu = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), t));
            _mm256_mask_storeu_epi16(yr + j, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, b)));
        }
#else
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 8 <= inter; j += 8) { /* the scalar loop's arithmetic on 8 lanes */
            const __m256 a = bf16x8_to_f32(_mm_loadu_si128((const __m128i *)(g + j)));
            const __m256 b = bf16x8_to_f32(_mm_loadu_si128((const __m128i *)(u + j)));
            const __m256 neg = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 t = exp_neg8(_mm256_min_ps(a, _mm256_sub_ps(_mm256_setzero_ps(), a))); /* e^-|a| */
            const __m256 num = _mm256_blendv_ps(a, _mm256_mul_ps(a, t), neg);                  /* a or a e^a */
            const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), t));
            _mm_storeu_si128((__m128i *)(yr + j), f32x8_to_bf16(_mm256_mul_ps(silu, b)));
        }
#endif
        for (; j < inter; j++) {
            const float a = bf16_to_f32(g[j]), t = exp_neg(a < 0 ? a : -a); /* e^-|a| */
            const float silu = (a < 0 ? a * t : a) / (1.0f + t);
            yr[j] = f32_to_bf16(silu * bf16_to_f32(u[j]));
        }
#endif
    }
}
