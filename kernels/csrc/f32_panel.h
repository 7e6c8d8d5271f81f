/* The float32 GEMM micro-kernel for CPUs without AVX512-BF16, shared by
 * linear_cpu.c and linear_q4_cpu.c: it reads bf16_panel.h's packed bfloat16
 * panels ([k / 2][64][2]: one output column's pair of consecutive inputs
 * side by side), widens each weight to float32 in registers (exact: a
 * bfloat16 is the top half of a float32) and accumulates with float32 FMAs.
 *
 * Rounding and order: each output has one float32 accumulator, starting from
 * zero, that receives fma(x[i], w[i], acc) for i = 0, 1, ..., k - 1 in
 * order (one rounding per step); then bias and residual are added in float32
 * and the sum is rounded once to bfloat16 (nearest even; NaN stays NaN), or
 * stored as float32 when y_f32. x is widened to float32 first (exact). The
 * row tiling (how many rows, which columns a tile holds) changes only which
 * outputs are computed together, never one output's sequence of operations:
 * a row's bits depend only on that row and the weight, for every row count
 * and thread count (batch-invariant). The portable body (fmaf) and the
 * AVX2/FMA/F16C body (VFMADD231PS) run that same sequence, so they give the same
 * bits; the AVX512-BF16 kernel (VDPBF16PS adds a pair's two products before
 * the accumulator) gives others, within float32 rounding of these.
 *
 * Work buffer: the caller hands in xf, room for (m1 - m0) * k floats.
 */
#ifndef TANDEM_F32_PANEL_H
#define TANDEM_F32_PANEL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_panel.h"
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#include <immintrin.h>
#define F32_PANEL_AVX2 1
#endif

/* This thread's float32 buffer of at least `elems` values (scratch_grow). */
static inline float *f32_scratch(size_t elems) {
    static __thread void *buf;
    static __thread size_t cap;
    return scratch_grow(&buf, &cap, sizeof(float) * elems);
}

/* rows x k bfloat16 values (ldx apart) as float32, xf [rows][k] (exact). */
static inline void f32_widen_rows(const uint16_t *x, int64_t ldx, int64_t rows, int64_t k, float *xf) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_f32(x[r * ldx + i]);
}

/* Output (r, c) of a tile after the accumulation: bias, residual, one rounding. */
static inline void f32_store_one(float v, int64_t r, int64_t c, const float *bias, const uint16_t *residual,
                                 int64_t ldr, void *y, int64_t ldy, int y_f32) {
    if (bias) v = v + bias[c];
    if (residual) v = v + bf16_to_f32(residual[r * ldr + c]);
    if (y_f32)
        ((float *)y)[r * ldy + c] = v;
    else
        ((uint16_t *)y)[r * ldy + c] = f32_to_bf16(v);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* Rows' accumulators acc[r][g], g < NG (lane l = column col0 + 8 g + l) plus
 * bias and residual, rounded once or stored as float32 when y_f32; columns
 * from n on are not written. (Also quant_int.h's AVX2 body's, on AVX-512
 * builds without VNNI.) */
static inline __attribute__((always_inline)) void f32_store_rows(
    const int MR, const int NG, __m256 acc[][8], int64_t col0, int64_t n, const float *bias, const uint16_t *residual,
    int64_t ldr, void *y, int64_t ldy, int y_f32) {
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < NG; g++) {
            const int64_t c = col0 + 8 * g;
            if (c >= n) break;
            if (n - c < 8) { /* the last, partial group: the same operations one lane at a time */
                float v[8];
                _mm256_storeu_ps(v, acc[r][g]);
                for (int64_t l = 0; l < n - c; l++) f32_store_one(v[l], r, c + l, bias, residual, ldr, y, ldy, y_f32);
                break;
            }
            __m256 v = acc[r][g];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
            if (residual) {
                const __m256i raw = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(residual + r * ldr + c)));
                v = _mm256_add_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)));
            }
            if (y_f32)
                _mm256_storeu_ps((float *)y + r * ldy + c, v);
            else
                _mm_storeu_si128((__m128i *)((uint16_t *)y + r * ldy + c), f32x8_to_bf16(v));
        }
}
#endif

#if defined(F32_PANEL_AVX2)
/* MR rows x NG groups of 8 columns (MR, NG literals at each call), the tile's
 * first column col0 (absolute) and its weights at panel (already offset to
 * the tile's first column); xf: the rows as float32, ldxf apart. */
static inline __attribute__((always_inline)) void f32_tile(
    const int MR, const int NG, const float *xf, int64_t ldxf, const uint16_t *panel, int64_t k, int64_t col0,
    int64_t n, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int y_f32) {
    __m256 acc[MR_MAX][8];
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < NG; g++) acc[r][g] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kp = 0; kp < k / 2; kp++) {
        const uint16_t *wp = panel + kp * PANEL * 2;
        for (int odd = 0; odd < 2; odd++) { /* input 2 kp, then 2 kp + 1: each accumulator in input order */
            __m256 w[8];
            for (int g = 0; g < NG; g++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(wp + 16 * g));
                w[g] = _mm256_castsi256_ps(odd ? _mm256_and_si256(raw, high) : _mm256_slli_epi32(raw, 16));
            }
            for (int r = 0; r < MR; r++) {
                const __m256 xb = _mm256_broadcast_ss(xf + r * ldxf + 2 * kp + odd);
                for (int g = 0; g < NG; g++) acc[r][g] = _mm256_fmadd_ps(xb, w[g], acc[r][g]);
            }
        }
    }
    f32_store_rows(MR, NG, acc, col0, n, bias, residual, ldr, y, ldy, y_f32);
}
#endif

/* Rows m0..m1 of x (bfloat16, ldx apart) over one packed panel whose first
 * column is col0; xf: the work buffer ((m1 - m0) * k floats). */
static inline void f32_panel_row_block(const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t k,
                                       int64_t col0, int64_t n, const float *bias, const uint16_t *residual,
                                       int64_t ldr, void *y, int64_t ldy, int y_f32, int64_t m0, int64_t m1,
                                       float *xf) {
    f32_widen_rows(x + m0 * ldx, ldx, m1 - m0, k, xf);
#if defined(F32_PANEL_AVX2)
    const size_t ysz = y_f32 ? 4 : 2;
#define TILE(MR, NG, S) f32_tile(MR, NG, xf + (r - m0) * k, k, panel + 16 * (S), k, col0 + 8 * (S), n, bias, \
                                 residual ? residual + r * ldr : 0, ldr, (char *)y + r * ldy * ysz, ldy, y_f32)
    if (m1 - m0 <= 2) { /* a few rows: each streams the whole panel once, 64 columns per input */
        for (int64_t r = m0; r < m1; r++) TILE(1, 8, 0);
        return;
    }
    for (int s = 0; s < PANEL / 8; s += 2) { /* 16 columns, 6 rows a tile: 12 accumulators + 2 weights + 1 x */
        if (col0 + 8 * s >= n) break;
        int64_t r = m0;
        for (; r + MR_MAX <= m1; r += MR_MAX) TILE(MR_MAX, 2, s);
        switch (m1 - r) {
        case 5: TILE(5, 2, s); break;
        case 4: TILE(4, 2, s); break;
        case 3: TILE(3, 2, s); break;
        case 2: TILE(2, 2, s); break;
        case 1: TILE(1, 2, s); break;
        }
    }
#undef TILE
#else
    for (int64_t r = m0; r < m1; r++)
        for (int64_t j = 0; j < PANEL && col0 + j < n; j++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++)
                acc = fmaf(xf[(r - m0) * k + i], bf16_to_f32(panel[(i / 2 * PANEL + j) * 2 + i % 2]), acc);
            f32_store_one(acc, r, col0 + j, bias, residual, ldr, y, ldy, y_f32);
        }
#endif
}

#endif
