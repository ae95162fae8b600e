/* y = W x + b for one token over quantized weights, dequantized in registers (runtime/quant_linear.py has the
 * layouts and the torch path these match).
 *
 * matvec_int8 (W8A16): w int8 (rows, cols), one float32 scale per row: y[r] = scale[r] * sum_i w[r][i] x[i].
 * matvec_int4 (W4A16_AWQ): packed int8 (rows / 2, cols), row 2p in the low nibble of packed row p and row 2p + 1
 * in the high one; scale float32 (rows, cols / group); x is already multiplied by the prequant scale. Each packed
 * row is dequantized into two L1-resident rows (both of its output rows), then dotted with x.
 * bias may be NULL. Like matvec.c, a step is bound by reading the weights: 1 byte (int8) or half a byte (int4)
 * per weight instead of 4.
 */
#include <stdint.h>

void matvec_int8(const int8_t *restrict w, const float *restrict scale, const float *restrict x,
                 const float *restrict bias, float *restrict y, int64_t rows, int64_t cols)
{
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const int8_t *w0 = w + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        #pragma omp simd reduction(+:a0, a1, a2, a3)
        for (int64_t i = 0; i < cols; i++) {
            a0 += (float)w0[i] * x[i];
            a1 += (float)w1[i] * x[i];
            a2 += (float)w2[i] * x[i];
            a3 += (float)w3[i] * x[i];
        }
        y[r] = a0 * scale[r], y[r + 1] = a1 * scale[r + 1], y[r + 2] = a2 * scale[r + 2];
        y[r + 3] = a3 * scale[r + 3];
    }
    for (; r < rows; r++) {
        const int8_t *w0 = w + r * cols;
        float a0 = 0.0f;
        #pragma omp simd reduction(+:a0)
        for (int64_t i = 0; i < cols; i++) a0 += (float)w0[i] * x[i];
        y[r] = a0 * scale[r];
    }
    if (bias)
        for (r = 0; r < rows; r++) y[r] += bias[r];
}

void matvec_int4(const int8_t *restrict packed, const float *restrict scale, const float *restrict x,
                 const float *restrict bias, float *restrict y, int64_t rows, int64_t cols, int64_t group)
{
    const int64_t groups = cols / group;
    float w0[cols], w1[cols];  /* one packed row dequantized (both output rows): stays in L1 */
    for (int64_t p = 0; p < rows / 2; p++) {
        const int8_t *row = packed + p * cols;
        const float *s0 = scale + (2 * p) * groups, *s1 = s0 + groups;
        for (int64_t g = 0; g < groups; g++) {
            const float f0 = s0[g], f1 = s1[g];
            const int8_t *b = row + g * group;
            float *d0 = w0 + g * group, *d1 = w1 + g * group;
            #pragma omp simd
            for (int64_t i = 0; i < group; i++) {
                int32_t byte = b[i];  /* shifts on 32-bit lanes vectorize; arithmetic shifts sign-extend */
                d0[i] = (float)((int32_t)((uint32_t)byte << 28) >> 28) * f0;  /* low nibble: row 2p */
                d1[i] = (float)(byte >> 4) * f1;                              /* high nibble: row 2p + 1 */
            }
        }
        float a0 = 0.0f, a1 = 0.0f;
        #pragma omp simd reduction(+:a0, a1)
        for (int64_t i = 0; i < cols; i++) {
            a0 += w0[i] * x[i];
            a1 += w1[i] * x[i];
        }
        y[2 * p] = a0, y[2 * p + 1] = a1;
    }
    if (bias)
        for (int64_t r = 0; r < rows; r++) y[r] += bias[r];
}
