/* float32 linear layers whose every output is one fused-multiply-add chain:
 * y = x @ W.T (+ bias) (+ residual), all float32, for W held as float32
 * panels (a dense float32 model: linear_f32) or as 4-bit codes (GGUF
 * Q4_0/Q4_1, GPTQ/AWQ/compressed-tensors 4-bit groups: linear_q4_f32). Built
 * with the other kernels by kernels/cpu_build.py, called from
 * kernels/cpu_linear_f32.py. They replace, in float32, MKL's GEMM in row
 * tiles zero-padded to 32 rows (so that a row's bits do not depend on its
 * batch: a decode step of 8 rows paid for 32) and PyTorch's
 * _weight_int4pack_mm_for_cpu (scalar code in float32: ~0.6 GFLOP/s).
 *
 * The arithmetic, one rule for every body (AVX-512, AVX2/FMA, portable), so
 * every body gives the same bits: each output is one float32 accumulator over
 * the inputs in their order, acc = fmaf(x[i], w[i], acc) from 0, then
 * (acc + bias) and then residual + that, each one float32 addition (PyTorch's
 * order on a matmul's result). A 4-bit weight is rebuilt first as w =
 * fmaf(d, q, m) (d, m float32 per group of `group` inputs; for float16 d and
 * codes q < 16, d * q is exact, so w is the gguf package's float32
 * dequantization d * q + m bit for bit). A row's bits depend on that row
 * alone: batch-invariant for any row count.
 *
 * Layouts, per panel of 32 output columns (padded columns zero): dense
 * (linear_f32_pack) float32 [k][32]; 4-bit (linear_q4_f32_pack) codes [k][16]
 * bytes, byte j holding column j (low nibble) and column 16 + j (high nibble)
 * at input i, and scales float32 [panel][k / group][2][32]: d, then m.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define QF_PANEL 32 /* output columns per panel */
/* rows per register tile, its accumulators 2 zmm a row (12 of AVX-512's 32) or 4 ymm (12 of AVX2's 16); how
 * many rows share a tile changes no row's bits */
#if defined(__AVX512F__)
#define QF_ROWS 6
#else
#define QF_ROWS 3
#endif
#define QF_BYTES (QF_PANEL / 2)

/* Pack a dense weight w [n, k] (float32) into panels [ceil(n / 32)][k][32]; padded columns get 0. */
void linear_f32_pack(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + QF_PANEL - 1) / QF_PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t c = 0; c < QF_PANEL; c++) {
                const int64_t col = p * QF_PANEL + c;
                out[(p * k + i) * QF_PANEL + c] = col < n ? w[col * k + i] : 0.0f;
            }
}

/* Pack codes [n, k] (uint8, 0..15) and d, m [n, k / group] (float32) into the layout above; padded columns
 * get code 0 and d = m = 0. */
void linear_q4_f32_pack(const uint8_t *codes, const float *d, const float *m, int64_t n, int64_t k, int64_t group,
                        uint8_t *codes_out, float *scales_out) {
    const int64_t panels = (n + QF_PANEL - 1) / QF_PANEL, groups = k / group;
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < QF_BYTES; j++) {
                const int64_t lo = p * QF_PANEL + j, hi = lo + QF_BYTES;
                const uint8_t a = lo < n ? codes[lo * k + i] & 15 : 0, b = hi < n ? codes[hi * k + i] & 15 : 0;
                codes_out[(p * k + i) * QF_BYTES + j] = (uint8_t)(a | b << 4);
            }
        for (int64_t g = 0; g < groups; g++)
            for (int64_t c = 0; c < QF_PANEL; c++) {
                const int64_t col = p * QF_PANEL + c;
                float *s = scales_out + ((p * groups + g) * 2) * QF_PANEL;
                s[c] = col < n ? d[col * groups + g] : 0.0f;
                s[QF_PANEL + c] = col < n ? m[col * groups + g] : 0.0f;
            }
    }
}

/* Write a tile's sums: y[r][col0 + c] = residual + (acc + bias), for the columns below n. */
static void store_tile(int rows, float acc[QF_ROWS][QF_PANEL], int64_t col0, int64_t n, const float *bias,
                       const float *residual, int64_t ldr, float *y, int64_t ldy) {
    const int64_t cols = n - col0 < QF_PANEL ? n - col0 : QF_PANEL;
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float v = acc[r][c];
            if (bias) v = v + bias[col0 + c];
            if (residual) v = residual[r * ldr + col0 + c] + v;
            y[r * ldy + col0 + c] = v;
        }
}

#if defined(__AVX512F__)
/* acc[r] += x[r][i] * (w0, w1) for the tile's rows: input i of one panel, 16 columns a vector. */
static inline __attribute__((always_inline)) void fma_rows(int rows, const float *x, int64_t ldx, int64_t i,
                                                           __m512 w0, __m512 w1, __m512 acc[QF_ROWS][2]) {
    for (int r = 0; r < rows; r++) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
        acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
}

static inline __attribute__((always_inline)) void store_rows(int rows, __m512 acc[QF_ROWS][2],
                                                             float out[QF_ROWS][QF_PANEL]) {
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + 16, acc[r][1]);
    }
}

/* Up to QF_ROWS rows x one dense panel (w [k][32]). */
static void dense_tile(int rows, const float *x, int64_t ldx, const float *w, int64_t k,
                       float out[QF_ROWS][QF_PANEL]) {
    __m512 acc[QF_ROWS][2];
    for (int r = 0; r < QF_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++)
        fma_rows(rows, x, ldx, i, _mm512_loadu_ps(w + i * QF_PANEL), _mm512_loadu_ps(w + i * QF_PANEL + 16), acc);
    store_rows(rows, acc, out);
}

/* Up to QF_ROWS rows x one 4-bit panel, 16 columns a vector. */
static void q4_tile(int rows, const float *x, int64_t ldx, const uint8_t *codes, const float *scales,
                    int64_t group, int64_t k, float out[QF_ROWS][QF_PANEL]) {
    __m512 acc[QF_ROWS][2];
    for (int r = 0; r < QF_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        const float *s = scales + g0 / group * 2 * QF_PANEL;
        const __m512 d0 = _mm512_loadu_ps(s), d1 = _mm512_loadu_ps(s + 16);
        const __m512 m0 = _mm512_loadu_ps(s + 32), m1 = _mm512_loadu_ps(s + 48);
        for (int64_t i = g0; i < g0 + group; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(codes + i * QF_BYTES));
            const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)));
            const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
            fma_rows(rows, x, ldx, i, _mm512_fmadd_ps(d0, q0, m0), _mm512_fmadd_ps(d1, q1, m1), acc);
        }
    }
    store_rows(rows, acc, out);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* acc[r] += x[r][i] * w for the tile's rows: input i of one panel, 8 columns a vector. */
static inline __attribute__((always_inline)) void fma_rows(int rows, const float *x, int64_t ldx, int64_t i,
                                                           const __m256 w[4], __m256 acc[QF_ROWS][4]) {
    for (int r = 0; r < rows; r++) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + i]);
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
    }
}

static inline __attribute__((always_inline)) void store_rows(int rows, __m256 acc[QF_ROWS][4],
                                                             float out[QF_ROWS][QF_PANEL]) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out[r] + 8 * j, acc[r][j]);
}

/* Up to QF_ROWS rows x one dense panel (w [k][32]). */
static void dense_tile(int rows, const float *x, int64_t ldx, const float *w, int64_t k,
                       float out[QF_ROWS][QF_PANEL]) {
    __m256 acc[QF_ROWS][4];
    for (int r = 0; r < QF_ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm256_loadu_ps(w + i * QF_PANEL + 8 * j);
        fma_rows(rows, x, ldx, i, wv, acc);
    }
    store_rows(rows, acc, out);
}

/* Up to QF_ROWS rows x one 4-bit panel, 8 columns a vector. */
static void q4_tile(int rows, const float *x, int64_t ldx, const uint8_t *codes, const float *scales,
                    int64_t group, int64_t k, float out[QF_ROWS][QF_PANEL]) {
    __m256 acc[QF_ROWS][4];
    for (int r = 0; r < QF_ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        const float *s = scales + g0 / group * 2 * QF_PANEL;
        for (int64_t i = g0; i < g0 + group; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(codes + i * QF_BYTES));
            const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            __m256 w[4];
            w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            for (int j = 0; j < 4; j++)
                w[j] = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8 * j), w[j], _mm256_loadu_ps(s + QF_PANEL + 8 * j));
            fma_rows(rows, x, ldx, i, w, acc);
        }
    }
    store_rows(rows, acc, out);
}
#else
/* Up to QF_ROWS rows x one dense panel (w [k][32]), one column at a time (fmaf: libm's exact fused
 * multiply-add). */
static void dense_tile(int rows, const float *x, int64_t ldx, const float *w, int64_t k,
                       float out[QF_ROWS][QF_PANEL]) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < QF_PANEL; c++) out[r][c] = 0.0f;
    for (int64_t i = 0; i < k; i++)
        for (int c = 0; c < QF_PANEL; c++)
            for (int r = 0; r < rows; r++) out[r][c] = fmaf(x[r * ldx + i], w[i * QF_PANEL + c], out[r][c]);
}

/* Up to QF_ROWS rows x one 4-bit panel, one column at a time (fmaf: libm's exact fused multiply-add). */
static void q4_tile(int rows, const float *x, int64_t ldx, const uint8_t *codes, const float *scales,
                    int64_t group, int64_t k, float out[QF_ROWS][QF_PANEL]) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < QF_PANEL; c++) out[r][c] = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float *s = scales + i / group * 2 * QF_PANEL;
        for (int c = 0; c < QF_PANEL; c++) {
            const uint8_t b = codes[i * QF_BYTES + c % QF_BYTES];
            const float w = fmaf(s[c], (float)(c < QF_BYTES ? b & 15 : b >> 4), s[QF_PANEL + c]);
            for (int r = 0; r < rows; r++) out[r][c] = fmaf(x[r * ldx + i], w, out[r][c]);
        }
    }
}
#endif

/* The one driver of both kernels: work items are panels, each running all m rows in tiles of QF_ROWS (a row's
 * bits do not depend on m), from dense panels when `dense` is given, else from 4-bit codes and scales. */
static void run_panels(const float *x, int64_t ldx, const float *dense, const uint8_t *codes, const float *scales,
                       int64_t group, const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                       int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t panels = (n + QF_PANEL - 1) / QF_PANEL;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t p = 0; p < panels; p++) {
        float out[QF_ROWS][QF_PANEL];
        for (int64_t r0 = 0; r0 < m; r0 += QF_ROWS) {
            const int rows = m - r0 < QF_ROWS ? (int)(m - r0) : QF_ROWS;
            if (dense)
                dense_tile(rows, x + r0 * ldx, ldx, dense + p * k * QF_PANEL, k, out);
            else
                q4_tile(rows, x + r0 * ldx, ldx, codes + p * k * QF_BYTES, scales + p * (k / group) * 2 * QF_PANEL,
                        group, k, out);
            store_tile(rows, out, p * QF_PANEL, n, bias, residual ? residual + r0 * ldr : 0, ldr, y + r0 * ldy,
                       ldy);
        }
    }
}

/* y [m, n] = x [m, k] @ W.T (+ bias [n]) (+ residual [m, n]), all float32, for W packed by linear_q4_f32_pack
 * with the same group (a multiple of 32 dividing k); row strides ldx, ldr, ldy. Returns 0, or 1 for a group
 * that does not fit. */
int linear_q4_f32(const float *x, int64_t ldx, const uint8_t *codes, const float *scales, int64_t group,
                  const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t m,
                  int64_t n, int64_t k, int num_threads) {
    if (group <= 0 || group % 32 || k % group) return 1;
    run_panels(x, ldx, 0, codes, scales, group, bias, residual, ldr, y, ldy, m, n, k, num_threads);
    return 0;
}

/* y [m, n] = x [m, k] @ W.T (+ bias [n]) (+ residual [m, n]), all float32, for W packed by linear_f32_pack;
 * row strides ldx, ldr, ldy. Returns 0. */
int linear_f32(const float *x, int64_t ldx, const float *panels, const float *bias, const float *residual,
               int64_t ldr, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
    run_panels(x, ldx, panels, 0, 0, 0, bias, residual, ldr, y, ldy, m, n, k, num_threads);
    return 0;
}
