/* The float32 bodies of the 4-bit and 8-bit kernels (linear_q4_cpu.c,
 * whose header describes the formats and packed layouts) for CPUs without
 * AVX512-BF16: the portable build's 4-bit, int8 and FP8 weights, the AVX2
 * build's FP8 ones (its 4-bit and int8 weights run integer dots,
 * quant_int.h). They rebuild the bfloat16 weights the loader would have made
 * (bf16(d * q + m), bf16(d * q): one float32 operation, d * q exact, one
 * rounding to nearest even; FP8: bf16(v * d), one rounding) and run
 * f32_panel.h's arithmetic on them in its order, so each gives linear_bf16's
 * bits (that build's) on the dequantized weights, for any row count. Up to
 * LINEAR_Q4_DIRECT_ROWS rows (kernels.h) the AVX2 body dequantizes each input
 * pair in registers; larger calls, and the portable body, dequantize a panel
 * at a time into a bfloat16 scratch. Included by linear_q4_cpu.c only
 * (QBLOCK, MR_Q4 are its). */
#ifndef TANDEM_QUANT_F32_H
#define TANDEM_QUANT_F32_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "f32_panel.h"
#include "kernels.h"

#if !defined(__AVX512BF16__) && !defined(F32_PANEL_AVX2)
/* A float16 (raw bits) as float32, exactly. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, man = h & 0x3ffu;
    float f;
    if (e == 31) {
        const uint32_t u = sign | 0x7f800000u | man << 13;
        memcpy(&f, &u, 4);
    } else if (e == 0) {
        f = (float)man * 0x1p-24f;
        if (sign) f = -f;
    } else {
        const uint32_t u = sign | (e + 112) << 23 | man << 13;
        memcpy(&f, &u, 4);
    }
    return f;
}

/* One 4-bit panel (its codes and scales) as bfloat16 panels [k / 2][64][2]:
 * bf16(d * q + m), d * q exact (see the top of this file), one rounding. */
static void dequant_q4_panel(const uint8_t *codes, const uint16_t *scales, int64_t group, int64_t k, uint16_t *out) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        float d[PANEL], mn[PANEL];
        const uint16_t *sb = scales + b * QBLOCK / group * 2 * PANEL;
        for (int c = 0; c < PANEL; c++) d[c] = f16_to_f32(sb[c]), mn[c] = f16_to_f32(sb[PANEL + c]);
        for (int64_t kp = b * QBLOCK / 2; kp < (b + 1) * QBLOCK / 2; kp++)
            for (int g = 0; g < 4; g++)
                for (int j = 0; j < 16; j++) { /* byte j: lane j of the group's halves (see linear_q4_pack) */
                    const uint8_t byte = codes[kp * PANEL + 16 * g + j];
                    const int lo = 16 * g + j / 2, hi = lo + 8;
                    uint16_t *dst = out + kp * PANEL * 2 + j % 2;
                    dst[2 * lo] = f32_to_bf16(fmaf(d[lo], (float)(byte & 15), mn[lo]));
                    dst[2 * hi] = f32_to_bf16(fmaf(d[hi], (float)(byte >> 4), mn[hi]));
                }
    }
}

/* An FP8 E4M3 byte's value, exactly (fp8x16_to_f32's way: its fields moved into a float16's, times 2^8). */
static inline float fp8_to_f32(uint8_t b) {
    return f16_to_f32((uint16_t)((b & 0x7f) << 7 | (b & 0x80) << 8)) * 256.0f;
}

/* One 8-bit panel (pack_w8's layout) as bfloat16 panels: bf16(d * q) (int8: exact products) or bf16(v * d) (FP8). */
static void dequant_w8_panel(const int W8, const uint8_t *codes, const float *scales, int64_t group, int64_t k,
                             uint16_t *out) {
    for (int64_t kp = 0; kp < k / 2; kp++) {
        const float *d = scales + kp / (group / 2) * PANEL;
        for (int c = 0; c < PANEL; c++) {
            const uint8_t *src = codes + (kp * 4 + c / 16) * 32 + c % 16;
            for (int odd = 0; odd < 2; odd++) {
                const float v = W8 == W8_FP8 ? fp8_to_f32(src[16 * odd]) : (float)(int8_t)src[16 * odd];
                out[(kp * PANEL + c) * 2 + odd] = f32_to_bf16(d[c] * v);
            }
        }
    }
}
#endif

#if defined(F32_PANEL_AVX2)
/* Finite float32 lanes rounded to bfloat16's precision (nearest even, as
 * f32_to_bf16), kept as float32: the values the bfloat16 kernel would read. */
static inline __m256 round_bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 FP8 E4M3 bytes (the low half of `bytes`) as float32, exactly (fp8x16_to_f32's way). */
static inline __m256 fp8x8_to_f32(__m128i bytes) {
    const __m128i b = _mm_cvtepu8_epi16(bytes);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

/* Input pair kp's FP8 weights of one group of 16 columns (16 bytes of input 2 kp, then 16 of 2 kp + 1;
 * d: the 16 columns' float32 scales), as float32 rounded as dequant_w8_panel rounds them: w[0], w[1]
 * columns 0-7 and 8-15 at input 2 kp, w[2], w[3] at 2 kp + 1. */
static inline __attribute__((always_inline)) void dequant_fp8_16x2_f32(const uint8_t *codes, const float *d,
                                                                       __m256 w[4]) {
    for (int i = 0; i < 4; i++) {
        const __m256 q = fp8x8_to_f32(_mm_loadl_epi64((const __m128i *)(codes + 8 * i)));
        w[i] = round_bf16x8(_mm256_mul_ps(_mm256_loadu_ps(d + 8 * (i % 2)), q));
    }
}

/* MR (<= 3, a literal at each call) rows (xf: float32, k apart) x one group
 * of 16 columns (g of the FP8 panel at codes / scales, first column col0 of
 * the panel), each input pair dequantized in registers: f32_tile's
 * operations on the same weight values, in the same order, so linear_bf16's
 * bits. */
static inline __attribute__((always_inline)) void fp8_group_rows(
    const int MR, const float *xf, const uint8_t *codes, const float *scales, int64_t group, int g, int64_t k,
    int64_t col0, int64_t n, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
    int y_f32) {
    __m256 acc[MR_Q4][8];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < k / 2; kp++) {
        __m256 w[4];
        dequant_fp8_16x2_f32(codes + kp * 128 + 32 * g, scales + kp / (group / 2) * PANEL + 16 * g, w);
        for (int odd = 0; odd < 2; odd++)
            for (int r = 0; r < MR; r++) {
                const __m256 xb = _mm256_broadcast_ss(xf + r * k + 2 * kp + odd);
                acc[r][0] = _mm256_fmadd_ps(xb, w[2 * odd], acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xb, w[2 * odd + 1], acc[r][1]);
            }
    }
    f32_store_rows(MR, 2, acc, col0 + 16 * g, n, bias, residual, ldr, y, ldy, y_f32);
}

/* m <= LINEAR_Q4_DIRECT_ROWS rows over an FP8 weight, each work item half a
 * panel (two threads split a 576-column layer evenly). Returns 0, or 2 when
 * out of memory. */
static int fp8_direct_avx2(const uint16_t *x, int64_t ldx, const uint8_t *codes, const float *scales, int64_t group,
                           const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m,
                           int64_t n, int64_t k, int y_f32, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, panel_codes = k * PANEL, panel_scales = k / group * PANEL;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)") {
        float *xf = f32_scratch((size_t)(m * k));
        if (xf)
            f32_widen_rows(x, ldx, m, k, xf);
        else {
            _Pragma("omp atomic write") failed = 2;
        }
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * 2; item++) {
            const int64_t p = item / 2;
            if (!xf) continue;
            for (int g = 2 * (int)(item % 2); g < 2 * (int)(item % 2) + 2; g++) {
                if (p * PANEL + 16 * g >= n) break;
#define ROWS(MR) fp8_group_rows(MR, xf, codes + p * panel_codes, scales + p * panel_scales, group, g, k, p * PANEL, \
                                n, bias, residual, ldr, y, ldy, y_f32)
                if (m == 3) ROWS(3);
                else if (m == 2) ROWS(2);
                else ROWS(1);
#undef ROWS
            }
        }
    }
    return failed;
}

/* dequant_w8_panel for FP8 with dequant_fp8_16x2_f32: the same values. */
static void dequant_fp8_panel_avx2(const uint8_t *codes, const float *scales, int64_t group, int64_t k,
                                   uint16_t *out) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kp = 0; kp < k / 2; kp++)
        for (int g = 0; g < 4; g++) {
            __m256 w[4];
            dequant_fp8_16x2_f32(codes + kp * 128 + 32 * g, scales + kp / (group / 2) * PANEL + 16 * g, w);
            for (int h = 0; h < 2; h++) { /* lane c: column c's bfloat16 pair (input 2 kp low, 2 kp + 1 high) */
                const __m256i pair = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(w[h]), 16),
                                                     _mm256_and_si256(_mm256_castps_si256(w[2 + h]), high));
                _mm256_storeu_si256((__m256i *)(out + (kp * PANEL + 16 * g + 8 * h) * 2), pair);
            }
        }
}
#endif

#if !defined(__AVX512BF16__)
/* The float32 bodies of linear_q4 (W8 0) and linear_q8 (W8_INT) on the portable build, and of linear_fp8
 * (W8_FP8) on it and the AVX2 build: per work item (panel, block of rows), the panel dequantized into this
 * thread's bfloat16 scratch, then f32_panel.h's kernel over it; on AVX2, up to LINEAR_Q4_DIRECT_ROWS rows
 * in registers. Returns 0, or 2 when out of memory. */
static int quant_f32(const int W8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                     int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int y_f32, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, m_blocks = (m + M_BLOCK - 1) / M_BLOCK;
    const int64_t panel_codes = W8 ? k * PANEL : k * PANEL / 2, panel_scales = k / group * (W8 ? 1 : 2) * PANEL;
#if defined(F32_PANEL_AVX2) /* FP8 only: the 4-bit and int8 weights run integer dots (quant_int.h) */
    if (m <= LINEAR_Q4_DIRECT_ROWS) /* in registers */
        return fp8_direct_avx2(x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                               num_threads);
#endif
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)") {
        /* one buffer: the bfloat16 panel (k * 64 values, an even count of floats' room) then the rows' floats */
        float *buf = f32_scratch((size_t)(k * PANEL / 2 + M_BLOCK * k));
        int64_t have = -1; /* the panel in this thread's scratch */
        if (!buf) {
            _Pragma("omp atomic write") failed = 2;
        }
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * m_blocks; item++) {
            if (!buf) continue;
            const int64_t p = item / m_blocks, m0 = item % m_blocks * M_BLOCK;
            const int64_t m1 = m0 + M_BLOCK < m ? m0 + M_BLOCK : m;
            uint16_t *panel = (uint16_t *)buf;
            if (p != have) { /* consecutive items of a thread share their panel (panel-major order) */
                have = p;
                const void *pc = (const char *)codes + p * panel_codes;
                const void *ps = W8 ? (const void *)((const float *)scales + p * panel_scales)
                                    : (const void *)((const uint16_t *)scales + p * panel_scales);
#if defined(F32_PANEL_AVX2)
                dequant_fp8_panel_avx2(pc, ps, group, k, panel);
#else
                if (W8)
                    dequant_w8_panel(W8, pc, ps, group, k, panel);
                else
                    dequant_q4_panel(pc, ps, group, k, panel);
#endif
            }
            f32_panel_row_block(x, ldx, panel, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32, m0, m1,
                                buf + k * PANEL / 2);
        }
    }
    return failed;
}
#endif

#endif
