/* bfloat16 linear layers: y = x @ W.T (+ bias) (+ residual), one body per ISA
 * over one packed layout: AVX512-BF16 (VDPBF16PS, bf16_panel.h), AVX2/FMA and
 * portable C (weights widened to float32, f32_panel.h, which states its own
 * rounding and order).
 *
 * Built with paged_attention_cpu.c by kernels/cpu_build.py and called through
 * ctypes from kernels/cpu_linear.py.
 *
 * The weight [N, K] is packed once into panels of 64 output columns,
 * [N_pad / 64][K / 2][64][2] (N padded to a multiple of 64 with zero rows):
 * one 64-byte load gives 16 columns x 2 consecutive k, the operand of
 * VDPBF16PS. Each output element has one float32 accumulator that receives
 * the pairs k = (0, 1), (2, 3), ... in order, starting from zero; bias and
 * residual are added in float32 after the last pair, then the sum is
 * rounded once to bfloat16 (round to nearest even). So a row's bits depend
 * only on that row and the weight, never on how many rows share the call or
 * which thread or tile computes it: batch-invariant for every row count,
 * with no tiling. Threads split the column panels; within a panel (K x 64
 * weights, at most a few hundred KiB, kept in L2) rows go six at a time.
 * (The paragraph's pair order is VDPBF16PS's; the float32 bodies add one
 * product at a time, in input order: the same invariance argument.)
 */

#include <stdint.h>
#include <string.h>

#include "bf16_panel.h"
#include "f32_panel.h"
#include "kernels.h"

/* Which body this build's linear kernels (this file's and linear_q4_cpu.c's)
 * run: 2 AVX512-BF16, 1 AVX2/FMA, 0 portable C (correct, but slower than
 * oneDNN: the caller then keeps its own path). */
int linear_isa(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(F32_PANEL_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Pack w [n, k] (bfloat16, row-major) into out [ceil(n / 64)][k / 2][64][2]; k even. */
void linear_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kp = 0; kp < k / 2; kp++)
            for (int64_t j = 0; j < PANEL; j++) {
                const int64_t row = p * PANEL + j;
                uint16_t *dst = out + ((p * (k / 2) + kp) * PANEL + j) * 2;
                dst[0] = row < n ? w[row * k + 2 * kp] : 0;
                dst[1] = row < n ? w[row * k + 2 * kp + 1] : 0;
            }
}


/* y [m, n] = x [m, k] @ W.T (+ bias [n], float32) (+ residual [m, n]); x and
 * residual bfloat16, y bfloat16 or, when y_f32, float32 (the sums unrounded:
 * logits), with row strides ldx, ldr, ldy (elements); packed from
 * linear_bf16_pack. Returns 0, or 2 when out of memory (the float32 bodies' work buffer). */
int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias,
                const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                int y_f32, int num_threads) {
#if defined(__AVX512BF16__)
    const int64_t panels = (n + PANEL - 1) / PANEL;
    /* Work items: (panel, block of up to M_BLOCK rows), panel-major, so a
     * thread's consecutive items reuse the panel from its cache; small
     * batches still have enough items for every thread. */
    const int64_t m_blocks = (m + M_BLOCK - 1) / M_BLOCK;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t item = 0; item < panels * m_blocks; item++) {
        const int64_t p = item / m_blocks, m0 = item % m_blocks * M_BLOCK;
        const int64_t m1 = m0 + M_BLOCK < m ? m0 + M_BLOCK : m;
        panel_row_block(x, ldx, packed + p * (k / 2) * PANEL * 2, k, p * PANEL, n, bias, residual, ldr, y, ldy, y_f32,
                        m0, m1);
    }
    return 0;
#else
    const int64_t panels = (n + PANEL - 1) / PANEL, m_blocks = (m + M_BLOCK - 1) / M_BLOCK;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)") {
        float *xf = f32_scratch((size_t)(M_BLOCK * k));
        if (!xf) {
            _Pragma("omp atomic write") failed = 2;
        }
        _Pragma("omp for schedule(static)") for (int64_t item = 0; item < panels * m_blocks; item++) {
            if (!xf) continue;
            const int64_t p = item / m_blocks, m0 = item % m_blocks * M_BLOCK;
            const int64_t m1 = m0 + M_BLOCK < m ? m0 + M_BLOCK : m;
            f32_panel_row_block(x, ldx, packed + p * (k / 2) * PANEL * 2, k, p * PANEL, n, bias, residual, ldr, y,
                                ldy, y_f32, m0, m1, xf);
        }
    }
    return failed;
#endif
}
