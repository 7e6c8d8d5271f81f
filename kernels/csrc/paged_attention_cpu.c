/* Paged attention on the CPU, reading keys and values in place from the cache.
 *
 * Built at run time by kernels/cpu_attention.py (gcc -O3 -march=native
 * -fopenmp) and called through ctypes; semantics and shapes are those of
 * kernels/torch_attention.py:paged_attention:
 *
 *   query, out:   [num_tokens, num_heads, head_dim]
 *   key_cache,
 *   value_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables: [num_seqs, block_table_stride] int32
 *   seq_lens:     [num_seqs] int32, query_start_loc: [num_seqs + 1] int32
 *
 * Query row j of sequence s sits at position seq_len - q_len + j and attends
 * to key positions 0..that position (causal); query head h reads KV head
 * h / (num_heads / num_kv_heads) (grouped-query attention).
 *
 * One work item is (query row, KV head): the group's query heads share each
 * key and value load. Scores are float32 dot products (16 lanes summed in a
 * fixed tree), the softmax is float32 with a polynomial exp (below), and
 * probabilities @ values accumulate in float32 over positions in order; the
 * output is rounded once to the cache's dtype. Every item runs this same
 * sequence of operations whatever the other rows of the step are, which
 * thread takes it, or whether the row is a prompt or a generated position:
 * the output bits depend only on the query, its context and the build.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <omp.h>

#include "common.h"
#include "kernels.h"

/* Element i of a cache-dtype array as float32 (BF16: bfloat16, else float32). */
#define LOAD(p, i) (BF16 ? bf16_to_f32(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])

/* Scaled dot products of the group's query heads with one key (the portable
 * path): scores[h * ctx] for h < group. qf: [group, head_dim] float32; k:
 * head_dim cache elements. */
static inline __attribute__((always_inline)) void qk_scores(const int BF16, const float *qf, const void *k,
                                                            int64_t group, int64_t head_dim, float scale,
                                                            float *scores, int64_t ctx) {
    float kf[head_dim];
    for (int64_t d = 0; d < head_dim; d++) kf[d] = LOAD(k, d);
    for (int64_t h = 0; h < group; h++) {
        float lanes[LANES] = {0};
        const float *qh = qf + h * head_dim;
        for (int64_t d = 0; d < head_dim; d += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += qh[d + l] * kf[d + l];
        scores[h * ctx] = lane_sum(lanes) * scale;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* qk_scores for n <= 8 consecutive positions of a bfloat16 cache (rows slot_stride elements apart), their
 * scores of head h at scores[h * ctx + o]: the same arithmetic (per position and head, 16 lanes of FMAs in
 * the order of d, lane l summing d = l mod 16, then lane_sum's tree: the two halves, then lanes l and l + 4,
 * l and l + 2, 0 and 1; times scale) on 8-lane vectors, with the last three levels of the tree done for 8
 * positions at once by a transpose instead of one position at a time in scalar code. head_dim % 16 == 0. */
static inline __attribute__((always_inline)) void qk8_bf16_body(const int HD16, const float *qf, const uint16_t *k,
                                                                int64_t slot_stride, int64_t n, int64_t group,
                                                                int64_t head_dim, float scale, float *scores,
                                                                int64_t ctx) {
    head_dim = HD16 ? 16 * HD16 : head_dim;  /* a literal where it is 64 or 128: the loops below unroll */
    float kf[8 * head_dim];
    for (int64_t o = 0; o < n; o++)
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(kf + o * head_dim + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(k + o * slot_stride + d))), 16)));
    for (int64_t h = 0; h < group; h++) {
        const float *qh = qf + h * head_dim;
        __m128 u[8];
        for (int64_t o = 0; o < 8; o++) {
            if (o >= n) {
                u[o] = _mm_setzero_ps();
                continue;
            }
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16) {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(kf + o * head_dim + d), a);
                b = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8), _mm256_loadu_ps(kf + o * head_dim + d + 8), b);
            }
            const __m256 t = _mm256_add_ps(a, b); /* lane_sum's first level: lanes l and l + 8 */
            u[o] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)); /* l and l + 4 */
        }
        __m256 U[4];
        for (int j = 0; j < 4; j++) U[j] = _mm256_insertf128_ps(_mm256_castps128_ps256(u[j]), u[j + 4], 1);
        const __m256 t0 = _mm256_unpacklo_ps(U[0], U[1]), t1 = _mm256_unpackhi_ps(U[0], U[1]);
        const __m256 t2 = _mm256_unpacklo_ps(U[2], U[3]), t3 = _mm256_unpackhi_ps(U[2], U[3]);
        const __m256 c0 = _mm256_shuffle_ps(t0, t2, 0x44), c1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 c2 = _mm256_shuffle_ps(t1, t3, 0x44), c3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        /* lane j (position j for j < 4, j + 4 ... in the high half): (u0 + u2) + (u1 + u3) */
        const __m256 r = _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(c0, c2), _mm256_add_ps(c1, c3)),
                                       _mm256_set1_ps(scale));
        float out[8];
        _mm256_storeu_ps(out, r);
        /* out[0..3]: positions 0..3, out[4..7]: positions 4..7 */
        for (int64_t o = 0; o < n; o++) scores[h * ctx + o] = out[o];
    }
}

/* qk8_bf16_body with head_dim 64 or 128 a literal (each position's chains of FMAs unrolled, so the 8 positions'
 * run side by side; the same operations in the same order, so the same bits), else read at run time. */
static inline void qk8_bf16(const float *qf, const uint16_t *k, int64_t slot_stride, int64_t n, int64_t group,
                            int64_t head_dim, float scale, float *scores, int64_t ctx) {
    if (head_dim == 64)
        qk8_bf16_body(4, qf, k, slot_stride, n, group, head_dim, scale, scores, ctx);
    else if (head_dim == 128)
        qk8_bf16_body(8, qf, k, slot_stride, n, group, head_dim, scale, scores, ctx);
    else
        qk8_bf16_body(0, qf, k, slot_stride, n, group, head_dim, scale, scores, ctx);
}
#endif

#if defined(__AVX512BF16__)
/* v[o] holds 16 partial sums of position o's dot product; returns the 16
 * totals, lane o = position o. A fixed transpose-and-add tree: every
 * position's 16 partial sums are added in the same order. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int k = 0; k < 8; k++)
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
        x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int k = 0; k < 2; k++)
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

/* Prefetch n rows of `bytes` bytes, slot_stride elements apart, into L1. */
static inline void prefetch_rows(const uint16_t *first, int64_t slot_stride, int64_t n, int64_t bytes) {
    for (int64_t o = 0; o < n; o++)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)(first + o * slot_stride) + b, _MM_HINT_T0);
}

/* qk16_bf16's body for HD32 = head_dim / 32 chunks (a literal where it is 2 or 4: the loops unroll and the 16
 * positions' sums stay in registers; 0: head_dim read at run time, the sums on the stack). Each position's
 * sum is VDPBF16PS over the chunks in order from zero, whatever HD32 is: the same bits. */
static inline __attribute__((always_inline)) void qk16_bf16_body(const int HD32, const uint16_t *qb, const uint16_t *k,
                                                                 int64_t slot_stride, int64_t n, int64_t group,
                                                                 int64_t head_dim, float scale, float *scores,
                                                                 int64_t ctx) {
    const int64_t chunks = HD32 ? HD32 : head_dim / 32;
    for (int64_t h = 0; h < group; h++) {
        __m512 acc[16];
        for (int64_t o = 0; o < 16; o++) {
            acc[o] = _mm512_setzero_ps();
            if (o < n)
                for (int64_t d = 0; d < chunks; d++)
                    acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)_mm512_loadu_si512(qb + h * head_dim + 32 * d),
                                              (__m512bh)_mm512_loadu_si512(k + o * slot_stride + 32 * d));
        }
        __m512 r = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + h * ctx, tail_mask(n), r);
    }
}

/* Scores of up to 16 consecutive slots (n of them, slot_stride elements
 * apart) for the group's bfloat16 query heads qb [group, head_dim]:
 * scores[h * ctx + o] for o < n. A head_dim of 64 or 128 gets its own
 * unrolled body (with the sums in memory, 0.43 of a 600-position verify
 * step's attention time went here; Intel host, single thread). */
static inline void qk16_bf16(const uint16_t *qb, const uint16_t *k, int64_t slot_stride, int64_t n, int64_t group,
                             int64_t head_dim, float scale, float *scores, int64_t ctx) {
    if (head_dim == 64)
        qk16_bf16_body(2, qb, k, slot_stride, n, group, head_dim, scale, scores, ctx);
    else if (head_dim == 128)
        qk16_bf16_body(4, qb, k, slot_stride, n, group, head_dim, scale, scores, ctx);
    else
        qk16_bf16_body(0, qb, k, slot_stride, n, group, head_dim, scale, scores, ctx);
}

/* acc[h * head_dim + d] = sum over positions i < ctx, in order, of
 * p[h * ctx + i] * v_i[d] (float32 FMAs), for G heads (a literal, <= 8) and
 * NC chunks of 32 output columns per pass over the positions (a literal: all
 * G * NC * 2 accumulators in registers, so the positions' chains of FMAs run
 * side by side and each value row is loaded once per pass). A row's 32
 * bfloat16 values are widened as even and odd columns (a shift and a mask,
 * no lane crossing) and put back in order when stored; each output column
 * gets the same FMAs in the same order whatever G and NC are. */
static inline __attribute__((always_inline)) void pv_bf16_tile(
    const int G, const int NC, const float *p, const uint16_t *value_cache, const int32_t *table, int64_t g,
    int64_t ctx, int64_t d0, int64_t d1, int64_t head_dim, int64_t block_size, int64_t slot_stride, float *acc) {
    const __m512i odd_mask = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t d = d0; d < d1; d += 32 * NC) {
        __m512 ev[8][4], od[8][4]; /* head h, chunk c: even and odd columns */
        for (int h = 0; h < G; h++)
            for (int c = 0; c < NC; c++) ev[h][c] = od[h][c] = _mm512_setzero_ps();
        for (int64_t i0 = 0; i0 < ctx; i0 += block_size) {
            const uint16_t *v = value_cache + ((int64_t)table[i0 / block_size] * block_size) * slot_stride + g * head_dim + d;
            const int64_t n = ctx - i0 < block_size ? ctx - i0 : block_size;
            if (i0 + block_size < ctx)  /* the next block is elsewhere in memory: ask for it while this one runs */
                prefetch_rows(value_cache + ((int64_t)table[i0 / block_size + 1] * block_size) * slot_stride + g * head_dim + d,
                              slot_stride, ctx - i0 - block_size < block_size ? ctx - i0 - block_size : block_size, 64 * NC);
            for (int64_t o = 0; o < n; o++) {
                __m512 ve[4], vo[4];
                for (int c = 0; c < NC; c++) {
                    const __m512i raw = _mm512_loadu_si512(v + o * slot_stride + 32 * c);
                    ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                    vo[c] = _mm512_castsi512_ps(_mm512_and_si512(raw, odd_mask));
                }
                for (int h = 0; h < G; h++) {
                    const __m512 w = _mm512_set1_ps(p[h * ctx + i0 + o]);
                    for (int c = 0; c < NC; c++) {
                        ev[h][c] = _mm512_fmadd_ps(w, ve[c], ev[h][c]);
                        od[h][c] = _mm512_fmadd_ps(w, vo[c], od[h][c]);
                    }
                }
            }
        }
        for (int h = 0; h < G; h++)
            for (int c = 0; c < NC; c++) {
                float *a = acc + h * head_dim + d + 32 * c;
                _mm512_storeu_ps(a, _mm512_permutex2var_ps(ev[h][c], lo_idx, od[h][c]));
                _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(ev[h][c], hi_idx, od[h][c]));
            }
    }
}

/* pv_bf16_tile for a group of 1..8 heads over output columns [d0, d1) (multiples of 32; acc's rows still
 * head_dim apart): two 32-column chunks a pass where the range allows and the accumulators fit (group <= 4),
 * else one. */
static inline void pv_bf16(const float *p, const uint16_t *value_cache, const int32_t *table, int64_t g,
                           int64_t ctx, int64_t group, int64_t d0, int64_t d1, int64_t head_dim, int64_t block_size,
                           int64_t slot_stride, float *acc) {
#define PV(G, NC) pv_bf16_tile(G, NC, p, value_cache, table, g, ctx, d0, d1, head_dim, block_size, slot_stride, acc)
    if ((d1 - d0) % 64 == 0 && group <= 4) {
        switch (group) {
        case 1: PV(1, 2); return;
        case 2: PV(2, 2); return;
        case 3: PV(3, 2); return;
        default: PV(4, 2); return;
        }
    }
    switch (group) {
    case 1: PV(1, 1); return;
    case 2: PV(2, 1); return;
    case 3: PV(3, 1); return;
    case 4: PV(4, 1); return;
    case 5: PV(5, 1); return;
    case 6: PV(6, 1); return;
    case 7: PV(7, 1); return;
    default: PV(8, 1); return;
    }
#undef PV
}
#endif

/* sc[0..n) <- softmax(sc[0..n)) in float32: max, exp of the differences
 * (exp_neg), their sum in a fixed lane order, one multiply by its inverse. */
static inline void softmax(float *sc, int64_t n) {
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-__builtin_inff());
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = tail_mask(n - i);
        vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_maskz_loadu_ps(mask, sc + i));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = tail_mask(n - i);
        const __m512 e = _mm512_maskz_mov_ps(mask, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sc + i), m)));
        _mm512_mask_storeu_ps(sc + i, mask, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = tail_mask(n - i);
        _mm512_mask_storeu_ps(sc + i, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sc + i), inv));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* the portable loop's operations on 8 lanes: exp_neg8 is exp_neg's FMAs lane by lane, and lanes[i % 16]
     * is the two vectors' lanes (a tail's missing positions add nothing), so the same bits */
    __m256 vmax = _mm256_set1_ps(sc[0]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + i));
    float m = sc[0], lanes[LANES];
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; i < n; i++) m = sc[i] > m ? sc[i] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        const __m256 a = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), vm));
        const __m256 b = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sc + i + 8), vm));
        _mm256_storeu_ps(sc + i, a), _mm256_storeu_ps(sc + i + 8, b);
        lo = _mm256_add_ps(lo, a), hi = _mm256_add_ps(hi, b);
    }
    _mm256_storeu_ps(lanes, lo), _mm256_storeu_ps(lanes + 8, hi);
    for (; i < n; i++) {
        sc[i] = exp_neg(sc[i] - m);
        lanes[i % LANES] += sc[i];
    }
    const float inv = 1.0f / lane_sum(lanes);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(sc + i, _mm256_mul_ps(_mm256_loadu_ps(sc + i), vinv));
    for (; i < n; i++) sc[i] *= inv;
#else
    float m = sc[0];
    for (int64_t i = 1; i < n; i++) m = sc[i] > m ? sc[i] : m;
    float lanes[LANES] = {0};
    for (int64_t i = 0; i < n; i++) {
        sc[i] = exp_neg(sc[i] - m);
        lanes[i % LANES] += sc[i];
    }
    const float inv = 1.0f / lane_sum(lanes);
    for (int64_t i = 0; i < n; i++) sc[i] *= inv;
#endif
}

/* acc[h * head_dim + d] = sum over positions i < ctx, in order, of
 * p[h * ctx + i] * v_i[d] (float32) for output columns d in [d0, d1), any
 * dtype and shape. */
static inline __attribute__((always_inline)) void pv_generic(
    const int BF16, const float *p, const void *value_cache, const int32_t *table, int64_t g, int64_t ctx,
    int64_t group, int64_t d0, int64_t d1, int64_t head_dim, int64_t block_size, int64_t slot_stride, float *acc) {
    const int64_t elem = BF16 ? 2 : 4;
    for (int64_t h = 0; h < group; h++) memset(acc + h * head_dim + d0, 0, sizeof(float) * (size_t)(d1 - d0));
    float vf[head_dim];
    for (int64_t i0 = 0; i0 < ctx; i0 += block_size) {
        const char *v = (const char *)value_cache + (((int64_t)table[i0 / block_size] * block_size) * slot_stride + g * head_dim) * elem;
        const int64_t n = ctx - i0 < block_size ? ctx - i0 : block_size;
        for (int64_t o = 0; o < n; o++) {
            const void *vo = v + o * slot_stride * elem;
            for (int64_t d = d0; d < d1; d++) vf[d] = LOAD(vo, d);
            for (int64_t h = 0; h < group; h++) {
                const float w = p[h * ctx + i0 + o];
                float *a = acc + h * head_dim;
                for (int64_t d = d0; d < d1; d++) a[d] += w * vf[d];
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* pv_generic for a bfloat16 cache with (d1 - d0) % 8 == 0: the same sums (per head and column, over the
 * positions in order, each an FMA from 0) with the accumulators of up to 3 heads x 32 columns held in
 * registers across the positions instead of loaded and stored for each. */
static inline void pv8_bf16(const float *p, const uint16_t *value_cache, const int32_t *table, int64_t g,
                            int64_t ctx, int64_t group, int64_t d0, int64_t d1, int64_t head_dim, int64_t block_size,
                            int64_t slot_stride, float *acc) {
    for (int64_t c0 = d0; c0 < d1; c0 += 32) {
        const int nv = (int)((d1 - c0 < 32 ? d1 - c0 : 32) / 8);
        for (int64_t h0 = 0; h0 < group; h0 += 3) {
            const int nh = (int)(group - h0 < 3 ? group - h0 : 3);
            __m256 a[3][4];
            for (int h = 0; h < 3; h++)
                for (int v = 0; v < 4; v++) a[h][v] = _mm256_setzero_ps();
            for (int64_t i0 = 0; i0 < ctx; i0 += block_size) {
                const uint16_t *vb = value_cache + ((int64_t)table[i0 / block_size] * block_size) * slot_stride
                                     + g * head_dim + c0;
                const int64_t n = ctx - i0 < block_size ? ctx - i0 : block_size;
                for (int64_t o = 0; o < n; o++) {
                    __m256 vf[4];
                    for (int v = 0; v < nv; v++)
                        vf[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                            _mm_loadu_si128((const __m128i *)(vb + o * slot_stride + 8 * v))), 16));
                    for (int h = 0; h < nh; h++) {
                        const __m256 w = _mm256_set1_ps(p[(h0 + h) * ctx + i0 + o]);
                        for (int v = 0; v < nv; v++) a[h][v] = _mm256_fmadd_ps(w, vf[v], a[h][v]);
                    }
                }
            }
            for (int h = 0; h < nh; h++)
                for (int v = 0; v < nv; v++) _mm256_storeu_ps(acc + (h0 + h) * head_dim + c0 + 8 * v, a[h][v]);
        }
    }
}
#endif

/* Ask for columns [d0, d1) of KV head g's rows at positions [i0, i1) (i0 a
 * multiple of block_size) of one cache (keys or values), ahead of their use,
 * into L2 (x86: PREFETCHT1). A decode row reads
 * its context once per layer, in blocks scattered over the pool, from DRAM
 * (the step's weights passed through the caches since the last layer):
 * waiting on each block in turn held a 64-sequence decode batch to ~10 GB/s.
 * Asking for all the keys when the row starts and for all the values once
 * its scores are done took a 30-layer sweep of that batch to ~0.65x the time
 * (the two builds alternated; the sweep is in loadtests/bench/kernels_cpu.py:
 * keys and values together at the start 0.70-0.78x, then the values after
 * the scores 0.86-0.88x of that; keys into L1 instead 1.24-1.38x, worse).
 * Only decode rows ask: a prompt's rows share their context, which is in
 * cache after the first. */
static inline __attribute__((always_inline)) void prefetch_part(const char *cache, const int32_t *table, int64_t g,
                                                                int64_t i0, int64_t i1, int64_t d0, int64_t d1,
                                                                int64_t head_dim, int64_t block_size,
                                                                int64_t slot_stride, int64_t elem) {
    for (; i0 < i1; i0 += block_size) {
        const int64_t base = (((int64_t)table[i0 / block_size] * block_size) * slot_stride + g * head_dim + d0) * elem;
        const int64_t n = i1 - i0 < block_size ? i1 - i0 : block_size;
        for (int64_t o = 0; o < n; o++)
            for (int64_t b = 0; b < (d1 - d0) * elem; b += 64)
                __builtin_prefetch(cache + base + o * slot_stride * elem + b, 0, 2);
    }
}

/* Which bodies a call's attention runs (one rule for attend_item and attention_decode.h): the scores by
 * VDPBF16PS on the raw bfloat16 query (qk16_bf16), and the weighted values in registers (pv_bf16; group: the
 * whole group's size, a split item's too); else the portable bodies, qk_block and pv_columns. */
static inline int qk_fast(const int BF16, int64_t head_dim, int64_t block_size) {
#if defined(__AVX512BF16__)
    return BF16 && head_dim % 32 == 0 && block_size % 16 == 0;
#else
    (void)BF16, (void)head_dim, (void)block_size;
    return 0;
#endif
}

static inline int pv_fast(const int BF16, int64_t head_dim, int64_t group) {
#if defined(__AVX512BF16__)
    return BF16 && head_dim % 32 == 0 && group <= 8;
#else
    (void)BF16, (void)head_dim, (void)group;
    return 0;
#endif
}

/* The portable path's scores (qk_fast false) of the n positions of one cache block at k (rows slot_stride
 * elements apart) for the group's query heads qf [group, head_dim] float32, into scores[h * ld + o]: 8
 * positions at a time on 8-lane vectors for a bfloat16 cache where the build has AVX2/FMA (qk8_bf16), else
 * one at a time (qk_scores); the same bits either way. */
static inline __attribute__((always_inline)) void qk_block(const int BF16, const float *qf, const char *k,
                                                           int64_t slot_stride, int64_t n, int64_t group,
                                                           int64_t head_dim, float scale, float *scores, int64_t ld) {
    const int64_t elem = BF16 ? 2 : 4;
#if defined(__AVX2__) && defined(__FMA__)
    if (BF16 && head_dim % 16 == 0) {
        for (int64_t o = 0; o < n; o += 8)
            qk8_bf16(qf, (const uint16_t *)(k + o * slot_stride * elem), slot_stride, n - o < 8 ? n - o : 8, group,
                     head_dim, scale, scores + o, ld);
        return;
    }
#endif
    for (int64_t o = 0; o < n; o++)
        qk_scores(BF16, qf, k + o * slot_stride * elem, group, head_dim, scale, scores + o, ld);
}

/* acc[h * head_dim + d] for output columns [d0, d1): the weighted values by the build's body (pv_bf16 where
 * `fast`, pv_fast's answer; pv8_bf16 for a bfloat16 cache and whole 8-column vectors where the build has
 * AVX2/FMA; else pv_generic); the same bits either way. */
static inline __attribute__((always_inline)) void pv_columns(
    const int BF16, int fast, const float *p, const void *value_cache, const int32_t *table, int64_t g, int64_t ctx,
    int64_t group, int64_t d0, int64_t d1, int64_t head_dim, int64_t block_size, int64_t slot_stride, float *acc) {
#if defined(__AVX512BF16__)
    if (fast) {
        pv_bf16(p, (const uint16_t *)value_cache, table, g, ctx, group, d0, d1, head_dim, block_size, slot_stride,
                acc);
        return;
    }
#else
    (void)fast;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (BF16 && (d1 - d0) % 8 == 0) {
        pv8_bf16(p, (const uint16_t *)value_cache, table, g, ctx, group, d0, d1, head_dim, block_size, slot_stride,
                 acc);
        return;
    }
#endif
    pv_generic(BF16, p, value_cache, table, g, ctx, group, d0, d1, head_dim, block_size, slot_stride, acc);
}

/* Everything one work item (query row t, query heads first_head ..
 * first_head + group - 1, all of KV head g) computes; BF16 is a literal at
 * each call site, so each dtype gets its own specialised copy. Every head's
 * arithmetic is its own (its scores, softmax and weighted values), so a
 * head's bits do not depend on which other heads share its item. */
static inline __attribute__((always_inline)) void attend_item(
    const int BF16, const void *query, int64_t ldq, const void *key_cache, const void *value_cache, void *out,
    const int32_t *table, int64_t t, int64_t g, int64_t first_head, int64_t ctx, int decode, int64_t num_heads,
    int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale, float *scores,
    float *qf, float *acc) {
    const int64_t q0 = t * ldq + first_head * head_dim;            /* the item's first query head */
    const int64_t o0 = (t * num_heads + first_head) * head_dim;    /* and its output row */
    const int64_t slot_stride = num_kv_heads * head_dim, elem = BF16 ? 2 : 4;
    const int fast_qk = qk_fast(BF16, head_dim, block_size);
    if (decode)
        prefetch_part(key_cache, table, g, 0, ctx, 0, head_dim, head_dim, block_size, slot_stride, elem);
    if (!fast_qk) /* the portable path reads the query in float32 */
        for (int64_t j = 0; j < group * head_dim; j++) qf[j] = LOAD(query, q0 + j);
    for (int64_t i0 = 0; i0 < ctx; i0 += block_size) {  /* one cache block at a time */
        const char *k = (const char *)key_cache + (((int64_t)table[i0 / block_size] * block_size) * slot_stride + g * head_dim) * elem;
        const int64_t n = ctx - i0 < block_size ? ctx - i0 : block_size;
#if defined(__AVX512BF16__)
        if (fast_qk) {
            if (i0 + block_size < ctx)  /* the next block is elsewhere in memory: ask for it while this one runs */
                prefetch_rows((const uint16_t *)key_cache + ((int64_t)table[i0 / block_size + 1] * block_size) * slot_stride + g * head_dim,
                              slot_stride, ctx - i0 - block_size < block_size ? ctx - i0 - block_size : block_size, head_dim * 2);
            for (int64_t o = 0; o < n; o += 16)
                qk16_bf16((const uint16_t *)query + q0, (const uint16_t *)(k + o * slot_stride * elem), slot_stride,
                          n - o < 16 ? n - o : 16, group, head_dim, scale, scores + i0 + o, ctx);
            continue;
        }
#endif
        qk_block(BF16, qf, k, slot_stride, n, group, head_dim, scale, scores + i0, ctx);
    }
    if (decode)
        prefetch_part(value_cache, table, g, 0, ctx, 0, head_dim, head_dim, block_size, slot_stride, elem);
    for (int64_t h = 0; h < group; h++) softmax(scores + h * ctx, ctx);
    pv_columns(BF16, pv_fast(BF16, head_dim, num_heads / num_kv_heads), scores, value_cache, table, g, ctx, group,
               0, head_dim, head_dim, block_size, slot_stride, acc);
    for (int64_t j = 0; j < group * head_dim; j++) {
        if (BF16)
            ((uint16_t *)out)[o0 + j] = f32_to_bf16(acc[j]);
        else
            ((float *)out)[o0 + j] = acc[j];
    }
}

/* Work item `it` of a call whose rows belong to sequences row_seq[t] (NULL: row t is sequence t, one
 * decode row each): a work item is (query row, KV head), its group's query heads sharing each key and value
 * load; with `split` > 1 each of its query heads is an item of its own (see split_items). scores, qf, acc:
 * this thread's scratch (attention_scratch floats). */
static inline __attribute__((always_inline)) void run_item(
    const int BF16, int64_t it, const int32_t *row_seq, const void *query, int64_t ldq, const void *key_cache,
    const void *value_cache, void *out, const int32_t *block_tables, int64_t block_table_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_heads, int64_t num_kv_heads, int64_t split,
    int64_t head_dim, int64_t block_size, float scale, float *scores, float *qf, float *acc) {
    const int64_t group = num_heads / num_kv_heads, sub = group / split;
    const int64_t t = it / (num_kv_heads * split), g = it / split % num_kv_heads;
    const int64_t first_head = g * group + it % split * sub, s = row_seq ? row_seq[t] : t;
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    const int64_t ctx = seq_lens[s] - q_len + (t - query_start_loc[s]) + 1;
    attend_item(BF16, query, ldq, key_cache, value_cache, out, block_tables + s * block_table_stride, t, g,
                first_head, ctx, q_len == 1, num_heads, num_kv_heads, sub, head_dim, block_size, scale, scores, qf,
                acc);
}

/* With fewer items than 4 per thread (a decode of one or two sequences) each query head is an item of its own,
 * so every thread has work (one sequence of SmolLM2, 3 KV heads on 2 threads: one thread took all 3 and the
 * other waited). Bits unchanged (attend_item). */
static inline int64_t split_items(int64_t num_tokens, int64_t num_kv_heads, int64_t group, int num_threads) {
    return num_tokens * num_kv_heads < 4 * (int64_t)num_threads ? group : 1;
}

/* Floats of one thread's scratch: scores [group, max_len], then qf and acc [group, head_dim]. */
static inline size_t attention_scratch(int64_t group, int64_t max_len, int64_t head_dim) {
    return (size_t)(group * max_len + 2 * group * head_dim);
}

/* Work items [0, items) of a call (run_item's arguments) shared by the enclosing team: an orphaned omp for;
 * a thread whose scratch is NULL skips its items. A call whose rows are all decodes (decode_only) hands each
 * thread a run of consecutive items, and with whole groups (split 1) the thread asks for the next item's
 * keys and values (prefetch_part) before it computes this one: its own requests come too late to hide the
 * fetch of a context from DRAM (64 sequences' decode over 30 layers with blocks scattered over the pool:
 * 0.69-0.77x the time of dynamic chunks without it, libgomp spinning or sleeping; in the engine's 64-stream
 * step ~0.95x; Intel host, docs/benchmarks/decode-roofline.md, sixth pass). Other calls take chunks of items
 * as they free up (a prompt row's cost grows with its position). */
static inline __attribute__((always_inline)) void run_items(
    const int BF16, int64_t items, int decode_only, const int32_t *row_seq, const void *query, int64_t ldq,
    const void *key_cache, const void *value_cache, void *out, const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_heads, int64_t num_kv_heads,
    int64_t split, int64_t head_dim, int64_t block_size, float scale, float *scratch, int64_t max_len) {
    const int64_t group = num_heads / num_kv_heads, threads = omp_get_num_threads();
    float *qf = scratch ? scratch + group * max_len : 0, *acc = scratch ? qf + group * head_dim : 0;
#define ITEM(it) run_item(BF16, it, row_seq, query, ldq, key_cache, value_cache, out, block_tables, bt_stride, \
                          seq_lens, query_start_loc, num_heads, num_kv_heads, split, head_dim, block_size, scale, \
                          scratch, qf, acc)
    if (decode_only) {
        const int64_t elem = BF16 ? 2 : 4, ss = num_kv_heads * head_dim;
        _Pragma("omp for schedule(static)") for (int64_t it = 0; it < items; it++) {
            if (!scratch) continue;
            if (split == 1 && it + 1 < items) { /* decode row t = sequence s: its context is seq_lens[s] */
                const int64_t t = (it + 1) / num_kv_heads, g = (it + 1) % num_kv_heads, s = row_seq ? row_seq[t] : t;
                const int32_t *table = block_tables + s * bt_stride;
                prefetch_part(key_cache, table, g, 0, seq_lens[s], 0, head_dim, head_dim, block_size, ss, elem);
                prefetch_part(value_cache, table, g, 0, seq_lens[s], 0, head_dim, head_dim, block_size, ss, elem);
            }
            ITEM(it);
        }
    } else {
        const int64_t chunk = items >= 16 * threads ? 4 : 1, chunks = (items + chunk - 1) / chunk;
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t c = 0; c < chunks; c++)
        for (int64_t it = c * chunk; it < items && it < (c + 1) * chunk; it++)
            if (scratch) ITEM(it);
    }
#undef ITEM
}

/* The exported entry point of one dtype. query rows are ldq elements apart
 * (num_heads * head_dim when contiguous; more when q is a slice of the fused
 * q/k/v projection); out is contiguous. Returns 0, 1 for shapes it does not
 * take (head_dim not a multiple of 16, num_heads not a multiple of
 * num_kv_heads), 2 when out of memory. */
#define DEFINE_ATTENTION(NAME, BF16)                                                                       \
    int NAME(const void *query, int64_t ldq, const void *key_cache, const void *value_cache, void *out,   \
             const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,            \
             const int32_t *query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,   \
             int64_t head_dim, int64_t block_size, float scale, int num_threads) {                        \
        if (head_dim % LANES != 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;        \
        const int64_t group = num_heads / num_kv_heads, num_tokens = query_start_loc[num_seqs];           \
        int64_t max_len = 1;                                                                              \
        for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;   \
        int32_t *row_seq = malloc(sizeof(int32_t) * (size_t)(num_tokens > 0 ? num_tokens : 1));          \
        if (!row_seq) return 2;                                                                           \
        for (int64_t s = 0; s < num_seqs; s++)                                                            \
            for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) row_seq[t] = (int32_t)s; \
        const int64_t split = split_items(num_tokens, num_kv_heads, group, num_threads);                  \
        const int64_t items = num_tokens * num_kv_heads * split;                                          \
        int decode_only = 1;                                                                              \
        for (int64_t s = 0; s < num_seqs; s++) decode_only &= query_start_loc[s + 1] - query_start_loc[s] == 1; \
        int failed = 0;                                                                                   \
        _Pragma("omp parallel num_threads(num_threads)") {                                                \
            float *scores = malloc(sizeof(float) * attention_scratch(group, max_len, head_dim));          \
            if (!scores) {                                                                                \
                _Pragma("omp atomic write") failed = 2;                                                   \
            }                                                                                             \
            run_items(BF16, items, decode_only, row_seq, query, ldq, key_cache, value_cache, out, \
                      block_tables, block_table_stride, seq_lens, query_start_loc, num_heads, num_kv_heads,  \
                      split, head_dim, block_size, scale, scores, max_len);                               \
            free(scores);                                                                                 \
        }                                                                                                 \
        free(row_seq);                                                                                    \
        return failed;                                                                                    \
    }

DEFINE_ATTENTION(paged_attention_f32, 0)
DEFINE_ATTENTION(paged_attention_bf16, 1)

#include "attention_decode.h"

/* paged_attention_bf16 for num_seqs decode rows (row s: sequence s's one new token; query_start_loc [s] = s),
 * its work items shared by the threads of the enclosing OpenMP parallel region: every thread of the team
 * calls it with the same arguments, and each returns once every output is written (decoder_cpu.c's
 * one-region decode step). The same bits as paged_attention_bf16: its items, or, where they are too few to
 * share and shared (floats [num_seqs][num_heads][ld], ld >= every seq_len) is given, decode_rounds. The
 * shapes must be ones it takes. Each thread's scratch is kept between calls (grown by 256 positions at a
 * time), so a step allocates nothing once its context fits. Returns 0, or 2 in a thread whose scratch could
 * not be allocated (its items are then skipped: the caller reports the failure). */
int paged_attention_bf16_team(const void *query, int64_t ldq, const void *key_cache, const void *value_cache,
                              void *out, const int32_t *block_tables, int64_t block_table_stride,
                              const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, float *shared, int64_t ld) {
    static __thread void *buf;
    static __thread size_t cap;
    const int64_t group = num_heads / num_kv_heads, threads = omp_get_num_threads();
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    max_len = (max_len + 255) / 256 * 256;
    float *scratch = scratch_grow(&buf, &cap, sizeof(float) * attention_scratch(group, max_len, head_dim));
    const int64_t split = split_items(num_seqs, num_kv_heads, group, (int)threads);
    int rounds = shared && split > 1;
    for (int64_t s = 0; s < num_seqs && rounds; s++) rounds = seq_lens[s] <= ld;
    if (rounds) {
        float *qf = scratch ? scratch + group * max_len : 0, *acc = scratch ? qf + group * head_dim : 0;
        decode_rounds(query, ldq, key_cache, value_cache, out, block_tables, block_table_stride, seq_lens, num_seqs,
                      num_heads, num_kv_heads, head_dim, block_size, scale, shared, ld, scratch, qf, acc, threads);
        return scratch ? 0 : 2;
    }
    run_items(1, num_seqs * num_kv_heads * split, 1, 0, query, ldq, key_cache, value_cache, out, block_tables,
              block_table_stride, seq_lens, query_start_loc, num_heads, num_kv_heads, split, head_dim, block_size,
              scale, scratch, max_len);
    return scratch ? 0 : 2;
}
