/* 4-bit GGUF linear layers (Q4_0, Q4_1), read in 4 bits and computed exactly
 * as the bfloat16 weights dequantized from the same file: y = x @ W.T
 * (+ bias) (+ residual), x bfloat16. The AVX512-BF16 body is described
 * here; the others (AVX2/FMA, portable C) rebuild the same bfloat16 values
 * a panel at a time into a scratch panel and run f32_panel.h's kernel on it,
 * so they too give linear_bf16's bits (their own ISA's) on the dequantized
 * weights.
 *
 * Built with the other kernels by kernels/cpu_build.py, called from
 * kernels/cpu_linear.py. llama.cpp's blocks (ggml's block_q4_0 / block_q4_1;
 * GGUF spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) hold
 * 32 consecutive inputs of one output row as codes q in 0..15 with a float16
 * scale d (and, Q4_1, a min m). The loader's bfloat16 weight is the gguf
 * package's float32 dequantization rounded to nearest even:
 * bf16(d * (q - 8)) for Q4_0, bf16((d * q) + m) for Q4_1, each operation
 * rounded in float32. As d is a float16 (11 significant bits) and q < 16,
 * d * q is exact in float32, so one FMA, d * q + m (Q4_0: m = -8 d, also
 * exact), rounds exactly as those operations do. This kernel rebuilds these
 * bfloat16 values (VFMADD, then VCVTNE2PS2BF16) in the bfloat16 kernel's
 * panel layout, and runs the
 * bfloat16 micro-kernel (bf16_panel.h) on them. So its outputs are bitwise
 * those of linear_bf16 on the dequantized weights, for any number of rows,
 * while reading 5 bits per weight (codes, and the float16 d and m per 32
 * as GGUF stores them) instead of 16. A step of one or two rows is then
 * bound by rebuilding the weights (the arithmetic below, ~8 vector
 * operations per 32 weights), no longer by reading them.
 *
 * Packed layout, per panel of 64 output columns and block of 32 inputs:
 * codes [16 input pairs][4 groups of 16 columns][16 bytes], byte j of a group
 * holding column 16 g + j / 2 (low nibble) and 16 g + 8 + j / 2 (high) at
 * input 2 kp + j % 2, so that the two nibbles' float32 lanes convert into
 * VDPBF16PS's pair order directly;
 * scales float16 [2][64] (kernels/cpu_linear.py:pack_q4 lays them out): d,
 * then m (-8 d for Q4_0). Calls of up to
 * LINEAR_Q4_DIRECT_ROWS rows (kernels.h) dequantize each input pair in
 * registers; larger ones dequantize a panel once per work item into a
 * bfloat16 scratch (L2) and run rows six at a time over it.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_panel.h"
#include "f32_panel.h"
#include "kernels.h"

#define QBLOCK 32
#define MR_Q4 3  /* rows per register tile on the in-register path */

/* Pack codes [n, k] (uint8, 0..15) into codes_out
 * [ceil(n / 64)][k / 32][16][4][16]; k a multiple of 32. Padded columns get
 * code 0. */
void linear_q4_pack(const uint8_t *codes, int64_t n, int64_t k, uint8_t *codes_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *cb = codes_out + (p * blocks + b) * (PANEL * QBLOCK / 2);
            for (int64_t kp = 0; kp < QBLOCK / 2; kp++)
                for (int64_t c = 0; c < PANEL; c++) { /* byte c: lane c % 16 of the group's two halves */
                    const int64_t g = c / 16, j = c % 16, i = b * QBLOCK + 2 * kp + j % 2;
                    const int64_t lo_row = p * PANEL + 16 * g + j / 2, hi_row = lo_row + 8;
                    const uint8_t lo = lo_row < n ? codes[lo_row * k + i] : 0, hi = hi_row < n ? codes[hi_row * k + i] : 0;
                    cb[kp * PANEL + c] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                }
        }
}

#if defined(__AVX512BF16__)
/* A group's block scales (16 columns' d or m) duplicated for the two halves
 * of a dequantized operand: lanes 2 j, 2 j + 1 = column j (half 0: columns
 * 0-7, half 1: 8-15). */
static inline __attribute__((always_inline)) __m512 dup_half(const uint16_t *v, int half) {
    const __m512i idx = half ? _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8)
                             : _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)v)));
}

/* Input pair kp's bfloat16 weights of the 16 columns of a group (codes: the
 * group's 16 bytes, byte j holding lane j of half 0 (low nibble) and of half
 * 1 (high nibble), lane j = column j / 2 at input 2 kp + j % 2; d0, m0, d1,
 * m1: the halves' duplicated scales, dup_half), as one VDPBF16PS operand:
 * lane 2 c = column c at input 2 kp, lane 2 c + 1 at 2 kp + 1. */
static inline __attribute__((always_inline)) __m512bh dequant16x2(const uint8_t *codes, __m512 d0, __m512 m0,
                                                                  __m512 d1, __m512 m1) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
    /* d * q is exact (see the top of this file): one rounding, as gguf's (d * q) + m; the two halves
     * convert into lanes 0-15 and 16-31, already paired */
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(d1, q1, m1), _mm512_fmadd_ps(d0, q0, m0));
}

/* This thread's scratch of at least `elems` bfloat16 values, kept between
 * calls (OpenMP's threads persist; a fresh buffer of a few hundred KiB per
 * call would be mapped and faulted in each time); NULL when out of memory. */
static uint16_t *thread_scratch(size_t elems) {
    static __thread uint16_t *buf;
    static __thread size_t cap;
    if (cap < elems) {
        free(buf);
        buf = malloc(sizeof(uint16_t) * elems);
        cap = buf ? elems : 0;
    }
    return buf;
}

/* One panel (its codes and scales) dequantized into scratch [k / 2][64][2]. */
static void dequant_panel(const uint8_t *codes, const uint16_t *scales, int64_t k, uint16_t *scratch) {
    for (int64_t b = 0; b < k / QBLOCK; b++)
        for (int g = 0; g < 4; g++) {
            const uint16_t *sb = scales + b * 2 * PANEL + 16 * g;
            const __m512 d0 = dup_half(sb, 0), m0 = dup_half(sb + PANEL, 0);
            const __m512 d1 = dup_half(sb, 1), m1 = dup_half(sb + PANEL, 1);
            for (int64_t kp = b * QBLOCK / 2; kp < (b + 1) * QBLOCK / 2; kp++)
                _mm512_storeu_si512(scratch + (kp * PANEL + 16 * g) * 2,
                                    (__m512i)dequant16x2(codes + (kp * 4 + g) * 16, d0, m0, d1, m1));
        }
}

/* Q8_0's 16 x 2 operand (see linear_q8 below): bf16(d * q), the products exact. */
static inline __attribute__((always_inline)) __m512bh dequant_q8_16x2(const int8_t *codes, const float *d) {
    const __m512 dv = _mm512_loadu_ps(d);
    const __m512 qe = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    const __m512 qo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16))));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(dv, qo), _mm512_mul_ps(dv, qe));
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (__m512bh)_mm512_permutexvar_epi16(idx, both);
}

/* MR (<= 3, a literal at each call) rows x the 32 columns of half h of one
 * panel, each input pair dequantized in registers (Q8: 8-bit panels, else
 * 4-bit); the same arithmetic as panel_rows. (Half panels: twice the work
 * items, so that two threads split a 576-column layer evenly.) */
static inline __attribute__((always_inline)) void half_panel_rows(
    const int Q8, const int MR, const uint16_t *x, int64_t ldx, const void *codes, const void *scales, int64_t h,
    int64_t k, int64_t col0, int64_t n, const float *bias, const uint16_t *residual, int64_t ldr, void *y,
    int64_t ldy, int y_f32) {
    __m512 acc[MR_Q4][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 2; j++) acc[r][j] = _mm512_setzero_ps();
    __m512 s[8]; /* 4-bit: the block's duplicated scales, d0 m0 d1 m1 of the half panel's two groups */
    for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < k / 2; kp++) {
        __m512bh w0, w1;
        if (Q8) {
            const float *sb = (const float *)scales + kp / (QBLOCK / 2) * PANEL + 32 * h;
            const int8_t *cp = (const int8_t *)codes + kp * 128 + 64 * h;
            w0 = dequant_q8_16x2(cp, sb);
            w1 = dequant_q8_16x2(cp + 32, sb + 16);
        } else {
            if (kp % (QBLOCK / 2) == 0) {
                const uint16_t *sb = (const uint16_t *)scales + kp / (QBLOCK / 2) * 2 * PANEL + 32 * h;
                for (int g = 0; g < 2; g++) {
                    s[4 * g] = dup_half(sb + 16 * g, 0), s[4 * g + 1] = dup_half(sb + PANEL + 16 * g, 0);
                    s[4 * g + 2] = dup_half(sb + 16 * g, 1), s[4 * g + 3] = dup_half(sb + PANEL + 16 * g, 1);
                }
            }
            const uint8_t *cp = (const uint8_t *)codes + kp * 64 + 32 * h;
            w0 = dequant16x2(cp, s[0], s[1], s[2], s[3]);
            w1 = dequant16x2(cp + 16, s[4], s[5], s[6], s[7]);
        }
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * kp, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    store_rows(MR, 2, acc, col0 + 32 * h, n, bias, residual, ldr, y, ldy, y_f32);
}

/* m <= LINEAR_Q4_DIRECT_ROWS rows over every half panel of a 4-bit or (Q8) 8-bit weight. */
static inline __attribute__((always_inline)) void direct_rows(
    const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
    int y_f32, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_codes = Q8 ? k * PANEL : k * PANEL / 2, panel_scales = k / QBLOCK * (Q8 ? 1 : 2) * PANEL;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t item = 0; item < panels * 2; item++) {
        const int64_t p = item / 2, h = item % 2;
        if (p * PANEL + 32 * h >= n) continue;
        const char *pc = (const char *)codes + p * panel_codes;
        const void *ps = Q8 ? (const void *)((const float *)scales + p * panel_scales)
                            : (const void *)((const uint16_t *)scales + p * panel_scales);
#define ROWS(MR) half_panel_rows(Q8, MR, x, ldx, pc, ps, h, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32)
        if (m == 3) ROWS(3);
        else if (m == 2) ROWS(2);
        else if (m == 1) ROWS(1);
#undef ROWS
    }
}
#endif

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
static void dequant_q4_panel(const uint8_t *codes, const uint16_t *scales, int64_t k, uint16_t *out) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        float d[PANEL], mn[PANEL];
        for (int c = 0; c < PANEL; c++) d[c] = f16_to_f32(scales[b * 2 * PANEL + c]),
                                        mn[c] = f16_to_f32(scales[b * 2 * PANEL + PANEL + c]);
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

/* One 8-bit panel (linear_q8_pack's layout) as bfloat16 panels: bf16(d * q), exact products. */
static void dequant_q8_panel(const int8_t *codes, const float *scales, int64_t k, uint16_t *out) {
    for (int64_t kp = 0; kp < k / 2; kp++) {
        const float *d = scales + kp / (QBLOCK / 2) * PANEL;
        for (int c = 0; c < PANEL; c++) {
            const int8_t *src = codes + (kp * 4 + c / 16) * 32 + c % 16;
            out[(kp * PANEL + c) * 2] = f32_to_bf16(d[c] * (float)src[0]);
            out[(kp * PANEL + c) * 2 + 1] = f32_to_bf16(d[c] * (float)src[16]);
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

/* Input pair kp's weights of one group of 16 columns, as float32 rounded as
 * dequant_q4_panel / dequant_q8_panel round them: w[0], w[1] columns 0-7 and
 * 8-15 at input 2 kp, w[2], w[3] at 2 kp + 1. 4-bit: codes, the group's 16
 * bytes (linear_q4_pack: the even bytes hold input 2 kp, low nibble columns
 * 0-7, high 8-15; the odd bytes input 2 kp + 1); d, mn: the 16 columns' float32
 * scale and min. 8-bit: 16 bytes of input 2 kp, then 16 of 2 kp + 1. */
static inline __attribute__((always_inline)) void dequant16x2_f32(const int Q8, const void *codes, const float *d,
                                                                  const float *mn, __m256 w[4]) {
    if (Q8) {
        for (int i = 0; i < 4; i++) {
            const __m128i c = _mm_loadl_epi64((const __m128i *)((const int8_t *)codes + 8 * i));
            w[i] = round_bf16x8(_mm256_mul_ps(_mm256_loadu_ps(d + 8 * (i % 2)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c))));
        }
        return;
    }
    const __m128i bytes = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)codes),
                                           _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    for (int odd = 0; odd < 2; odd++) {
        const __m256i c = _mm256_cvtepu8_epi32(odd ? _mm_srli_si128(bytes, 8) : bytes);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
        w[2 * odd] = round_bf16x8(_mm256_fmadd_ps(_mm256_loadu_ps(d), lo, _mm256_loadu_ps(mn)));
        w[2 * odd + 1] = round_bf16x8(_mm256_fmadd_ps(_mm256_loadu_ps(d + 8), hi, _mm256_loadu_ps(mn + 8)));
    }
}

/* MR (<= 3, a literal at each call) rows (xf: float32, k apart) x one group
 * of 16 columns (g of the panel at codes / scales, first column col0 of the
 * panel), each input pair dequantized in registers: f32_tile's operations on
 * the same weight values, in the same order, so linear_bf16's bits. */
static inline __attribute__((always_inline)) void quant_group_rows(
    const int Q8, const int MR, const float *xf, const void *codes, const void *scales, int g, int64_t k,
    int64_t col0, int64_t n, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
    int y_f32) {
    __m256 acc[MR_Q4][8];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    float d[16] = {0}, mn[16] = {0}; /* (set at kp 0; zeroed for the compiler) */
    for (int64_t kp = 0; kp < k / 2; kp++) {
        const float *dp = d;
        const void *cp;
        if (Q8) {
            dp = (const float *)scales + kp / (QBLOCK / 2) * PANEL + 16 * g;
            cp = (const int8_t *)codes + kp * 128 + 32 * g;
        } else {
            if (kp % (QBLOCK / 2) == 0) { /* a new block: its 16 scales and mins as float32 */
                const uint16_t *sb = (const uint16_t *)scales + kp / (QBLOCK / 2) * 2 * PANEL + 16 * g;
                for (int i = 0; i < 2; i++) {
                    _mm256_storeu_ps(d + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 8 * i))));
                    _mm256_storeu_ps(mn + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + PANEL + 8 * i))));
                }
            }
            cp = (const uint8_t *)codes + kp * PANEL + 16 * g;
        }
        __m256 w[4];
        dequant16x2_f32(Q8, cp, dp, mn, w);
        for (int odd = 0; odd < 2; odd++)
            for (int r = 0; r < MR; r++) {
                const __m256 xb = _mm256_broadcast_ss(xf + r * k + 2 * kp + odd);
                acc[r][0] = _mm256_fmadd_ps(xb, w[2 * odd], acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xb, w[2 * odd + 1], acc[r][1]);
            }
    }
    f32_store_rows(MR, 2, acc, col0 + 16 * g, n, bias, residual, ldr, y, ldy, y_f32);
}

/* m <= LINEAR_Q4_DIRECT_ROWS rows over a 4-bit or (Q8) 8-bit weight, each
 * work item half a panel (two threads split a 576-column layer evenly).
 * Returns 0, or 2 when out of memory. */
static int quant_direct_avx2(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                             const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
                             int64_t m, int64_t n, int64_t k, int y_f32, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_codes = Q8 ? k * PANEL : k * PANEL / 2, panel_scales = k / QBLOCK * (Q8 ? 1 : 2) * PANEL;
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
            const char *pc = (const char *)codes + p * panel_codes;
            const void *ps = Q8 ? (const void *)((const float *)scales + p * panel_scales)
                                : (const void *)((const uint16_t *)scales + p * panel_scales);
            for (int g = 2 * (int)(item % 2); g < 2 * (int)(item % 2) + 2; g++) {
                if (p * PANEL + 16 * g >= n) break;
#define ROWS(MR) quant_group_rows(Q8, MR, xf, pc, ps, g, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32)
                if (m == 3) ROWS(3);
                else if (m == 2) ROWS(2);
                else ROWS(1);
#undef ROWS
            }
        }
    }
    return failed;
}

/* dequant_q4_panel / dequant_q8_panel (Q8) with dequant16x2_f32: the same values. */
static void dequant_panel_avx2(const int Q8, const void *codes, const void *scales, int64_t k, uint16_t *out) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kp = 0; kp < k / 2; kp++)
        for (int g = 0; g < 4; g++) {
            float d[16], mn[16];
            const float *dp = d;
            if (Q8)
                dp = (const float *)scales + kp / (QBLOCK / 2) * PANEL + 16 * g;
            else {
                const uint16_t *sb = (const uint16_t *)scales + kp / (QBLOCK / 2) * 2 * PANEL + 16 * g;
                for (int i = 0; i < 2; i++) {
                    _mm256_storeu_ps(d + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 8 * i))));
                    _mm256_storeu_ps(mn + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + PANEL + 8 * i))));
                }
            }
            __m256 w[4];
            dequant16x2_f32(Q8, Q8 ? (const void *)((const int8_t *)codes + kp * 128 + 32 * g)
                                   : (const void *)((const uint8_t *)codes + kp * PANEL + 16 * g), dp, mn, w);
            for (int h = 0; h < 2; h++) { /* lane c: column c's bfloat16 pair (input 2 kp low, 2 kp + 1 high) */
                const __m256i pair = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(w[h]), 16),
                                                     _mm256_and_si256(_mm256_castps_si256(w[2 + h]), high));
                _mm256_storeu_si256((__m256i *)(out + (kp * PANEL + 16 * g + 8 * h) * 2), pair);
            }
        }
}
#endif

#if !defined(__AVX512BF16__)
/* The float32 bodies of linear_q4 (Q8 0) and linear_q8 (Q8 1): per work item
 * (panel, block of rows), the panel dequantized into this thread's bfloat16
 * scratch, then f32_panel.h's kernel over it. Returns 0, or 2 when out of memory. */
static int quant_f32(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                     const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int y_f32, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, m_blocks = (m + M_BLOCK - 1) / M_BLOCK;
    const int64_t panel_codes = Q8 ? k * PANEL : k * PANEL / 2, panel_scales = k / QBLOCK * (Q8 ? 1 : 2) * PANEL;
#if defined(F32_PANEL_AVX2)
    if (m <= LINEAR_Q4_DIRECT_ROWS) /* in registers */
        return quant_direct_avx2(Q8, x, ldx, codes, scales, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
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
                const void *ps = Q8 ? (const void *)((const float *)scales + p * panel_scales)
                                    : (const void *)((const uint16_t *)scales + p * panel_scales);
#if defined(F32_PANEL_AVX2)
                dequant_panel_avx2(Q8, pc, ps, k, panel);
#else
                if (Q8)
                    dequant_q8_panel(pc, ps, k, panel);
                else
                    dequant_q4_panel(pc, ps, k, panel);
#endif
            }
            f32_panel_row_block(x, ldx, panel, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32, m0, m1,
                                buf + k * PANEL / 2);
        }
    }
    return failed;
}
#endif

/* y [m, n] = x [m, k] @ W.T (+ bias [n], float32) (+ residual [m, n]) for W
 * packed by linear_q4_pack; strides and y_f32 as linear_bf16. Returns 0, or 2 when out of memory. */
int linear_q4(const uint16_t *x, int64_t ldx, const uint8_t *codes, const uint16_t *scales, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
              int64_t k, int y_f32, int num_threads) {
#if defined(__AVX512BF16__)
    const int64_t panels = (n + PANEL - 1) / PANEL, m_blocks = (m + M_BLOCK - 1) / M_BLOCK;
    const int64_t panel_codes = k * PANEL / 2, panel_scales = k / QBLOCK * 2 * PANEL;
    if (m <= LINEAR_Q4_DIRECT_ROWS) { /* in registers, half a panel per work item */
        direct_rows(0, x, ldx, codes, scales, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
        return 0;
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)") {
        uint16_t *scratch = thread_scratch((size_t)(k * PANEL));
        if (!scratch) {
            _Pragma("omp atomic write") failed = 2;
        }
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * m_blocks; item++) {
            if (!scratch) continue;
            const int64_t p = item / m_blocks, m0 = item % m_blocks * M_BLOCK;
            const int64_t m1 = m0 + M_BLOCK < m ? m0 + M_BLOCK : m;
            dequant_panel(codes + p * panel_codes, scales + p * panel_scales, k, scratch);
            panel_row_block(x, ldx, scratch, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32, m0, m1);
        }
    }
    return failed;
#else
    return quant_f32(0, x, ldx, codes, scales, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
#endif
}

/* Q8_0 (ggml's block_q8_0: 32 int8 codes q and a float16 scale d, w = d q,
 * exact in float32) for the output head of calls of up to
 * LINEAR_Q4_DIRECT_ROWS rows, read in 9 bits per weight (int8 codes and a float32 d per 32) instead of 16:
 * the bfloat16 weights bf16(d * q) rebuilt in registers, the same bits as
 * linear_bf16 on them. Packed per panel of 64 columns and block of 32
 * inputs: codes [16 input pairs][4 groups][16 even-input bytes, 16
 * odd-input bytes], scales float32 [64]. */
void linear_q8_pack(const int8_t *codes, const float *d, int64_t n, int64_t k, int8_t *codes_out, float *scales_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            int8_t *cb = codes_out + (p * blocks + b) * PANEL * QBLOCK;
            float *sb = scales_out + (p * blocks + b) * PANEL;
            for (int64_t c = 0; c < PANEL; c++) sb[c] = p * PANEL + c < n ? d[(p * PANEL + c) * blocks + b] : 0.0f;
            for (int64_t kp = 0; kp < QBLOCK / 2; kp++)
                for (int64_t c = 0; c < PANEL; c++) {
                    const int64_t row = p * PANEL + c, i = b * QBLOCK + 2 * kp;
                    int8_t *dst = cb + (kp * 4 + c / 16) * 32 + c % 16;
                    dst[0] = row < n ? codes[row * k + i] : 0;
                    dst[16] = row < n ? codes[row * k + i + 1] : 0;
                }
        }
}

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ residual) for W packed by
 * linear_q8_pack, m <= LINEAR_Q4_DIRECT_ROWS; arguments as linear_bf16.
 * Returns 0, 1 for more rows, 2 when out of memory. */
int linear_q8(const uint16_t *x, int64_t ldx, const int8_t *codes, const float *scales, const float *bias,
              const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int y_f32,
              int num_threads) {
    if (m > LINEAR_Q4_DIRECT_ROWS) return 1;
#if defined(__AVX512BF16__)
    direct_rows(1, x, ldx, codes, scales, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
    return 0;
#else
    return quant_f32(1, x, ldx, codes, scales, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
#endif
}
