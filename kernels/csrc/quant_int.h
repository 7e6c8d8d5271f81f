/* The integer bodies of the 4-bit and 8-bit GGUF kernels (linear_q4_cpu.c,
 * whose header describes the formats), on every x86 build with AVX2
 * (QUANT_COPY_EVERY_ROW, kernels.h): integer dot products, as llama.cpp's
 * ggml-cpu runs Q4_0/Q4_1/Q8_0 (ggml_vec_dot_q4_1_q8_1 /
 * ggml_vec_dot_q8_0_q8_0), instead of rebuilding bfloat16 weights and
 * running float FMAs on them (~19-40 vector operations per 32 weights per
 * row, so a decode step was bound by that arithmetic, not by reading the
 * weights). This file states the arithmetic and holds the AVX2 body
 * (VPMADDUBSW, 8 columns a vector); quant_int512.h the AVX512-VNNI one
 * (VPDPBUSD, 16 columns a vector): the same bits on both, for every shape.
 *
 * Arithmetic, per row, fixed: the row's bfloat16 inputs, widened to float32
 * (exact), are quantized per block of 32 inputs as llama.cpp's Q8_1:
 * amax = max |x|, dx = amax / 127, id = amax ? 127 / amax : 0,
 * qx = nearest-even(x * id) in -127..127, sx = dx * (sum of qx) (each one
 * float32 operation). Output column c then starts from a float32 zero and,
 * for blocks b = 0, 1, ... in order, receives
 *   acc = fma(float(isum), d * dx, acc); acc = fma(m, sx, acc)   (4-bit)
 *   acc = fma(float(isum), d * dx, acc)                          (8-bit)
 * where isum = sum over the block of q * qx, exact in 32-bit integers
 * (|isum| < 2^19: exact in float32 too), d and m the column's scale and
 * min of the group holding block b (Q4_0: m = -8 d, codes 0..15; Q8_0: codes
 * -128..127). Bias and
 * residual are added after the last block and the sum is rounded once
 * (f32_to_bf16's arithmetic). A row's bits so depend only on that row and the weight,
 * never on the row count, the tiling, the threads or the ISA (batch-invariant for
 * every row count, and the same on AVX2 and AVX-512 machines); they are not the bfloat16 kernel's bits on the
 * dequantized weights (the inputs are rounded to 8 bits per block), so the
 * callers read the quantized copy for every row count of these builds
 * (QUANT_COPY_EVERY_ROW, kernels.h) and the float32 parity path never runs
 * here (these kernels take bfloat16 inputs only).
 *
 * Packed layouts (linear_q4_pack / linear_q8_pack on these builds: qi_pack_q4,
 * qi_pack_w8; the scales as for the other bodies): per panel of 64 columns,
 * per half panel, per block of 32 inputs, per group g of QI_COLS columns (8
 * on AVX2, 16 with VNNI; qi_at), 4-bit: 4 vectors of 4 QI_COLS bytes, byte
 * 4 c + i of vector v holding column QI_COLS g + c's code at input 8 v + i (low nibble) and
 * 8 v + 4 + i (high); 8-bit: 8 vectors, byte 4 c + i of vector v column
 * QI_COLS g + c's code at input 4 v + i. A 32-bit lane so holds one
 * column's four consecutive inputs, whose products VPMADDUBSW + VPMADDWD
 * (AVX2) or VPDPBUSD sum against four broadcast input bytes: no
 * horizontal sums. Included by linear_q4_cpu.c only (QBLOCK is its). */
#ifndef TANDEM_QUANT_INT_H
#define TANDEM_QUANT_INT_H

#include <stdint.h>
#include <string.h>

#include "f32_panel.h"
#include "kernels.h"

#if defined(QUANT_COPY_EVERY_ROW)
#if defined(QUANT_INT_VNNI512)
#define QI_COLS 16 /* columns per vector (a group of the packed layout) */
#else
#define QI_COLS 8
#endif
#define QI_TILE 4 /* AVX2: rows x groups of 8 columns per register tile */
#define QI_HALF (PANEL / 2 / QI_COLS) /* groups per half panel (a work item) */

/* Where group g's block b sits in its panel, in units of one (group, block)'s codes: the half panel's
 * groups interleaved block by block, so that a work item (half a panel) of a decode step reads one
 * sequential stream. */
static inline int64_t qi_at(int64_t g, int64_t b, int64_t blocks) {
    return (g / QI_HALF * blocks + b) * QI_HALF + g % QI_HALF;
}

/* How far ahead of a one-row tile's reads the codes are asked for (bytes). A decode step reads every weight
 * once, from the last-level cache at best; the tile's arithmetic between its loads left the core's own
 * prefetchers behind: 30 layers of one-row calls read ~33 GB/s where a plain read in the same pattern reaches
 * ~51 (2-core Intel host). Asking 2 KB ahead took those calls to 0.92x the time on the VNNI body and 0.90x on
 * the AVX2 one (1 and 4 KB: less, 3 KB the same, into L2 instead: less; docs/benchmarks/decode-roofline.md,
 * sixth pass). */
#define QI_PREFETCH_BYTES 2048

/* Ask for `bytes` of codes QI_PREFETCH_BYTES past `at` (into L1), one request per cache line. */
static inline __attribute__((always_inline)) void qi_prefetch(const char *at, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(at + QI_PREFETCH_BYTES + l, _MM_HINT_T0);
}

/* 4-bit codes [n, k] (0..15) into the layout at the top of this file; padded columns get code 0. */
static void qi_pack_q4(const uint8_t *codes, int64_t n, int64_t k, uint8_t *codes_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < PANEL / QI_COLS; g++)
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t *dst =
                    codes_out + (p * (PANEL / QI_COLS) * blocks + qi_at(g, b, blocks)) * (QBLOCK / 2 * QI_COLS);
                for (int64_t v = 0; v < 4; v++)
                    for (int64_t c = 0; c < QI_COLS; c++)
                        for (int64_t i = 0; i < 4; i++) {
                            const int64_t row = p * PANEL + QI_COLS * g + c, in = b * QBLOCK + 8 * v + i;
                            const uint8_t lo = row < n ? codes[row * k + in] : 0, hi = row < n ? codes[row * k + in + 4] : 0;
                            dst[4 * QI_COLS * v + 4 * c + i] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                        }
            }
}

/* 8-bit codes [n, k] into the layout at the top of this file; padded columns get code 0. */
static void qi_pack_w8(const uint8_t *codes, int64_t n, int64_t k, uint8_t *codes_out) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t row = p * PANEL + c;
                const uint8_t *src = codes + row * k + b * QBLOCK;
                uint8_t *dst = codes_out + (p * (PANEL / QI_COLS) * blocks + qi_at(c / QI_COLS, b, blocks)) * QBLOCK * QI_COLS
                               + 4 * (c % QI_COLS);
                for (int64_t v = 0; v < 8; v++)
                    for (int64_t i = 0; i < 4; i++) dst[4 * QI_COLS * v + i] = row < n ? src[4 * v + i] : 0;
            }
}

/* One row's bfloat16 inputs [k] quantized per block of 32 (see the top of
 * this file): q [k] int8, dx, sx [k / 32]. */
static inline void qi_quantize_row(const uint16_t *x, int64_t k, int8_t *q, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(x + b * QBLOCK + 8 * i));
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        float lanes[8], a = 0.0f;
        _mm256_storeu_ps(lanes, amax);
        for (int l = 0; l < 8; l++) a = lanes[l] > a ? lanes[l] : a;
        const float id = a != 0.0f ? 127.0f / a : 0.0f;
        __m256i qi[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) { /* nearest-even: MXCSR's default rounding */
            qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            total = _mm256_add_epi32(total, qi[i]);
        }
        int32_t t[8], s = 0;
        _mm256_storeu_si256((__m256i *)t, total);
        for (int l = 0; l < 8; l++) s += t[l];
        /* int32 -> int8 in input order (llama.cpp's quantize_row_q8_0 sequence) */
        const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QBLOCK), p8);
        dx[b] = a / 127.0f;
        sx[b] = dx[b] * (float)s;
    }
}

#if !defined(QUANT_INT_VNNI512)
/* Four consecutive activation bytes broadcast to every 32-bit lane. */
static inline __m256i qi_bcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

/* MR rows x NG groups of 8 columns (MR * NG <= QI_TILE, literals at each
 * call): groups g0 .. g0 + NG - 1 of the panel at codes / scales; rows'
 * quantized inputs q (k apart), dx / sx (k / 32 apart); y, residual offset to
 * the tile's first row, col0 its first column. Q8: the 8-bit layout. */
static inline __attribute__((always_inline)) void qi_tile(
    const int Q8, const int MR, const int NG, const int8_t *q, const float *dx, const float *sx, const void *codes,
    const void *scales, int64_t group, int g0, int64_t k, int64_t col0, int64_t n, const float *bias, const uint16_t *residual,
    int64_t ldr, void *y, int64_t ldy, int y_f32) {
    const int64_t blocks = k / QBLOCK, gbytes = Q8 ? 256 : 128; /* bytes per (group, block) */
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[QI_TILE][8];
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < NG; g++) acc[r][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (MR == 1 && NG == 4) qi_prefetch((const char *)codes + qi_at(g0, b, blocks) * gbytes, 4 * gbytes);
        __m256i t[QI_TILE][QI_TILE];
        for (int r = 0; r < MR; r++)
            for (int g = 0; g < NG; g++) t[r][g] = _mm256_setzero_si256();
        for (int g = 0; g < NG; g++) {
            const uint8_t *cb = (const uint8_t *)codes + qi_at(g0 + g, b, blocks) * gbytes;
            if (Q8) {
                for (int v = 0; v < 8; v++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(cb + 32 * v)), aw = _mm256_abs_epi8(w);
                    for (int r = 0; r < MR; r++) { /* |w| * (qx with w's sign): pairs <= 2 * 128 * 127 */
                        const __m256i xs = _mm256_sign_epi8(qi_bcast4(q + r * k + b * QBLOCK + 4 * v), w);
                        t[r][g] = _mm256_add_epi32(t[r][g], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
                    }
                }
            } else {
                __m256i s16[QI_TILE];
                for (int r = 0; r < MR; r++) s16[r] = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(cb + 32 * v));
                    const __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
                    for (int r = 0; r < MR; r++) { /* 16-bit lanes: 8 pairs of <= 2 * 15 * 127, no overflow */
                        const int8_t *xr = q + r * k + b * QBLOCK + 8 * v;
                        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, qi_bcast4(xr)));
                        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, qi_bcast4(xr + 4)));
                    }
                }
                for (int r = 0; r < MR; r++) t[r][g] = _mm256_madd_epi16(s16[r], ones);
            }
        }
        for (int g = 0; g < NG; g++) {
            __m256 d, mn = _mm256_setzero_ps();
            if (Q8)
                d = _mm256_loadu_ps((const float *)scales + b * QBLOCK / group * PANEL + 8 * (g0 + g));
            else {
                const uint16_t *sb = (const uint16_t *)scales + b * QBLOCK / group * 2 * PANEL + 8 * (g0 + g);
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
                mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + PANEL)));
            }
            for (int r = 0; r < MR; r++) {
                const __m256 ddx = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * blocks + b]));
                acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][g]), ddx, acc[r][g]);
                if (!Q8) acc[r][g] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[r * blocks + b]), acc[r][g]);
            }
        }
    }
    f32_store_rows(MR, NG, acc, col0 + 8 * g0, n, bias, residual, ldr, y, ldy, y_f32);
}

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ residual) for any m over a 4-bit or
 * (Q8) 8-bit weight in this file's layouts; each work item half a panel (two
 * threads split a 576-column layer evenly), its rows four at a time (one
 * group of 8 columns each) or, for one row, all four of its groups at once.
 * The items are shared by the threads of the enclosing parallel region (an
 * orphaned omp for: every thread of the team calls this, and returns after
 * the loop's barrier), each thread quantizing the rows into its own scratch
 * first. Returns 0, or 2 in a thread whose scratch could not be allocated
 * (its items skipped). */
static int quant_int_items(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                           int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y,
                           int64_t ldy, int64_t m, int64_t n, int64_t k, int y_f32) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK;
    const int64_t panel_codes = Q8 ? k * PANEL : k * PANEL / 2, panel_scales = k / group * (Q8 ? 1 : 2) * PANEL;
    const size_t ysz = y_f32 ? 4 : 2;
    {
        /* this thread's copy of the quantized rows: dx [m][blocks], sx [m][blocks], then q [m][k] */
        float *buf = f32_scratch((size_t)(2 * m * blocks + (m * k + 3) / 4));
        if (buf)
            for (int64_t r = 0; r < m; r++)
                qi_quantize_row(x + r * ldx, k, (int8_t *)(buf + 2 * m * blocks) + r * k, buf + r * blocks,
                                buf + (m + r) * blocks);
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * 2; item++) {
            const int64_t p = item / 2;
            const int h = (int)(item % 2);
            if (!buf || p * PANEL + 32 * h >= n) continue;
            const char *pc = (const char *)codes + p * panel_codes;
            const void *ps = Q8 ? (const void *)((const float *)scales + p * panel_scales)
                                : (const void *)((const uint16_t *)scales + p * panel_scales);
            const int8_t *q = (const int8_t *)(buf + 2 * m * blocks);
#define TILE(MR, NG, G) qi_tile(Q8, MR, NG, q + r * k, buf + r * blocks, buf + (m + r) * blocks, pc, ps, group, G, k, \
                                p * PANEL, n, bias, residual ? residual + r * ldr : 0, ldr, (char *)y + r * ldy * ysz, \
                                ldy, y_f32)
            int64_t r = 0;
            if (m == 1) {
                TILE(1, 4, 4 * h);
                continue;
            }
            for (int g = 4 * h; g < 4 * h + 4; g++) {
                if (p * PANEL + 8 * g >= n) break;
                for (r = 0; r + 4 <= m; r += 4) TILE(4, 1, g);
                switch (m - r) {
                case 3: TILE(3, 1, g); break;
                case 2: TILE(2, 1, g); break;
                case 1: TILE(1, 1, g); break;
                }
            }
#undef TILE
        }
        return buf ? 0 : 2;
    }
}

/* quant_int_items over a team of num_threads threads of its own. Returns 0, or 2 when out of memory. */
static int quant_int_avx2(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                          int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
                          int64_t m, int64_t n, int64_t k, int y_f32, int num_threads) {
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)") {
        const int mine = quant_int_items(Q8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32);
        if (mine) {
            _Pragma("omp atomic write") failed = mine;
        }
    }
    return failed;
}
#else
#include "quant_int512.h"
#endif

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ residual) for any m over a 4-bit or (Q8) 8-bit weight in this
 * file's layout, on this build's body, over a team of num_threads threads of its own. Returns 0, or 2 when
 * out of memory. */
static int quant_int(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                     int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
                     int64_t m, int64_t n, int64_t k, int y_f32, int num_threads) {
#if defined(QUANT_INT_VNNI512)
    return qv_linear(Q8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32, num_threads);
#else
    return quant_int_avx2(Q8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32,
                          num_threads);
#endif
}

/* quant_int's work shared by the threads of the enclosing parallel region (every thread calls it with the
 * same arguments; each returns once all the outputs are written). Returns 0, or 2 in a thread whose scratch
 * could not be allocated (its items skipped). */
static int quant_int_team(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                          int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y,
                          int64_t ldy, int64_t m, int64_t n, int64_t k, int y_f32) {
#if defined(QUANT_INT_VNNI512)
    return qv_team(Q8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32);
#else
    return quant_int_items(Q8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32);
#endif
}
#endif

#endif
