/* The bfloat16 GEMM micro-kernel shared by linear_cpu.c (weights packed in
 * bfloat16) and linear_q4_cpu.c (4-bit weights dequantized into the same
 * layout): MR rows x one panel of 64 output columns, [k / 2][64][2] pairs
 * for VDPBF16PS, one float32 accumulator per output over the pairs in
 * order, then bias and residual in float32 and one rounding. */
#ifndef TANDEM_BF16_PANEL_H
#define TANDEM_BF16_PANEL_H

#include <stdint.h>
#include <string.h>

#include "common.h"

#define PANEL 64 /* output columns per panel */
#define MR_MAX 6 /* rows per register tile: 24 accumulators + 4 weight vectors + 1 broadcast */
#define M_BLOCK 48 /* rows per work item (a multiple of MR_MAX) */

#if defined(__AVX512BF16__)
/* Rows' accumulators acc[r][j], j < NG (lane l = column col0 + 16 j + l) plus bias
 * and residual, rounded once (VCVTNEPS2BF16: nearest even) or stored as
 * float32 when y_f32; columns from n on are not written. */
static inline __attribute__((always_inline)) void store_rows(
    const int MR, const int NG, __m512 acc[][4], int64_t col0, int64_t n, const float *bias, const uint16_t *residual,
    int64_t ldr, void *y, int64_t ldy, int y_f32) {
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NG; j++) {
            const int64_t c = col0 + 16 * j;
            if (c >= n) break;
            const __mmask16 mask = tail_mask(n - c);
            __m512 v = acc[r][j];
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c));
            if (residual) {
                __m256i raw = _mm256_maskz_loadu_epi16(mask, residual + r * ldr + c);
                v = _mm512_add_ps(v, bf16x16_to_f32(raw));
            }
            if (y_f32)
                _mm512_mask_storeu_ps((float *)y + r * ldy + c, mask, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + c, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* MR rows (MR a literal at each call) x one 64-column panel. */
static inline __attribute__((always_inline)) void panel_rows(
    const int MR, const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t k, int64_t col0, int64_t n,
    const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int y_f32) {
    __m512 acc[MR_MAX][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < k / 2; kp++) {
        const uint16_t *wp = panel + kp * PANEL * 2;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3)); /* keep them in registers: one load per kp, not per row */
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * kp, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
        }
    }
    store_rows(MR, 4, acc, col0, n, bias, residual, ldr, y, ldy, y_f32);
}

/* Rows m0..m1 of x over one panel, six at a time, then the rest. */
static inline void panel_row_block(const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t k, int64_t col0,
                                   int64_t n, const float *bias, const uint16_t *residual, int64_t ldr, void *y,
                                   int64_t ldy, int y_f32, int64_t m0, int64_t m1) {
    int64_t r = m0;
#define ROWS(MR) panel_rows(MR, x + r * ldx, ldx, panel, k, col0, n, bias, residual ? residual + r * ldr : 0, ldr, \
                            (char *)y + r * ldy * (y_f32 ? 4 : 2), ldy, y_f32)
    for (; r + MR_MAX <= m1; r += MR_MAX) ROWS(MR_MAX);
    switch (m1 - r) {
    case 5: ROWS(5); break;
    case 4: ROWS(4); break;
    case 3: ROWS(3); break;
    case 2: ROWS(2); break;
    case 1: ROWS(1); break;
    }
#undef ROWS
}
#endif

#endif
