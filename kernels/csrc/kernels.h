/* Every function and struct the kernel library exports, declared once: each
 * .c file of this folder includes this header (so the compiler checks each
 * definition against its declaration), and kernels/cpu_build.py reads it to
 * type the ctypes calls (kernels/c_header.py: each prototype's pointer,
 * int64_t, int and float arguments; each struct's fields). Each function is
 * defined, and documented, in its own file. Keep to that subset of C here:
 * one declaration per statement, no function pointers, no nested structs. */
#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H

#include <stdint.h>

/* The most rows of a decode step run in one parallel region
 * (linear_q4_team, decoder_cpu.c); linear_fp8 dequantizes in registers up
 * to this many rows, into a bfloat16 scratch panel for more. */
#define LINEAR_Q4_DIRECT_ROWS 3
/* On a build without integer copies (the portable one; QUANT_COPY_EVERY_ROW
 * below), calls of up to this many rows read a projection's 4-bit copy
 * rather than its bfloat16 panels: the same bits, fewer bytes. (Measured when
 * the AVX-512 build still dequantized its copies: loadtests/bench/kernels_cpu.py,
 * 4-bit/bf16 time 0.92x at 1 row, 0.94-0.95x at 2, 0.99-1.03x at 3.) */
#define QUANT_COPY_MAX_ROWS 2
/* Every x86 build with AVX2/FMA/F16C (the AVX2 build and the AVX-512 one)
 * runs the quantized copies (4-bit, 8-bit int) with integer dot products
 * (quant_int.h, whose top states the arithmetic): other bits than the
 * bfloat16 panels, the same on both ISAs, so every call reads a weight's
 * copy when it has one, whatever its row count (else a row's bits would
 * depend on the batch), and the 8-bit kernel takes any row count. Builds
 * with AVX512-VNNI and BW run it 16 columns a vector (VPDPBUSD:
 * quant_int512.h), the others 8 (quant_int.h); where the CPU has AMX-INT8
 * too, calls of 16 rows or more take their block sums from tile multiplies
 * (quant_amx.h, the same bits). linear_quant_int() says which (kernels/
 * cpu_linear.py asks it, nothing else decides). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_COPY_EVERY_ROW 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QUANT_INT_VNNI512 1
#endif
#endif

/* paged_attention_cpu.c */
int paged_attention_bf16(const void *query, int64_t ldq, const void *key_cache, const void *value_cache, void *out,
                         const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                         const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads);
int paged_attention_f32(const void *query, int64_t ldq, const void *key_cache, const void *value_cache, void *out,
                        const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                        const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int num_threads);
int paged_attention_bf16_team(const void *query, int64_t ldq, const void *key_cache, const void *value_cache,
                              void *out, const int32_t *block_tables, int64_t block_table_stride,
                              const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, float *shared, int64_t ld);

/* linear_cpu.c */
int linear_isa(void);
void linear_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out);
int linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, const uint16_t *residual,
                int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int y_f32, int num_threads);

/* linear_q4_cpu.c */
int linear_quant_int(void);
int linear_quant_amx(void);
void linear_q4_pack(const uint8_t *codes, int64_t n, int64_t k, uint8_t *codes_out);
int linear_q4(const uint16_t *x, int64_t ldx, const uint8_t *codes, const uint16_t *scales, int64_t group,
              const int32_t *perm, const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy,
              int64_t m, int64_t n, int64_t k, int y_f32, int num_threads);
int linear_q4_team(const uint16_t *x, int64_t ldx, const uint8_t *codes, const uint16_t *scales, int64_t group,
                   const float *bias, const uint16_t *residual, int64_t ldr, uint16_t *y, int64_t ldy, int64_t m,
                   int64_t n, int64_t k);
void linear_q8_pack(const int8_t *codes, const float *d, int64_t group, int64_t n, int64_t k, int8_t *codes_out,
                    float *scales_out);
int linear_q8(const uint16_t *x, int64_t ldx, const int8_t *codes, const float *scales, int64_t group,
              const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
              int64_t k, int y_f32, int num_threads);
void linear_fp8_pack(const uint8_t *codes, const float *d, int64_t group, int64_t n, int64_t k, uint8_t *codes_out,
                     float *scales_out);
int linear_fp8(const uint16_t *x, int64_t ldx, const uint8_t *codes, const float *scales, int64_t group,
               const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
               int64_t k, int y_f32, int num_threads);

/* linear_f32_cpu.c */
void linear_f32_pack(const float *w, int64_t n, int64_t k, float *out);
int linear_f32(const float *x, int64_t ldx, const float *panels, const float *bias, const float *residual,
               int64_t ldr, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads);
void linear_q4_f32_pack(const uint8_t *codes, const float *d, const float *m, int64_t n, int64_t k, int64_t group,
                        uint8_t *codes_out, float *scales_out);
int linear_q4_f32(const float *x, int64_t ldx, const uint8_t *codes, const float *scales, int64_t group,
                  const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t m,
                  int64_t n, int64_t k, int num_threads);

/* linear_w8a8_cpu.c */
void linear_w8a8_pack(const int8_t *codes, int64_t n, int64_t k, int8_t *codes_out, int32_t *col_sums);
int linear_w8a8(const uint16_t *x, int64_t ldx, const int8_t *codes, const int32_t *col_sums, const float *scales,
                const float *bias, const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int64_t n,
                int64_t k, int y_f32, int num_threads);

/* norm_act_cpu.c */
int rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *weight, uint16_t *y, int64_t ldy, int64_t rows,
                  int64_t n, float eps, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, int64_t ld, uint16_t *y, int64_t ldy, int64_t rows, int64_t inter,
                   int num_threads);

/* decoder_cpu.c */

/* One layer's weights: RMSNorm weights [hidden] bfloat16; the projections
 * (qkv [q + 2 kv, hidden], o [hidden, q], gate_up [2 inter, hidden], down
 * [hidden, inter]) as bfloat16 panels (linear_bf16_pack), 4-bit panels
 * (linear_q4_pack: codes, scales, group and input order), or both, or as
 * FP8 panels, or as int8 panels (W8A16 or W8A8); qkv_bias float32 [q + 2 kv]
 * or NULL; the layer's key and value caches. */
typedef struct {
    const uint16_t *input_norm, *post_norm;
    const uint16_t *bf16[4];      /* qkv, o, gate_up, down: bfloat16 panels or NULL */
    const uint8_t *q4_codes[4];   /* 4-bit panels or NULL */
    const uint16_t *q4_scales[4]; /* float16, one (d, m) per q4_group[i] inputs */
    int64_t q4_group[4];
    const int32_t *q4_perm[4];    /* the codes' input order (linear_q4's perm) or NULL */
    const uint8_t *fp8_codes[4];  /* FP8 panels (linear_fp8_pack) or NULL */
    const float *fp8_scales[4];
    int64_t fp8_group[4];
    const int8_t *i8_codes[4];    /* int8 panels (linear_q8_pack, or with i8_sums linear_w8a8_pack) or NULL */
    const float *i8_scales[4];
    const int32_t *i8_sums[4];    /* W8A8's column sums (linear_w8a8), NULL for W8A16 (linear_q8) */
    int64_t i8_group[4];
    const float *qkv_bias;
    uint16_t *key_cache, *value_cache;
} decoder_layer;

/* The model's shape. */
typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, max_positions;
    float rms_norm_eps, scale;
} decoder_shape;

int rope_cache_bf16(uint16_t *qkv, int64_t ld, int64_t t, const int64_t *positions, const float *cos_tab,
                    const float *sin_tab, int64_t max_positions, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, const int64_t *slot_mapping, uint16_t *key_cache, uint16_t *value_cache,
                    int num_threads);
int decoder_forward_bf16(const decoder_shape *shape, const decoder_layer *layers, const uint16_t *final_norm,
                         uint16_t *x, uint16_t *out, int64_t t, const int64_t *positions, const float *cos_tab,
                         const float *sin_tab, const int64_t *slot_mapping, const int32_t *block_tables,
                         int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                         int64_t num_seqs, int num_threads);

/* decode_steps_cpu.c */
int decode_greedy_bf16(const decoder_shape *shape, const decoder_layer *layers, const uint16_t *final_norm,
                       const uint16_t *embed, const int8_t *head_q8_codes, const float *head_q8_scales,
                       int64_t head_q8_group, const uint16_t *head_panels, int64_t vocab, int64_t *tokens,
                       int64_t rows, int64_t steps, const int64_t *start_positions, const float *cos_tab,
                       const float *sin_tab, const int32_t *block_tables, int64_t bt_stride, int num_threads);

#endif
