/* Y = X W^T + b for a few tokens: W is (rows, cols) row-major, fp32 (matvec) or fp16 (matvec_half), as
 * checkpoints store linear weights, X is (n, cols) and Y is (n, rows), one row per token.
 *
 * Decoding reads every weight once per step, so a step is bound by memory bandwidth. Blocks of rows are streamed
 * side by side against a token's x (which stays in L1), keeping the loads sequential; with several tokens (batched
 * decode) the block, still in L1, serves each token in turn: the weights come from memory once per step whatever n
 * is, and each token's sums are computed exactly as for n = 1. The wide loop (dense_block, also W8A16's; vec.h: 16
 * lanes with AVX-512, 8 with AVX2) converts a block's fp16 or int8 weights to floats in registers once for up to 4
 * tokens: half or a quarter of the bytes read, the multiply-adds of fp32 rows. Elsewhere four rows go side by side
 * (fp16 rows converted into an L1 buffer first, F16C or half.h; finite weights). bias may be NULL. Large matrices'
 * row blocks are split over the OpenMP threads torch runs (torch.set_num_threads); each row is summed by one thread
 * as it is alone, so the results do not depend on the thread count.
 */
#ifndef CABIN_MATVEC_C  /* quant_matvec.c and decode_step.c both include it */
#define CABIN_MATVEC_C
#include <stdint.h>

#include "half.h"
#include "vec.h"
#define PARALLEL_WEIGHTS (1 << 16)  /* matrices at least this large are split by rows over the OpenMP threads */
#define PREFETCH_BLOCKS 4  /* how many blocks of rows ahead the next weights are fetched (1 to 8 read alike) */
#if defined(__F16C__) && !defined(GENERIC)
#include <immintrin.h>
#endif

static void four_rows(const float *restrict w0, const float *restrict w1, const float *restrict w2,
                      const float *restrict w3, const float *restrict x, float *restrict y, int64_t n,
                      int64_t rows, int64_t cols)
{
    for (int64_t t = 0; t < n; t++) {
        const float *xt = x + t * cols;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        #pragma omp simd reduction(+:a0, a1, a2, a3)
        for (int64_t i = 0; i < cols; i++) {
            a0 += w0[i] * xt[i];
            a1 += w1[i] * xt[i];
            a2 += w2[i] * xt[i];
            a3 += w3[i] * xt[i];
        }
        float *yt = y + t * rows;
        yt[0] = a0, yt[1] = a1, yt[2] = a2, yt[3] = a3;
    }
}

static void one_row(const float *restrict w0, const float *restrict x, float *restrict y, int64_t n, int64_t rows,
                    int64_t cols)
{
    for (int64_t t = 0; t < n; t++) {
        const float *xt = x + t * cols;
        float a0 = 0.0f;
        #pragma omp simd reduction(+:a0)
        for (int64_t i = 0; i < cols; i++) a0 += w0[i] * xt[i];
        y[t * rows] = a0;
    }
}

static void add_bias(const float *restrict bias, float *restrict y, int64_t n, int64_t rows)
{
    if (bias)
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < rows; r++) y[t * rows + r] += bias[r];
}

#if WIDE
enum dense { DENSE_FP32, DENSE_FP16, DENSE_INT8 };  /* the element of a dense weight row */

static inline int64_t dense_bytes(const enum dense kind)  /* bytes of one weight */
{
    return kind == DENSE_FP32 ? 4 : kind == DENSE_FP16 ? 2 : 1;
}

/* R rows (cols apart) of fp32, fp16 or int8 weights (kind) over N tokens, all constants where inlined: each row's
 * LANES weights become floats once for the N tokens, each token's sums taken in the same order as alone; int8 rows
 * are scaled once at the end (W8A16). The rows PREFETCH_BLOCKS blocks on are fetched ahead. */
static inline __attribute__((always_inline)) void dense_block(const void *w, const enum dense kind, const float *scale,
                                                              const float *x, float *y, int64_t rows, int64_t cols,
                                                              const int R, const int N)
{
    const int64_t bytes = dense_bytes(kind);
    const char *ahead = (const char *)w + PREFETCH_BLOCKS * R * cols * bytes;
    vf acc[MAX_SUMS];
    _Pragma("GCC unroll 16")
    for (int k = 0; k < R * N; k++) acc[k] = vf_zero();
    for (int64_t i = 0; i < cols; i += LANES) {
        if (i * bytes % 64 == 0)
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) _mm_prefetch(ahead + (r * cols + i) * bytes, _MM_HINT_T0);
        vf wv[4];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++)
            wv[r] = kind == DENSE_FP32 ? vf_load((const float *)w + r * cols + i)
                  : kind == DENSE_FP16 ? vf_half((const uint16_t *)w + r * cols + i)
                                       : vf_int8((const int8_t *)w + r * cols + i);
        _Pragma("GCC unroll 4")
        for (int t = 0; t < N; t++) {
            const vf xv = vf_load(x + t * cols + i);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) acc[r * N + t] = vf_fmadd(wv[r], xv, acc[r * N + t]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4")
        for (int t = 0; t < N; t++)
            y[t * rows + r] = kind == DENSE_INT8 ? vf_sum(acc[r * N + t]) * scale[r] : vf_sum(acc[r * N + t]);
}

/* Blocks of 4 rows for one token, FLOAT_ROWS for several (single rows at the end), the tokens in chunks of up to 4;
 * cols a multiple of LANES. scale: int8 rows' (NULL for float ones). */
static void dense_rows_wide(const void *w, const enum dense kind, const float *scale, const float *x, float *y,
                            int64_t n, int64_t rows, int64_t cols)
{
    const int64_t block = n == 1 ? 4 : FLOAT_ROWS, blocks = rows / block;
    const int64_t bytes = dense_bytes(kind);
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t u = 0; u < blocks + rows % block; u++) {
        const int64_t r = u < blocks ? u * block : blocks * block + (u - blocks), R = u < blocks ? block : 1;
        const char *rw = (const char *)w + r * cols * bytes;
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
            const int64_t N = n - t0 < 4 ? n - t0 : 4;
#define DENSE_BLOCK(RR, NN) \
    switch (kind) { \
    case DENSE_FP32: dense_block(rw, DENSE_FP32, NULL, x + t0 * cols, y + t0 * rows + r, rows, cols, RR, NN); break; \
    case DENSE_FP16: dense_block(rw, DENSE_FP16, NULL, x + t0 * cols, y + t0 * rows + r, rows, cols, RR, NN); break; \
    default: dense_block(rw, DENSE_INT8, scale + r, x + t0 * cols, y + t0 * rows + r, rows, cols, RR, NN); \
    }
            BLOCK_SHAPES(DENSE_BLOCK)
#undef DENSE_BLOCK
        }
    }
}
#endif

/* fp32 rows four side by side (the plain loop). */
static void float_rows(const float *restrict w, const float *restrict x, float *restrict y, int64_t n, int64_t rows,
                       int64_t cols)
{
    const int64_t blocks = rows / 4;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t b = 0; b < blocks; b++) {
        const float *w0 = w + 4 * b * cols;
        four_rows(w0, w0 + cols, w0 + 2 * cols, w0 + 3 * cols, x, y + 4 * b, n, rows, cols);
    }
    for (int64_t r = 4 * blocks; r < rows; r++) one_row(w + r * cols, x, y + r, n, rows, cols);
}

void matvec(const float *restrict w, const float *restrict x, const float *restrict bias, float *restrict y,
            int64_t n, int64_t rows, int64_t cols)
{
#if WIDE
    if (cols % LANES == 0)
        dense_rows_wide(w, DENSE_FP32, NULL, x, y, n, rows, cols);
    else
#endif
        float_rows(w, x, y, n, rows, cols);
    add_bias(bias, y, n, rows);
}

static void halves_to_floats(const uint16_t *restrict h, float *restrict f, int64_t count)
{
    int64_t i = 0;
#if defined(__F16C__) && !defined(GENERIC)
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    #pragma omp simd
    for (int64_t j = i; j < count; j++) f[j] = half_to_float(h[j]);
}

/* fp16 rows converted four at a time into an L1 buffer, then dotted as fp32 rows are (the plain loop). */
static void half_rows(const uint16_t *restrict w, const float *restrict x, float *restrict y, int64_t n, int64_t rows,
                      int64_t cols)
{
    const int64_t blocks = rows / 4;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t b = 0; b < blocks; b++) {
        float rows4[4 * cols];  /* four rows converted (one buffer per thread): stay in cache */
        halves_to_floats(w + 4 * b * cols, rows4, 4 * cols);
        four_rows(rows4, rows4 + cols, rows4 + 2 * cols, rows4 + 3 * cols, x, y + 4 * b, n, rows, cols);
    }
    float row[cols];
    for (int64_t r = 4 * blocks; r < rows; r++) {
        halves_to_floats(w + r * cols, row, cols);
        one_row(row, x, y + r, n, rows, cols);
    }
}

void matvec_half(const uint16_t *restrict w, const float *restrict x, const float *restrict bias,
                 float *restrict y, int64_t n, int64_t rows, int64_t cols)
{
#if WIDE
    if (cols % LANES == 0)
        dense_rows_wide(w, DENSE_FP16, NULL, x, y, n, rows, cols);
    else
#endif
        half_rows(w, x, y, n, rows, cols);
    add_bias(bias, y, n, rows);
}
#endif
