/* The AMX body of the integer quantized kernels' many-row calls (Intel AMX-INT8, Sapphire Rapids and
 * later): quant_int512.h's arithmetic with the block sums of 16 rows x 16 columns taken by one tile
 * multiply instead of 128 VPDPBUSD. 4-bit: TDPBSUD (the rows' signed 8-bit inputs times the unsigned codes
 * 0..15, unpacked from their nibbles once per group of columns); 8-bit: TDPBUSD (the inputs offset by 128
 * times the signed codes), less 128 times the block's code sum, as the VNNI body. The int32 sums are exact
 * and each float32 step after them is the VNNI body's operation on the same operands in the same order
 * (acc = fma(float(isum), d * dx, acc), + fma(m, sx, acc) for 4-bit; bias, residual, one rounding), so every
 * output bit equals the VNNI and AVX2 bodies' (tests/test_quant_int512.py holds the builds together).
 *
 * Used by qv_items for calls of at least QA_MIN_ROWS rows when the kernel grants this process the tile
 * state (arch_prctl ARCH_REQ_XCOMP_PERM) and $TANDEM_CPU_AMX is not "0" (read once; "0" measures the
 * VNNI body on the same machine). Rows run 16 at a time; a last tile of fewer rows reads the scratch's
 * padding rows (qv_scratch keeps QA_ROWS rows beyond m) into tile rows whose sums are never used.
 * Tiles: tmm0/tmm1 block sums (16 x 16 int32), tmm2/tmm3 16 rows' 32 input bytes, tmm4/tmm5 a block's
 * codes (8 rows of 16 columns x 4 inputs: the packed layout's 32-bit lanes), two of each so that one
 * block's multiply overlaps the previous block's float steps. Included by quant_int512.h only. */
#ifndef TANDEM_QUANT_AMX_H
#define TANDEM_QUANT_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QA_ROWS 16     /* rows per tile */
#define QA_MIN_ROWS 16 /* calls of fewer rows run the VNNI body (measured: loadtests/bench/kernels_cpu.py) */

/* 1 when this process may use the tile registers, asked of the kernel once (0: not asked yet, -1: refused or
 * turned off by $TANDEM_CPU_AMX=0). */
static int qa_granted;

static int qa_ready(void) {
    int s = __atomic_load_n(&qa_granted, __ATOMIC_ACQUIRE);
    if (s) return s > 0;
    const char *env = getenv("TANDEM_CPU_AMX");
    if (env && strcmp(env, "0") == 0)
        s = -1;
    else /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (Linux 5.16+): the permission is the process's */
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    __atomic_store_n(&qa_granted, s, __ATOMIC_RELEASE);
    return s > 0;
}

/* This thread's tile shapes (palette 1; the layout is the architecture's 64-byte LDTILECFG operand). */
static void qa_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;         /* block sums */
    for (int t = 2; t < 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = QBLOCK;     /* inputs */
    for (int t = 4; t < 6; t++) cfg.rows[t] = QBLOCK / 4, cfg.colsb[t] = 64; /* codes */
    _tile_loadconfig(&cfg);
}

/* This thread's buffer for one group's unpacked 4-bit codes (k / 32 blocks of 512 bytes). */
static inline uint8_t *qa_codes_scratch(int64_t k) {
    static __thread void *buf;
    static __thread size_t cap;
    return scratch_grow(&buf, &cap, (size_t)(k / QBLOCK) * 512);
}

/* One block's float32 steps for the tile's mr rows: acc[i] as qv_tile's, from the block sums ib (16 x 16
 * int32, row i at ib + 16 i), less csum (8-bit: 128 x the code sums) */
static inline __attribute__((always_inline)) void qa_steps(const int Q8, int mr, __m512 acc[][2], const int32_t *ib,
                                                           __m512i csum, __m512 d, __m512 mn, const float *dx,
                                                           const float *sx, int64_t blocks, int64_t b) {
#pragma GCC unroll 16
    for (int i = 0; i < QA_ROWS; i++) {
        if (i >= mr) break;
        __m512i t = _mm512_loadu_si512(ib + 16 * i);
        if (Q8) t = _mm512_sub_epi32(t, csum);
        const __m512 ddx = _mm512_mul_ps(d, _mm512_set1_ps(dx[i * blocks + b]));
        acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), ddx, acc[i][0]);
        if (!Q8) acc[i][0] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[i * blocks + b]), acc[i][0]);
    }
}

/* Group j (16 columns) of the panel at codes / scales, for rows 0 .. m - 1 of the quantized inputs q (k
 * apart), dx / sx (k / 32 apart); col0 the panel's first column; the caller configured the tiles. Returns
 * 2 when the 4-bit codes' scratch could not be allocated (nothing written), else 0. */
static int qa_group(const int Q8, const uint8_t *q, const float *dx, const float *sx, const void *codes,
                    const void *scales, int64_t group, int j, int64_t k, int64_t col0, int64_t n, const float *bias,
                    const uint16_t *residual, int64_t ldr, void *y, int64_t ldy, int64_t m, int y_f32) {
    const int64_t blocks = k / QBLOCK;
    const size_t ysz = y_f32 ? 4 : 2;
    const __m512i nib = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
    uint8_t *bb = 0;
    if (!Q8) { /* the group's codes, one byte each: a block's 8 tile rows are its vectors' low, high nibbles */
        if (!(bb = qa_codes_scratch(k))) return 2;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *cb = (const uint8_t *)codes + qi_at(j, b, blocks) * 256;
            for (int v = 0; v < 4; v++) {
                const __m512i raw = _mm512_loadu_si512(cb + 64 * v);
                _mm512_storeu_si512(bb + b * 512 + 128 * v, _mm512_and_si512(raw, nib));
                _mm512_storeu_si512(bb + b * 512 + 128 * v + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib));
            }
        }
    }
    int32_t ib[2][256] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += QA_ROWS) {
        const int mr = m - r0 < QA_ROWS ? (int)(m - r0) : QA_ROWS;
        const uint8_t *qr = q + r0 * k;
        __m512 acc[QA_ROWS][2];
        for (int i = 0; i < QA_ROWS; i++) acc[i][0] = _mm512_setzero_ps();
        /* One block b on tiles C (sums), A (inputs), B (codes), its sums stored into ib[C]. */
#define QA_MULTIPLY(C, A, B, b)                                                                          \
    do {                                                                                                 \
        _tile_loadd(A, qr + (b) * QBLOCK, k);                                                            \
        if (Q8)                                                                                          \
            _tile_loadd(B, (const uint8_t *)codes + qi_at(j, b, blocks) * 512, 64);                      \
        else                                                                                             \
            _tile_loadd(B, bb + (b) * 512, 64);                                                          \
        _tile_zero(C);                                                                                   \
        if (Q8)                                                                                          \
            _tile_dpbusd(C, A, B);                                                                       \
        else                                                                                             \
            _tile_dpbsud(C, A, B);                                                                       \
        _tile_stored(C, ib[C], 64);                                                                      \
    } while (0)
        QA_MULTIPLY(0, 2, 4, 0);
        for (int64_t b = 0; b < blocks; b++) {
            if (b + 1 < blocks && b % 2 == 0) /* the next block's multiply before this block's steps */
                QA_MULTIPLY(1, 3, 5, b + 1);
            else if (b + 1 < blocks)
                QA_MULTIPLY(0, 2, 4, b + 1);
            __m512 d, mn = _mm512_setzero_ps();
            __m512i csum = _mm512_setzero_si512();
            if (Q8) {
                const uint8_t *cb = (const uint8_t *)codes + qi_at(j, b, blocks) * 512;
                for (int v = 0; v < 8; v++) csum = _mm512_dpbusd_epi32(csum, ones, _mm512_loadu_si512(cb + 64 * v));
                csum = _mm512_slli_epi32(csum, 7);
                d = _mm512_loadu_ps((const float *)scales + b * QBLOCK / group * PANEL + 16 * j);
            } else {
                const uint16_t *sb = (const uint16_t *)scales + b * QBLOCK / group * 2 * PANEL + 16 * j;
                d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
                mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + PANEL)));
            }
            qa_steps(Q8, mr, acc, ib[b % 2], csum, d, mn, dx + r0 * blocks, sx + r0 * blocks, blocks, b);
        }
#undef QA_MULTIPLY
        qv_store_rows(mr, 1, acc, col0 + 16 * j, n, bias, residual ? residual + r0 * ldr : 0, ldr,
                      (char *)y + r0 * ldy * ysz, ldy, y_f32);
    }
    return 0;
}

#endif
