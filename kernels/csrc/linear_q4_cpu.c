/* 4-bit GGUF linear layers (Q4_0, Q4_1; GPTQ/AWQ/compressed-tensors 4-bit
 * checkpoints at their own group size) and 8-bit ones (GGUF Q8_0,
 * compressed-tensors W8A16 int, FP8), read in 4 or 8 bits: y = x @ W.T
 * (+ bias) (+ residual), x bfloat16. Built with the other kernels by
 * kernels/cpu_build.py, called from kernels/cpu_linear.py.
 *
 * llama.cpp's blocks (ggml's block_q4_0 / block_q4_1; GGUF spec:
 * https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) hold 32
 * consecutive inputs of one output row as codes q in 0..15 with a float16
 * scale d (and, Q4_1, a min m); w = d q + m (Q4_0: m = -8 d). The scales are
 * packed float16 [panel][k / group][2][64] per group of `group` inputs
 * (kernels/cpu_linear.py: pack_q4 lays them out): d, then m. GGUF's group is
 * its block of 32; GPTQ/AWQ/compressed-tensors checkpoints keep their own
 * (64, 128, a whole row...).
 *
 * Two arithmetics, one per build, each with one rule:
 * - x86 builds with AVX2 (the AVX2 one and the AVX-512 one:
 *   QUANT_COPY_EVERY_ROW, kernels.h) run 4-bit and int8 weights by integer
 *   dot products on inputs quantized to 8 bits per block, as llama.cpp does
 *   (quant_int.h states the arithmetic; its AVX2 body and quant_int512.h's
 *   AVX512-VNNI body give the same bits);
 * - the portable build rebuilds the bfloat16 weights the loader dequantizes
 *   (bf16(d * q + m): d * q is exact, as d is a float16 and q < 16, so one
 *   rounding, as the gguf package's float32 dequantization rounded to
 *   bfloat16) and runs f32_panel.h's arithmetic on them (quant_f32.h): the
 *   bits of linear_bf16 on the dequantized weights.
 * FP8 weights have no integer dots on these CPUs: every build rebuilds their
 * bfloat16 values (bf16(v d)) and runs its bfloat16 arithmetic (below on
 * AVX512-BF16, quant_f32.h elsewhere), linear_bf16's bits on them.
 *
 * The portable build's 4-bit layout, per panel of 64 output columns and
 * block of 32 inputs: codes [16 input pairs][4 groups of 16 columns][16
 * bytes], byte j of a group holding column 16 g + j / 2 (low nibble) and
 * 16 g + 8 + j / 2 (high) at input 2 kp + j % 2 (quant_f32.h reads it); the
 * integer builds' layout is quant_int.h's.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_panel.h"
#include "kernels.h"

#define QBLOCK 32
#define MR_Q4 3  /* rows per register tile on the in-register path */
/* The kinds of 8-bit weights (the W8 argument of the float bodies; 0: 4-bit) */
#define W8_INT 1 /* int8 codes q, w = d q (GGUF Q8_0) */
#define W8_FP8 2 /* FP8 E4M3 codes of value v, w = v d (compressed-tensors float-quantized) */

#include "quant_f32.h"
#include "quant_int.h"

/* Which arithmetic this build's 4-bit and int8 kernels run (kernels/cpu_linear.py's quant_body): 0 the
 * bfloat16 values of the dequantized weights (portable), 1 integer dots on AVX2, 2 integer dots on
 * AVX512-VNNI (1 and 2: quant_int.h's rule, the same bits). */
int linear_quant_int(void) {
#if defined(QUANT_INT_VNNI512)
    return 2;
#elif defined(QUANT_COPY_EVERY_ROW)
    return 1;
#else
    return 0;
#endif
}

/* 1 where calls of QA_MIN_ROWS rows or more take their block sums from AMX tile multiplies (quant_amx.h: a
 * build with AMX-INT8, the tile state granted to this process, $TANDEM_CPU_AMX not "0"), else 0; the same
 * bits either way. Asks the kernel for the tile state the first time. */
int linear_quant_amx(void) {
#if defined(QUANT_INT_AMX)
    return qa_ready();
#else
    return 0;
#endif
}

/* Pack codes [n, k] (uint8, 0..15) into codes_out (k a multiple of 32; padded columns get code 0): the
 * integer builds' layout (quant_int.h), else [ceil(n / 64)][k / 32][16][4][16] (the top of this file). */
void linear_q4_pack(const uint8_t *codes, int64_t n, int64_t k, uint8_t *codes_out) {
#if defined(QUANT_COPY_EVERY_ROW)
    qi_pack_q4(codes, n, k, codes_out);
#else
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
#endif
}

#if defined(__AVX512BF16__)
/* The AVX512-BF16 body of linear_fp8: each tile of FP8 weights rebuilt as the bfloat16 values bf16(v d)
 * and run by VDPBF16PS, bf16_panel.h's arithmetic, so linear_bf16's bits on the dequantized weights. */

/* This thread's scratch of at least `elems` bfloat16 values (scratch_grow). */
static uint16_t *thread_scratch(size_t elems) {
    static __thread void *buf;
    static __thread size_t cap;
    return scratch_grow(&buf, &cap, sizeof(uint16_t) * elems);
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

/* An FP8 weight's 16 x 2 operand (16 columns' codes at input 2 kp, then at 2 kp + 1; d: their scales):
 * bf16(v * d) for codes of value v (one float32 rounding, as the reference dequantization's v * scale),
 * lane 2 c = column c at input 2 kp, lane 2 c + 1 at 2 kp + 1. */
static inline __attribute__((always_inline)) __m512bh dequant_fp8_16x2(const uint8_t *codes, const float *d) {
    const __m128i even = _mm_loadu_si128((const __m128i *)codes), odd = _mm_loadu_si128((const __m128i *)(codes + 16));
    const __m512 dv = _mm512_loadu_ps(d);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(dv, fp8x16_to_f32(odd)),
                                                      _mm512_mul_ps(dv, fp8x16_to_f32(even)));
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (__m512bh)_mm512_permutexvar_epi16(idx, both);
}

/* One FP8 panel (its codes and scales, one d per `group` inputs) dequantized into scratch [k / 2][64][2]. */
static void dequant_panel_fp8(const uint8_t *codes, const float *scales, int64_t group, int64_t k,
                              uint16_t *scratch) {
    for (int64_t kp = 0; kp < k / 2; kp++)
        for (int g = 0; g < 4; g++)
            _mm512_storeu_si512(scratch + (kp * PANEL + 16 * g) * 2,
                                (__m512i)dequant_fp8_16x2(codes + kp * 128 + 32 * g,
                                                          scales + kp / (group / 2) * PANEL + 16 * g));
}

/* MR (<= 3, a literal at each call) rows x the 32 columns of half h of one FP8 panel, each input pair
 * dequantized in registers; the same arithmetic as panel_rows. (Half panels: twice the work items, so that
 * two threads split a 576-column layer evenly.) */
static inline __attribute__((always_inline)) void half_panel_rows(
    const int MR, const uint16_t *x, int64_t ldx, const uint8_t *codes, const float *scales, int64_t group,
    int64_t h, int64_t k, int64_t col0, int64_t n, const float *bias, const uint16_t *residual, int64_t ldr, void *y,
    int64_t ldy, int y_f32) {
    __m512 acc[MR_Q4][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 2; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < k / 2; kp++) {
        const float *sb = scales + kp / (group / 2) * PANEL + 32 * h;
        const uint8_t *cp = codes + kp * 128 + 64 * h;
        const __m512bh w0 = dequant_fp8_16x2(cp, sb), w1 = dequant_fp8_16x2(cp + 32, sb + 16);
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

/* y = x @ W.T (+ bias) (+ residual) for an FP8 weight: up to LINEAR_Q4_DIRECT_ROWS rows in registers (half
 * a panel per work item), more by work items of (panel, block of M_BLOCK rows), each panel dequantized into
 * this thread's bfloat16 scratch and run by bf16_panel.h's kernel: the same bits either way. Returns 0, or 2
 * when out of memory. */
static int fp8_avx512(const uint16_t *x, int64_t ldx, const uint8_t *codes, const float *scales, int64_t group,
                      const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m,
                      int64_t n, int64_t k, int y_f32, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL, m_blocks = (m + M_BLOCK - 1) / M_BLOCK;
    const int64_t panel_codes = k * PANEL, panel_scales = k / group * PANEL;
    if (m <= LINEAR_Q4_DIRECT_ROWS) {
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
        for (int64_t item = 0; item < panels * 2; item++) {
            const int64_t p = item / 2, h = item % 2;
            if (p * PANEL + 32 * h >= n) continue;
#define ROWS(MR) half_panel_rows(MR, x, ldx, codes + p * panel_codes, scales + p * panel_scales, group, h, k, \
                                 p * PANEL, n, bias, residual, ldr, y, ldy, y_f32)
            if (m == 3) ROWS(3);
            else if (m == 2) ROWS(2);
            else if (m == 1) ROWS(1);
#undef ROWS
        }
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
            dequant_panel_fp8(codes + p * panel_codes, scales + p * panel_scales, group, k, scratch);
            panel_row_block(x, ldx, scratch, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32, m0, m1);
        }
    }
    return failed;
}
#endif

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
#if defined(QUANT_COPY_EVERY_ROW)
    const int rc = quant_int(0, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
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
 * same work items, so the same bits, as linear_q4. Returns 0; 1, having done nothing, where linear_q4 must
 * be called instead (more rows, a group that does not fit, the portable build): the same answer in every
 * thread; 2 in a thread whose scratch could not be allocated (its items skipped). */
int linear_q4_team(const uint16_t *x, int64_t ldx, const uint8_t *codes, const uint16_t *scales, int64_t group,
                   const float *bias, const uint16_t *residual, int64_t ldr, uint16_t *y, int64_t ldy, int64_t m,
                   int64_t n, int64_t k) {
    if (m < 1 || m > LINEAR_Q4_DIRECT_ROWS || group <= 0 || group % QBLOCK || k % group) return 1;
#if defined(QUANT_COPY_EVERY_ROW)
    return quant_int_team(0, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, 0);
#else
    (void)x, (void)ldx, (void)codes, (void)scales, (void)bias, (void)residual, (void)ldr, (void)y, (void)ldy, (void)n;
    return 1;
#endif
}

/* Scales d [n, k / group] of an 8-bit weight into scales_out float32 [panel][k / group][64]; its codes [n, k]
 * (one byte a weight) into the integer builds' layout (int_dots, quant_int.h's), else per panel of 64
 * columns and block of 32 inputs, [16 input pairs][4 groups of 16 columns][16 even-input bytes, 16
 * odd-input bytes]. */
static void pack_w8(const uint8_t *codes, const float *d, int64_t group, int64_t n, int64_t k, int int_dots,
                    uint8_t *codes_out, float *scales_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK, groups = k / group;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < groups; b++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t row = p * PANEL + c;
                scales_out[(p * groups + b) * PANEL + c] = row < n ? d[row * groups + b] : 0.0f;
            }
#if defined(QUANT_COPY_EVERY_ROW)
    if (int_dots) {
        qi_pack_w8(codes, n, k, codes_out);
        return;
    }
#else
    (void)int_dots;
#endif
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t row = p * PANEL + c;
                const uint8_t *src = codes + row * k + b * QBLOCK;
                uint8_t *dst = codes_out + (p * blocks + b) * PANEL * QBLOCK + (c / 16) * 32 + c % 16;
                for (int64_t kp = 0; kp < QBLOCK / 2; kp++) {
                    dst[kp * 128] = row < n ? src[2 * kp] : 0;
                    dst[kp * 128 + 16] = row < n ? src[2 * kp + 1] : 0;
                }
            }
}

/* Q8_0 (ggml's block_q8_0: 32 int8 codes q and a float16 scale d, w = d q,
 * exact in float32) and compressed-tensors W8A16 int weights (d per `group`
 * inputs, a multiple of 32 dividing k), read in 9 bits per weight (int8
 * codes and a float32 d per 32) instead of 16: packed by pack_w8 (its
 * int_dots layout on the integer builds), d [n, k / group]. */
void linear_q8_pack(const int8_t *codes, const float *d, int64_t group, int64_t n, int64_t k, int8_t *codes_out,
                    float *scales_out) {
    pack_w8((const uint8_t *)codes, d, group, n, k, linear_quant_int() != 0, (uint8_t *)codes_out, scales_out);
}

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ residual) for W packed by
 * linear_q8_pack with the same group, any m: integer dots on the integer
 * builds (quant_int.h), else bitwise the bfloat16 kernel on bf16(d q) (in
 * registers up to LINEAR_Q4_DIRECT_ROWS rows, a scratch panel above: the
 * same bits); arguments as linear_bf16. Returns 0, 1 for a group that does
 * not fit, 2 when out of memory. */
int linear_q8(const uint16_t *x, int64_t ldx, const int8_t *codes, const float *scales, int64_t group,
              const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
              int64_t k, int y_f32, int num_threads) {
    if (group <= 0 || group % QBLOCK || k % group) return 1;
#if defined(QUANT_COPY_EVERY_ROW)
    return quant_int(1, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
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
    return fp8_avx512(x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
#else
    return quant_f32(W8_FP8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                     num_threads);
#endif
}
