/* The exported kernels of this folder that decoder_cpu.c composes (each is
 * defined, and documented, in its own file). */
#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H

#include <stdint.h>

/* linear_q4 dequantizes in registers up to this many rows per work item,
 * into a bfloat16 scratch panel for more. */
#define LINEAR_Q4_DIRECT_ROWS 3
/* Calls of up to this many rows read a projection's 4-bit copy rather than
 * its bfloat16 panels (loadtests/bench/kernels_cpu.py, a 30-layer pass of
 * SmolLM2's shapes called from Python, 4-bit/bf16 time: 0.92x at 1 row,
 * 0.94-0.95x at 2, 0.99-1.03x at 3; in the one-call stack a single stream
 * runs 1.28x faster with the copies). */
#define QUANT_COPY_MAX_ROWS 2
/* The AVX2/FMA/F16C build (no AVX512-BF16) runs the quantized copies with
 * integer dot products (quant_int.h): other bits than the bfloat16 panels,
 * so there every call reads a weight's copy when it has one, whatever its
 * row count (else a row's bits would depend on the batch), and the 8-bit
 * kernel takes any row count. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#define QUANT_COPY_EVERY_ROW 1
#endif

int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, const uint16_t *residual,
                int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int y_f32, int num_threads);
int linear_q4(const uint16_t *x, int64_t ldx, const uint8_t *codes, const uint16_t *scales, const float *bias,
              const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int y_f32,
              int num_threads);
int rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *weight, uint16_t *y, int64_t ldy, int64_t rows,
                  int64_t n, float eps, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, int64_t ld, uint16_t *y, int64_t ldy, int64_t rows, int64_t inter,
                   int num_threads);
int paged_attention_bf16(const void *query, int64_t ldq, const void *key_cache, const void *value_cache, void *out,
                         const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                         const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads);

#endif
