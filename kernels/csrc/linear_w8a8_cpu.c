/* int8 x int8 linear layers (compressed-tensors int-quantized W8A8, as
 * llm-compressor's W8A8 recipes write them and vLLM's CompressedTensorsW8A8Int8
 * runs them): y = x @ W.T (+ bias) (+ residual) for bfloat16 x and int8
 * codes w with one float32 scale per output channel, the activations
 * quantized per row (per token) on the fly, symmetric and dynamic:
 *
 *   amax_r = max |x[r, :]|, qx[r, i] = rne(x[r, i] * (127 / amax_r)) (0 when
 *   amax_r is 0), sx_r = amax_r / 127 (vLLM's dynamic_scaled_int8_quant: each
 *   operation rounded once in float32, nearest even);
 *   acc[r, c] = sum_i qx[r, i] * w[c, i], exact in int32 (|qx|, |w| <= 127,
 *   128: no overflow below 131,000 inputs);
 *   y[r, c] = (float)acc[r, c] * (sx_r * sw_c), then + bias[c], then +
 *   residual[r, c], each rounded in float32, then to bfloat16 (nearest even)
 *   unless y_f32.
 *
 * The integer sums are exact, so their order does not matter: a row's bits
 * never depend on the rows beside it or the thread count (batch-invariant),
 * and every body gives the same bits (tests/engine/test_int8_linear.py pins
 * them to a float64 model of these steps). Bodies: AVX512-VNNI (VPDPBUSD, the
 * activations offset by 128 to unsigned bytes and 128 * the column's code sum
 * taken back), AVX2 (VPMADDUBSW on |w| and the activations with w's sign,
 * pairs within int16, then VPMADDWD), portable C.
 *
 * Packed layout (linear_w8a8_pack): per panel of 64 output columns, the codes
 * [k / 4][64 columns][4 inputs] (a VPDPBUSD operand is 16 columns' 4
 * consecutive inputs; AVX2 reads 8 columns' at a time), padded columns' codes
 * 0; col_sums [panel][64] int32, each column's sum of codes. Built with the
 * other kernels by kernels/cpu_build.py, called from kernels/cpu_linear.py. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#define W8A8_PANEL 64
#define W8A8_MR 4 /* rows per register tile */
/* An opaque use of v: the compiler cannot contract the product before it into the addition after it. */
#if defined(__x86_64__) || defined(__i386__)
#define NO_CONTRACT(v) __asm__("" : "+x"(v))
#else
#define NO_CONTRACT(v) __asm__("" : "+m"(v))
#endif

/* Codes [n, k] int8 (k a multiple of 4) into codes_out [ceil(n / 64)][k / 4][64][4] and col_sums [ceil(n / 64)][64]. */
void linear_w8a8_pack(const int8_t *codes, int64_t n, int64_t k, int8_t *codes_out, int32_t *col_sums) {
    const int64_t panels = (n + W8A8_PANEL - 1) / W8A8_PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < W8A8_PANEL; c++) {
            const int64_t row = p * W8A8_PANEL + c;
            int32_t sum = 0;
            for (int64_t i = 0; i < k; i++) {
                const int8_t v = row < n ? codes[row * k + i] : 0;
                codes_out[((p * (k / 4) + i / 4) * W8A8_PANEL + c) * 4 + i % 4] = v;
                sum += v;
            }
            col_sums[p * W8A8_PANEL + c] = sum;
        }
}

/* Row x [k] bfloat16 quantized: q [k] (offset by `offset`: 128 gives VPDPBUSD's unsigned bytes), returns sx. */
static float quantize_row(const uint16_t *x, int64_t k, int offset, uint8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float a = fabsf(bf16_to_f32(x[i]));
        amax = a > amax ? a : amax;
    }
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < k; i++) {
        float v = nearbyintf(bf16_to_f32(x[i]) * inv); /* the default rounding mode: nearest even */
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (uint8_t)((int)v + offset);
    }
    return amax / 127.0f;
}

/* Output (r, c) from its exact integer sum: the float32 steps of the top of this file. */
static inline void store_one(int32_t acc, float sx, float sw, const float *bias, const uint16_t *residual, int64_t ldr,
                             void *y, int64_t ldy, int y_f32, int64_t r, int64_t c) {
    const float s = sx * sw;
    float v = (float)acc * s;
    NO_CONTRACT(v);
    if (bias) v += bias[c];
    NO_CONTRACT(v);
    if (residual) v += bf16_to_f32(residual[r * ldr + c]);
    if (y_f32)
        ((float *)y)[r * ldy + c] = v;
    else
        ((uint16_t *)y)[r * ldy + c] = f32_to_bf16(v);
}

/* MR rows x the 32 columns of half h of a panel: the integer sums into acc [MR][32]. q: the rows' codes (k apart),
 * pc: the panel's codes. */
static inline __attribute__((always_inline)) void half_panel_sums(const int MR, const uint8_t *q, int64_t k,
                                                                  const int8_t *pc, int h, int32_t acc[][32]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i a[W8A8_MR][2];
    for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < k / 4; kq++) {
        const int8_t *w = pc + kq * W8A8_PANEL * 4 + 128 * h;
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        for (int r = 0; r < MR; r++) {
            int32_t four;
            memcpy(&four, q + r * k + 4 * kq, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, w0);
            a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, w1);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_si512(acc[r], a[r][0]);
        _mm512_storeu_si512(acc[r] + 16, a[r][1]);
    }
#elif defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r0 = 0; r0 < MR; r0 += 2) { /* two rows at a time: 8 accumulators */
        const int rows = MR - r0 < 2 ? MR - r0 : 2;
        __m256i a[2][4];
        for (int r = 0; r < 2; r++)
            for (int g = 0; g < 4; g++) a[r][g] = _mm256_setzero_si256();
        for (int64_t kq = 0; kq < k / 4; kq++) {
            const int8_t *w = pc + kq * W8A8_PANEL * 4 + 128 * h;
            __m256i wv[4], aw[4];
            for (int g = 0; g < 4; g++) {
                wv[g] = _mm256_loadu_si256((const __m256i *)(w + 32 * g));
                aw[g] = _mm256_abs_epi8(wv[g]);
            }
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, q + (r0 + r) * k + 4 * kq, 4);
                const __m256i xb = _mm256_set1_epi32(four);
                for (int g = 0; g < 4; g++) { /* |w| * (x with w's sign): pairs <= 2 * 128 * 127 */
                    const __m256i p = _mm256_maddubs_epi16(aw[g], _mm256_sign_epi8(xb, wv[g]));
                    a[r][g] = _mm256_add_epi32(a[r][g], _mm256_madd_epi16(p, ones));
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < 4; g++) _mm256_storeu_si256((__m256i *)(acc[r0 + r] + 8 * g), a[r][g]);
    }
#else
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < 32; c++) {
            int32_t s = 0;
            for (int64_t i = 0; i < k; i++)
                s += (int32_t)(int8_t)q[r * k + i] * pc[((i / 4) * W8A8_PANEL + 32 * h + c) * 4 + i % 4];
            acc[r][c] = s;
        }
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W8A8_OFFSET 128 /* VPDPBUSD multiplies unsigned bytes: qx + 128, less 128 * the column's sum */
#else
#define W8A8_OFFSET 0
#endif

/* y [m, n] = x [m, k] @ W.T (+ bias [n], float32) (+ residual [m, n]) for W
 * packed by linear_w8a8_pack with its column sums, scales [ceil(n / 64) * 64]
 * float32 (the output channels' sw, padded); the rows quantized per token as
 * the top of this file says. Strides and y_f32 as linear_bf16. Returns 0, 1
 * for k not a multiple of 4, 2 when out of memory. */
int linear_w8a8(const uint16_t *x, int64_t ldx, const int8_t *codes, const int32_t *col_sums, const float *scales,
                const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
                int64_t k, int y_f32, int num_threads) {
    if (k % 4) return 1;
    if (m == 0) return 0;
    uint8_t *q = malloc((size_t)(m * k));
    float *sx = malloc(sizeof(float) * (size_t)m);
    if (!q || !sx) {
        free(q);
        free(sx);
        return 2;
    }
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t r = 0; r < m; r++) sx[r] = quantize_row(x + r * ldx, k, W8A8_OFFSET, q + r * k);
    const int64_t panels = (n + W8A8_PANEL - 1) / W8A8_PANEL;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t item = 0; item < panels * 2; item++) {
        const int64_t p = item / 2;
        const int h = (int)(item % 2);
        const int64_t col0 = p * W8A8_PANEL + 32 * h;
        if (col0 >= n) continue;
        const int8_t *pc = codes + p * k * W8A8_PANEL;
        int32_t acc[W8A8_MR][32];
        for (int64_t r0 = 0; r0 < m; r0 += W8A8_MR) {
            const int64_t rows = m - r0 < W8A8_MR ? m - r0 : W8A8_MR;
            const uint8_t *qr = q + r0 * k;
            if (rows == 4) half_panel_sums(4, qr, k, pc, h, acc);
            else if (rows == 3) half_panel_sums(3, qr, k, pc, h, acc);
            else if (rows == 2) half_panel_sums(2, qr, k, pc, h, acc);
            else half_panel_sums(1, qr, k, pc, h, acc);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < 32 && col0 + c < n; c++) {
                    const int32_t sum = acc[r][c] - W8A8_OFFSET * col_sums[col0 + c];
                    store_one(sum, sx[r0 + r], scales[col0 + c], bias, residual, ldr, y, ldy, y_f32, r0 + r,
                              col0 + c);
                }
        }
    }
    free(q);
    free(sx);
    return 0;
}
