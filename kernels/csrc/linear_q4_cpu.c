/* 4-bit GGUF linear layers (Q4_0, Q4_1), read in 4 bits and computed exactly
 * as the bfloat16 weights dequantized from the same file: y = x @ W.T
 * (+ bias) (+ residual), x bfloat16. The AVX512-BF16 body is described
 * here; the others (AVX2/FMA, portable C: quant_f32.h) rebuild the same
 * bfloat16 values and run f32_panel.h's arithmetic on them, so they too give
 * linear_bf16's bits (their own build's) on the dequantized weights.
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
 * scales float16 [2][64] per group of `group` inputs (kernels/cpu_linear.py:
 * pack_q4 lays them out): d, then m (-8 d for Q4_0). GGUF's group is its block
 * of 32; GPTQ/AWQ/compressed-tensors checkpoints keep their own (64, 128, a
 * whole row...), so their scales cost what they cost in the checkpoint. Calls of up to
 * LINEAR_Q4_DIRECT_ROWS rows (kernels.h) dequantize each input pair in
 * registers; larger ones dequantize a panel once per work item into a
 * bfloat16 scratch (L2) and run rows six at a time over it.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_panel.h"
#include "kernels.h"

#define QBLOCK 32
#define MR_Q4 3  /* rows per register tile on the in-register path */
/* The kinds of 8-bit weights (the W8 argument of the bodies; 0: 4-bit) */
#define W8_INT 1 /* int8 codes q, w = d q (GGUF Q8_0) */
#define W8_FP8 2 /* FP8 E4M3 codes of value v, w = v d (compressed-tensors float-quantized) */

/* Pack codes [n, k] (uint8, 0..15) into codes_out
 * [ceil(n / 64)][k / 32][16][4][16]; k a multiple of 32. Padded columns get
 * code 0. */
void linear_q4_pack(const uint8_t *codes, int64_t n, int64_t k, uint8_t *codes_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK;
#if defined(QUANT_COPY_EVERY_ROW)
    /* quant_int.h's layout: [panel][group of 8 columns][block][4 vectors][8 columns][4 inputs] */
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < PANEL / 8; g++)
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t *dst = codes_out + ((p * (PANEL / 8) + g) * blocks + b) * (QBLOCK / 2 * 8);
                for (int64_t v = 0; v < 4; v++)
                    for (int64_t c = 0; c < 8; c++)
                        for (int64_t i = 0; i < 4; i++) {
                            const int64_t row = p * PANEL + 8 * g + c, in = b * QBLOCK + 8 * v + i;
                            const uint8_t lo = row < n ? codes[row * k + in] : 0, hi = row < n ? codes[row * k + in + 4] : 0;
                            dst[32 * v + 4 * c + i] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                        }
            }
    return;
#endif
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

/* This thread's scratch of at least `elems` bfloat16 values (scratch_grow). */
static uint16_t *thread_scratch(size_t elems) {
    static __thread void *buf;
    static __thread size_t cap;
    return scratch_grow(&buf, &cap, sizeof(uint16_t) * elems);
}

/* One panel (its codes and scales, one (d, m) per `group` inputs) dequantized into scratch [k / 2][64][2]. */
static void dequant_panel(const uint8_t *codes, const uint16_t *scales, int64_t group, int64_t k, uint16_t *scratch) {
    for (int64_t b = 0; b < k / QBLOCK; b++)
        for (int g = 0; g < 4; g++) {
            const uint16_t *sb = scales + b * QBLOCK / group * 2 * PANEL + 16 * g;
            const __m512 d0 = dup_half(sb, 0), m0 = dup_half(sb + PANEL, 0);
            const __m512 d1 = dup_half(sb, 1), m1 = dup_half(sb + PANEL, 1);
            for (int64_t kp = b * QBLOCK / 2; kp < (b + 1) * QBLOCK / 2; kp++)
                _mm512_storeu_si512(scratch + (kp * PANEL + 16 * g) * 2,
                                    (__m512i)dequant16x2(codes + (kp * 4 + g) * 16, d0, m0, d1, m1));
        }
}

/* 16 FP8 E4M3 bytes as float32, exactly: each byte's sign, exponent and
 * mantissa moved into a float16's fields (whose exponent bias, 15, exceeds
 * E4M3's, 7, by 8; the subnormals' spacing follows), the value then scaled by
 * 2^8. (E4M3's NaN bytes, which checkpoints do not hold, become 480.) */
static inline __attribute__((always_inline)) __m512 fp8x16_to_f32(__m128i bytes) {
    const __m256i b = _mm256_cvtepu8_epi16(bytes);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

/* An 8-bit weight's 16 x 2 operand (16 columns' codes at input 2 kp, then at
 * 2 kp + 1; d: their scales): bf16(d * q) for int8 codes (Q8_0: the products
 * exact) or bf16(v * d) for FP8 codes of value v (one float32 rounding, as
 * the reference dequantization's v * scale). */
static inline __attribute__((always_inline)) __m512bh dequant_w8_16x2(const int W8, const uint8_t *codes,
                                                                      const float *d) {
    const __m128i even = _mm_loadu_si128((const __m128i *)codes), odd = _mm_loadu_si128((const __m128i *)(codes + 16));
    const __m512 dv = _mm512_loadu_ps(d);
    const __m512 qe = W8 == W8_FP8 ? fp8x16_to_f32(even) : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(even));
    const __m512 qo = W8 == W8_FP8 ? fp8x16_to_f32(odd) : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(odd));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(dv, qo), _mm512_mul_ps(dv, qe));
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (__m512bh)_mm512_permutexvar_epi16(idx, both);
}

/* One 8-bit panel (its codes and scales, one d per `group` inputs) dequantized into scratch [k / 2][64][2]. */
static void dequant_panel_w8(const int W8, const uint8_t *codes, const float *scales, int64_t group, int64_t k,
                             uint16_t *scratch) {
    for (int64_t kp = 0; kp < k / 2; kp++)
        for (int g = 0; g < 4; g++)
            _mm512_storeu_si512(scratch + (kp * PANEL + 16 * g) * 2,
                                (__m512i)dequant_w8_16x2(W8, codes + kp * 128 + 32 * g,
                                                         scales + kp / (group / 2) * PANEL + 16 * g));
}

/* MR (<= 3, a literal at each call) rows x the 32 columns of half h of one
 * panel, each input pair dequantized in registers (W8: 8-bit panels of that
 * kind, else 4-bit); the same arithmetic as panel_rows. (Half panels: twice the work
 * items, so that two threads split a 576-column layer evenly.) */
static inline __attribute__((always_inline)) void half_panel_rows(
    const int W8, const int MR, const uint16_t *x, int64_t ldx, const void *codes, const void *scales, int64_t group,
    int64_t h, int64_t k, int64_t col0, int64_t n, const float *bias, const uint16_t *residual, int64_t ldr, void *y,
    int64_t ldy, int y_f32) {
    __m512 acc[MR_Q4][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 2; j++) acc[r][j] = _mm512_setzero_ps();
    __m512 s[8]; /* 4-bit: the group's duplicated scales, d0 m0 d1 m1 of the half panel's two groups of columns */
    for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_ps();
    int64_t gi = -1, left = 0; /* the group of input pair kp, and its pairs after kp (no division per pair) */
    for (int64_t kp = 0; kp < k / 2; kp++, left--) {
        if (left == 0) { /* a new group */
            gi++, left = group / 2;
            for (int g = 0; g < 2 && !W8; g++) {
                const uint16_t *sb = (const uint16_t *)scales + gi * 2 * PANEL + 32 * h + 16 * g;
                s[4 * g] = dup_half(sb, 0), s[4 * g + 1] = dup_half(sb + PANEL, 0);
                s[4 * g + 2] = dup_half(sb, 1), s[4 * g + 3] = dup_half(sb + PANEL, 1);
            }
        }
        __m512bh w0, w1;
        if (W8) {
            const float *sb = (const float *)scales + gi * PANEL + 32 * h;
            const uint8_t *cp = (const uint8_t *)codes + kp * 128 + 64 * h;
            w0 = dequant_w8_16x2(W8, cp, sb);
            w1 = dequant_w8_16x2(W8, cp + 32, sb + 16);
        } else {
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

/* m <= LINEAR_Q4_DIRECT_ROWS rows over every half panel of a 4-bit or (W8) 8-bit weight, the half panels
 * shared by the threads of the enclosing parallel region (an orphaned omp for: every thread of the team calls
 * this, and returns after the loop's barrier; outside a region the caller runs them all). */
static inline __attribute__((always_inline)) void direct_items(
    const int W8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales, int64_t group,
    const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
    int y_f32) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_codes = W8 ? k * PANEL : k * PANEL / 2, panel_scales = k / group * (W8 ? 1 : 2) * PANEL;
    _Pragma("omp for schedule(static)")
    for (int64_t item = 0; item < panels * 2; item++) {
        const int64_t p = item / 2, h = item % 2;
        if (p * PANEL + 32 * h >= n) continue;
        const char *pc = (const char *)codes + p * panel_codes;
        const void *ps = W8 ? (const void *)((const float *)scales + p * panel_scales)
                            : (const void *)((const uint16_t *)scales + p * panel_scales);
#define ROWS(MR) half_panel_rows(W8, MR, x, ldx, pc, ps, group, h, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32)
        if (m == 3) ROWS(3);
        else if (m == 2) ROWS(2);
        else if (m == 1) ROWS(1);
#undef ROWS
    }
}

/* direct_items over a team of num_threads threads of its own. */
static inline __attribute__((always_inline)) void direct_rows(
    const int W8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales, int64_t group,
    const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
    int y_f32, int num_threads) {
    _Pragma("omp parallel num_threads(num_threads)")
    direct_items(W8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32);
}
#endif

#include "quant_f32.h"
#include "quant_int.h"

/* x's columns in the order perm [k] gives (xp [m][k], row r's input j = x
 * [r][perm[j]]), or x itself when perm is NULL; *owned is set to the copy to
 * free. NULL when out of memory. */
static const uint16_t *permuted_rows(const uint16_t *x, int64_t *ldx, const int32_t *perm, int64_t m, int64_t k,
                                     uint16_t **owned, int num_threads) {
    *owned = 0;
    if (!perm) return x;
    uint16_t *xp = malloc(sizeof(uint16_t) * (size_t)(m * k));
    if (!xp) return 0;
    const int64_t ld = *ldx;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k; j++) xp[r * k + j] = x[r * ld + perm[j]];
    *ldx = k;
    *owned = xp;
    return xp;
}

#if defined(__AVX512BF16__)
/* y = x @ W.T (+ bias) (+ residual) for a 4-bit or (W8) 8-bit weight: up to
 * LINEAR_Q4_DIRECT_ROWS rows in registers (direct_rows), more by work items of
 * (panel, block of M_BLOCK rows), each panel dequantized into this thread's
 * bfloat16 scratch and run by bf16_panel.h's kernel: the same bits either
 * way. Returns 0, or 2 when out of memory. */
static int quant_avx512(const int W8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                        int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
                        int64_t m, int64_t n, int64_t k, int y_f32, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, m_blocks = (m + M_BLOCK - 1) / M_BLOCK;
    const int64_t panel_codes = W8 ? k * PANEL : k * PANEL / 2, panel_scales = k / group * (W8 ? 1 : 2) * PANEL;
    if (m <= LINEAR_Q4_DIRECT_ROWS) { /* in registers, half a panel per work item */
        direct_rows(W8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
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
            const uint8_t *pc = (const uint8_t *)codes + p * panel_codes;
            if (W8)
                dequant_panel_w8(W8, pc, (const float *)scales + p * panel_scales, group, k, scratch);
            else
                dequant_panel(pc, (const uint16_t *)scales + p * panel_scales, group, k, scratch);
            panel_row_block(x, ldx, scratch, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32, m0, m1);
        }
    }
    return failed;
}
#endif

/* y [m, n] = x [m, k] @ W.T (+ bias [n], float32) (+ residual [m, n]) for W
 * packed by linear_q4_pack, its scales (d, m) per `group` inputs (a multiple
 * of 32 dividing k) laid out float16 [panel][k / group][2][64]; with perm
 * (int32 [k], else NULL) the codes' input j is x's column perm[j] (GPTQ's
 * act-order: the inputs sorted by group so that each group is a run, x's
 * columns gathered to match, exactly: the same sums over another order).
 * Strides and y_f32 as linear_bf16. Returns 0, 1 for a group that does not
 * fit, or 2 when out of memory. */
int linear_q4(const uint16_t *x, int64_t ldx, const uint8_t *codes, const uint16_t *scales, int64_t group,
              const int32_t *perm, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
              int64_t m, int64_t n, int64_t k, int y_f32, int num_threads) {
    if (group <= 0 || group % QBLOCK || k % group) return 1;
    uint16_t *owned;
    x = permuted_rows(x, &ldx, perm, m, k, &owned, num_threads);
    if (!x) return 2;
#if defined(__AVX512BF16__)
    const int rc = quant_avx512(0, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                                num_threads);
#elif defined(QUANT_COPY_EVERY_ROW)
    const int rc = quant_int_avx2(0, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                                  num_threads);
#else
    const int rc = quant_f32(0, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                             num_threads);
#endif
    free(owned);
    return rc;
}

/* linear_q4 (bfloat16 out, no input order) for m <= LINEAR_Q4_DIRECT_ROWS rows, its work shared by the
 * threads of the enclosing OpenMP parallel region: every thread of the team calls it with the same
 * arguments, and each returns once all the outputs are written (decoder_cpu.c's one-region decode step). The
 * same work items, so the same bits, as linear_q4 (the AVX512-BF16 body's in registers, the AVX2 body's
 * integer dots). Returns 0; 1, having done nothing, where linear_q4 must be called instead (more rows, a
 * group that does not fit, the portable build): the same answer in every thread; 2 in a thread whose
 * scratch could not be allocated (AVX2; its items skipped). */
int linear_q4_team(const uint16_t *x, int64_t ldx, const uint8_t *codes, const uint16_t *scales, int64_t group,
                   const float *bias, const uint16_t *residual, int64_t ldr, uint16_t *y, int64_t ldy, int64_t m,
                   int64_t n, int64_t k) {
    if (m < 1 || m > LINEAR_Q4_DIRECT_ROWS || group <= 0 || group % QBLOCK || k % group) return 1;
#if defined(__AVX512BF16__)
    direct_items(0, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, 0);
    return 0;
#elif defined(QUANT_COPY_EVERY_ROW)
    return quant_int_items(0, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, 0);
#else
    (void)x, (void)ldx, (void)codes, (void)scales, (void)bias, (void)residual, (void)ldr, (void)y, (void)ldy, (void)n;
    return 1;
#endif
}

/* Codes [n, k] (one byte a weight) and d [n, k / group] of an 8-bit weight
 * into panels: scales float32 [panel][k / group][64]; codes per panel of 64
 * columns and block of 32 inputs, [16 input pairs][4 groups of 16 columns][16
 * even-input bytes, 16 odd-input bytes], or with int_dots quant_int.h's
 * layout: [panel][group of 8 columns][block][8 vectors][8 columns][4 inputs]. */
static void pack_w8(const uint8_t *codes, const float *d, int64_t group, int64_t n, int64_t k, int int_dots,
                    uint8_t *codes_out, float *scales_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK, groups = k / group;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < groups; b++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t row = p * PANEL + c;
                scales_out[(p * groups + b) * PANEL + c] = row < n ? d[row * groups + b] : 0.0f;
            }
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t row = p * PANEL + c;
                const uint8_t *src = codes + row * k + b * QBLOCK;
                if (int_dots) {
                    uint8_t *dst = codes_out + ((p * (PANEL / 8) + c / 8) * blocks + b) * 256 + 4 * (c % 8);
                    for (int64_t v = 0; v < 8; v++)
                        for (int64_t i = 0; i < 4; i++) dst[32 * v + i] = row < n ? src[4 * v + i] : 0;
                } else {
                    uint8_t *dst = codes_out + (p * blocks + b) * PANEL * QBLOCK + (c / 16) * 32 + c % 16;
                    for (int64_t kp = 0; kp < QBLOCK / 2; kp++) {
                        dst[kp * 128] = row < n ? src[2 * kp] : 0;
                        dst[kp * 128 + 16] = row < n ? src[2 * kp + 1] : 0;
                    }
                }
            }
}

/* Q8_0 (ggml's block_q8_0: 32 int8 codes q and a float16 scale d, w = d q,
 * exact in float32) for the output head of calls of up to
 * LINEAR_Q4_DIRECT_ROWS rows, read in 9 bits per weight (int8 codes and a
 * float32 d per 32) instead of 16: the bfloat16 weights bf16(d * q) rebuilt
 * in registers, the same bits as linear_bf16 on them. Packed by pack_w8 (its
 * int_dots layout on the AVX2 build), d [n, k / group] (one d per `group`
 * inputs, a multiple of 32 dividing k). */
void linear_q8_pack(const int8_t *codes, const float *d, int64_t group, int64_t n, int64_t k, int8_t *codes_out,
                    float *scales_out) {
#if defined(QUANT_COPY_EVERY_ROW)
    pack_w8((const uint8_t *)codes, d, group, n, k, 1, (uint8_t *)codes_out, scales_out);
#else
    pack_w8((const uint8_t *)codes, d, group, n, k, 0, (uint8_t *)codes_out, scales_out);
#endif
}

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ residual) for W packed by
 * linear_q8_pack with the same group, any m (in registers up to
 * LINEAR_Q4_DIRECT_ROWS rows, a scratch panel above: the same bits; the
 * output head reads it for few rows, compressed-tensors W8A16 layers for
 * every row count); arguments as linear_bf16. Returns 0, 1 for a group that
 * does not fit, 2 when out of memory. */
int linear_q8(const uint16_t *x, int64_t ldx, const int8_t *codes, const float *scales, int64_t group,
              const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
              int64_t k, int y_f32, int num_threads) {
    if (group <= 0 || group % QBLOCK || k % group) return 1;
#if defined(QUANT_COPY_EVERY_ROW)
    return quant_int_avx2(1, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
#elif defined(__AVX512BF16__)
    return quant_avx512(W8_INT, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                        num_threads);
#else
    return quant_f32(W8_INT, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                     num_threads);
#endif
}

/* FP8 E4M3 weights (compressed-tensors float-quantized: codes [n, k], bytes
 * of value v; w = v d with d [n, k / group], float32, one per output row and
 * `group` inputs: a per-tensor or per-channel scale is a group of k),
 * packed by pack_w8 in the bfloat16 bodies' layout on every build (these
 * CPUs have no FP8 arithmetic: there are no integer dots to take). */
void linear_fp8_pack(const uint8_t *codes, const float *d, int64_t group, int64_t n, int64_t k, uint8_t *codes_out,
                     float *scales_out) {
    pack_w8(codes, d, group, n, k, 0, codes_out, scales_out);
}

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ residual) for W packed by
 * linear_fp8_pack with the same group, any m; arguments as linear_bf16. The
 * weights read in 8 bits, each tile upcast to the bfloat16 values bf16(v * d)
 * (in registers up to LINEAR_Q4_DIRECT_ROWS rows, a scratch panel above),
 * so the results are linear_bf16's bits on the reference dequantization
 * rounded to bfloat16, on each body. Returns 0, 1 for a group that does not
 * fit, 2 when out of memory. */
int linear_fp8(const uint16_t *x, int64_t ldx, const uint8_t *codes, const float *scales, int64_t group,
               const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
               int64_t k, int y_f32, int num_threads) {
    if (group <= 0 || group % QBLOCK || k % group) return 1;
#if defined(__AVX512BF16__)
    return quant_avx512(W8_FP8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                        num_threads);
#else
    return quant_f32(W8_FP8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                     num_threads);
#endif
}
