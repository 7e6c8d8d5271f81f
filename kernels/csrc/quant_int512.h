/* The AVX512-VNNI body of the integer quantized kernels: quant_int.h's
 * arithmetic (stated at its top: inputs quantized per block of 32 as Q8_1,
 * exact int32 block sums, then per column and block in order
 * acc = fma(float(isum), d * dx, acc) (+ acc = fma(m, sx, acc) for 4-bit),
 * bias, residual, one rounding) on 16 columns a vector instead of 8. The
 * integer sums are exact and every float32 step is the same operation on the
 * same operands in the same order, so each output has the AVX2 body's bits
 * (tests/test_quant_int.py holds the two builds together).
 *
 * Block sums by VPDPBUSD (unsigned bytes times signed bytes, four products a
 * 32-bit lane, added exactly): 4-bit, the codes 0..15 (unsigned) times the
 * inputs qx (signed); 8-bit, whose codes are signed too, the inputs offset to
 * qx + 128 (unsigned, 1..255) times the codes, less 128 times the block's
 * code sum (another VPDPBUSD, of bytes 1 with the codes: shared by the
 * tile's rows). Packed layout (linear_q4_pack / linear_q8_pack on this
 * build): quant_int.h's with QI_COLS = 16, a 32-bit lane holding one column's
 * four consecutive inputs.
 *
 * Work: half a panel (32 columns) per item, as the AVX2 body. One to three
 * rows (a decode step) run both 16-column groups together, the weights
 * unpacked once for the rows, read as one stream (qi_at); more rows run each
 * group QV_MR rows at a time, the half panel's codes (k * 16 bytes, 4-bit)
 * staying in L1 or L2 while the rows pass.
 * Included by quant_int.h only. */
#ifndef TANDEM_QUANT_INT512_H
#define TANDEM_QUANT_INT512_H

#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#if defined(QUANT_INT_VNNI512)
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QUANT_INT_AMX 1
#endif
#define QV_MR 8 /* rows per register tile for many rows: 8 accumulators, 8 block sums, 8 weight vectors */

/* Four consecutive input bytes broadcast to every 32-bit lane (an embedded broadcast of VPDPBUSD). */
static inline __m512i qv_bcast4(const uint8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm512_set1_epi32(v);
}

/* Rows' accumulators acc[r][j] (lane l = column col0 + 16 j + l) plus bias
 * and residual, rounded once (f32_to_bf16's arithmetic) or stored as float32
 * when y_f32: f32_store_rows's operations, 16 lanes at a time; columns from
 * n on are not written. */
static inline __attribute__((always_inline)) void qv_store_rows(
    const int MR, const int NV, __m512 acc[][2], int64_t col0, int64_t n, const float *bias, const uint16_t *residual,
    int64_t ldr, void *y, int64_t ldy, int y_f32) {
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++) {
            const int64_t c = col0 + 16 * j;
            if (c >= n) break;
            const __mmask16 mask = tail_mask(n - c);
            __m512 v = acc[r][j];
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c));
            if (residual) v = _mm512_add_ps(v, bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, residual + r * ldr + c)));
            if (y_f32)
                _mm512_mask_storeu_ps((float *)y + r * ldy + c, mask, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + c, mask, f32x16_to_bf16(v));
        }
}

/* MR rows x NV groups of 16 columns (MR, NV literals at each call; NV <= 2):
 * groups j0 .. j0 + NV - 1 of the panel at codes / scales; the rows'
 * quantized inputs q (k apart; 8-bit: offset by 128), dx / sx (k / 32
 * apart); y, residual offset to the tile's first row, col0 the panel's first
 * column. Q8: the 8-bit kernel. */
static inline __attribute__((always_inline)) void qv_tile(
    const int Q8, const int MR, const int NV, const uint8_t *q, const float *dx, const float *sx, const void *codes,
    const void *scales, int64_t group, int j0, int64_t k, int64_t col0, int64_t n, const float *bias,
    const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int y_f32) {
    const int64_t blocks = k / QBLOCK, gbytes = Q8 ? 512 : 256; /* bytes per (group of 16 columns, block) */
    const __m512i nib = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
    __m512 acc[QV_MR][2];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if (NV == 2) qi_prefetch((const char *)codes + qi_at(j0, b, blocks) * gbytes, 2 * gbytes);
        __m512i t[QV_MR][2];
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < NV; j++) t[r][j] = _mm512_setzero_si512();
        for (int j = 0; j < NV; j++) {
            const uint8_t *cb = (const uint8_t *)codes + qi_at(j0 + j, b, blocks) * gbytes;
            if (Q8) {
                __m512i sum = _mm512_setzero_si512();
                for (int v = 0; v < 8; v++) {
                    const __m512i w = _mm512_loadu_si512(cb + 64 * v);
                    sum = _mm512_dpbusd_epi32(sum, ones, w);
                    for (int r = 0; r < MR; r++)
                        t[r][j] = _mm512_dpbusd_epi32(t[r][j], qv_bcast4(q + r * k + b * QBLOCK + 4 * v), w);
                }
                sum = _mm512_slli_epi32(sum, 7); /* 128 x the block's code sum */
                for (int r = 0; r < MR; r++) t[r][j] = _mm512_sub_epi32(t[r][j], sum);
            } else {
                for (int v = 0; v < 4; v++) {
                    const __m512i raw = _mm512_loadu_si512(cb + 64 * v);
                    const __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
                    for (int r = 0; r < MR; r++) {
                        const uint8_t *xr = q + r * k + b * QBLOCK + 8 * v;
                        t[r][j] = _mm512_dpbusd_epi32(t[r][j], lo, qv_bcast4(xr));
                        t[r][j] = _mm512_dpbusd_epi32(t[r][j], hi, qv_bcast4(xr + 4));
                    }
                }
            }
        }
        for (int j = 0; j < NV; j++) {
            __m512 d, mn = _mm512_setzero_ps();
            if (Q8)
                d = _mm512_loadu_ps((const float *)scales + b * QBLOCK / group * PANEL + 16 * (j0 + j));
            else {
                const uint16_t *sb = (const uint16_t *)scales + b * QBLOCK / group * 2 * PANEL + 16 * (j0 + j);
                d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
                mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + PANEL)));
            }
            for (int r = 0; r < MR; r++) {
                const __m512 ddx = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + b]));
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][j]), ddx, acc[r][j]);
                if (!Q8) acc[r][j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * blocks + b]), acc[r][j]);
            }
        }
    }
    qv_store_rows(MR, NV, acc, col0 + 16 * j0, n, bias, residual, ldr, y, ldy, y_f32);
}

#if defined(QUANT_INT_AMX)
#include "quant_amx.h"
#endif

/* Rows m (quantized: q [m][k], dx, sx [m][k / 32]) over every half panel of
 * a 4-bit or (Q8) 8-bit weight, the half panels shared by the threads of the
 * enclosing parallel region (an orphaned omp for: every thread of the team
 * calls this, and returns after the loop's barrier; a thread with q NULL
 * skips its items). */
static void qv_items(const int Q8, const uint8_t *q, const float *dx, const float *sx, const void *codes,
                     const void *scales, int64_t group, const float *bias, const uint16_t *residual, int64_t ldr,
                     void *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int y_f32) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = k / QBLOCK;
    const int64_t panel_codes = Q8 ? k * PANEL : k * PANEL / 2, panel_scales = k / group * (Q8 ? 1 : 2) * PANEL;
    const size_t ysz = y_f32 ? 4 : 2;
#if defined(QUANT_INT_AMX)
    const int amx = m >= QA_MIN_ROWS && qa_ready();
    if (amx) qa_configure();
#endif
    _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * 2; item++) {
        const int64_t p = item / 2;
        const int h = (int)(item % 2);
        if (!q || p * PANEL + 32 * h >= n) continue;
        const char *pc = (const char *)codes + p * panel_codes;
        const void *ps = Q8 ? (const void *)((const float *)scales + p * panel_scales)
                            : (const void *)((const uint16_t *)scales + p * panel_scales);
#if defined(QUANT_INT_AMX)
        if (amx) {
            for (int j = 2 * h; j < 2 * h + 2 && p * PANEL + 16 * j < n; j++)
                if (qa_group(Q8, q, dx, sx, pc, ps, group, j, k, p * PANEL, n, bias, residual, ldr, y, ldy, m, y_f32))
                    break; /* out of memory: this item's outputs stay unwritten, as a VNNI thread without scratch */
            continue;
        }
#endif
#define TILE(MR, NV, J) qv_tile(Q8, MR, NV, q + r * k, dx + r * blocks, sx + r * blocks, pc, ps, group, J, k, \
                                p * PANEL, n, bias, residual ? residual + r * ldr : 0, ldr, (char *)y + r * ldy * ysz, \
                                ldy, y_f32)
        int64_t r = 0;
        if (m <= 3) { /* both groups at once: the weights unpacked once for the rows */
            if (m == 3) TILE(3, 2, 2 * h);
            else if (m == 2) TILE(2, 2, 2 * h);
            else TILE(1, 2, 2 * h);
            continue;
        }
        for (int j = 2 * h; j < 2 * h + 2; j++) {
            if (p * PANEL + 16 * j >= n) break;
            for (r = 0; r + QV_MR <= m; r += QV_MR) TILE(QV_MR, 1, j);
            switch (m - r) {
            case 7: TILE(7, 1, j); break;
            case 6: TILE(6, 1, j); break;
            case 5: TILE(5, 1, j); break;
            case 4: TILE(4, 1, j); break;
            case 3: TILE(3, 1, j); break;
            case 2: TILE(2, 1, j); break;
            case 1: TILE(1, 1, j); break;
            }
        }
#undef TILE
    }
#if defined(QUANT_INT_AMX)
    if (amx) _tile_release();
#endif
}

/* This thread's buffer for m quantized rows of k inputs: dx [m][k / 32], sx [m][k / 32], then q [m][k] and
 * 16 rows of padding (the AMX body's last tile reads them). */
static inline float *qv_scratch(int64_t m, int64_t k) {
    static __thread void *buf;
    static __thread size_t cap;
    return scratch_grow(&buf, &cap, sizeof(float) * (size_t)(2 * m * (k / QBLOCK)) + (size_t)((m + 16) * k));
}

/* Row r of x quantized into buf (qv_scratch's layout for m rows); 8-bit (Q8): offset by 128. */
static inline void qv_quantize(const int Q8, const uint16_t *x, int64_t ldx, int64_t r, int64_t m, int64_t k,
                               float *buf) {
    const int64_t blocks = k / QBLOCK;
    int8_t *q = (int8_t *)(buf + 2 * m * blocks) + r * k;
    qi_quantize_row(x + r * ldx, k, q, buf + r * blocks, buf + (m + r) * blocks);
    if (Q8)
        for (int64_t i = 0; i < k; i += 32)
            _mm256_storeu_si256((__m256i *)(q + i), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + i)),
                                                                     _mm256_set1_epi8((char)0x80)));
}

/* The rows' work shared by the enclosing team (linear_q4_team): each thread quantizes the rows into its own
 * scratch, then takes its items. Returns 0, or 2 in a thread whose scratch could not be allocated (its
 * items skipped: the loop's other threads do theirs). */
static int qv_team(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                   int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
                   int64_t m, int64_t n, int64_t k, int y_f32) {
    const int64_t blocks = k / QBLOCK;
    float *buf = qv_scratch(m, k);
    if (buf)
        for (int64_t r = 0; r < m; r++) qv_quantize(Q8, x, ldx, r, m, k, buf);
    qv_items(Q8, buf ? (const uint8_t *)(buf + 2 * m * blocks) : 0, buf, buf ? buf + m * blocks : 0, codes, scales,
             group, bias, residual, ldr, y, ldy, m, n, k, y_f32);
    return buf ? 0 : 2;
}

/* y [m, n] = x [m, k] @ W.T (+ bias) (+ residual) over a team of num_threads threads of its own: up to
 * QV_MR rows as qv_team (each thread quantizes them: no barrier before the items), more quantized once,
 * split among the threads, into the calling thread's scratch, then the items. Returns 0, or 2 when out of
 * memory. */
static int qv_linear(const int Q8, const uint16_t *x, int64_t ldx, const void *codes, const void *scales,
                     int64_t group, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
                     int64_t m, int64_t n, int64_t k, int y_f32, int num_threads) {
    const int64_t blocks = k / QBLOCK;
    if (m <= QV_MR) {
        int failed = 0;
        _Pragma("omp parallel num_threads(num_threads)") {
            if (qv_team(Q8, x, ldx, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, y_f32)) {
                _Pragma("omp atomic write") failed = 2;
            }
        }
        return failed;
    }
    float *buf = qv_scratch(m, k);
    if (!buf) return 2;
    _Pragma("omp parallel num_threads(num_threads)") {
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) qv_quantize(Q8, x, ldx, r, m, k, buf);
        qv_items(Q8, (const uint8_t *)(buf + 2 * m * blocks), buf, buf + m * blocks, codes, scales, group, bias,
                 residual, ldr, y, ldy, m, n, k, y_f32);
    }
    return 0;
}
#endif

#endif
