/* Y = X W^T + b for the few tokens of a decode step over quantized weights, dequantized in registers
 * (runtime/model/linear.py has the layouts and the torch path these match). X is (n, cols), Y is (n, rows), one
 * row per token; a block of weight rows, still in L1, serves each token in turn, so the weights come from memory
 * once per step whatever n is and each token's sums are computed exactly as for n = 1.
 *
 * matvec_int8 (W8A16): w int8 (rows, cols), one float32 scale per row: y[r] = scale[r] * sum_i w[r][i] x[i] (the
 * wide loop is matvec.c's dense block over int8 rows).
 * matvec_int4 (W4A16_AWQ): packed int8 (rows / 2, cols), row 2p in the low nibble of packed row p and row 2p + 1
 * in the high one; scale float32 (rows, cols / group); x is already multiplied by the prequant scale. The wide loop
 * takes two packed rows at once and turns each LANES codes into their weights (code times group scale) once for up to
 * 4 tokens; the plain one dequantizes each packed row into two L1-resident rows (both of its output rows), then dots
 * them with x. Rows are fetched a few blocks ahead (without it the loops wait on memory: half the speed or less).
 * matvec_q4g32 (int4-g32, llama.cpp's Q4_1 block): codes uint8 (rows, cols / 2), 16 bytes per 32 inputs, input j of a
 * group in the low nibble of its byte j and input j + 16 in the high one; scale and minimum fp16 (rows, cols / 32):
 * y[r] = sum_g sum_j (scale * q_j + minimum) x_j.
 * matvec_q8g32 (the int8 head, llama.cpp's Q8_0 block): codes int8 (rows, cols), scale fp16 (rows, cols / 32).
 * Both dequantize a group's codes in registers once for every token of the step (4-bit ones picked from the group's
 * 16 values with AVX-512), then each token multiply-adds them.
 * With int8_x (int8 activations: llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dots, ONNX Runtime's MatMulNBits at
 * accuracy_level 4) each token's x is first rounded per 32 inputs, e = max |x| / 127, p = round(x / e) in [-127, 127]
 * (runtime/model/linear.py's int8_blocks), and a group sums the integer products q * p exactly:
 * y[r] = sum_g (d * e * sum_j q_j p_j + minimum * e * sum_j p_j). The AVX2 loop takes eight rows at once, one per
 * 32-bit lane (rows8_int8): each group's eight integer sums come out in one vector, scaled and added as one, with
 * no horizontal sums, so each further token of a step costs a fraction of the first; int8 codes take it where the
 * CPU has VNNI (-DNO_VNNI builds without it, as on AVX2-only CPUs).
 * bias may be NULL. Rows are split over the OpenMP threads as in matvec.c (PARALLEL_WEIGHTS), each summed by one
 * thread, so the results do not depend on the thread count. One token's step is bound by reading the weights: 1 byte
 * (int8) or half a byte (int4) per weight instead of 4; several tokens' by the multiply-adds, one per weight and
 * token, which the wide loops (vec.h: 16 lanes with AVX-512, 8 with AVX2) do LANES at a time. Other CPUs, rows whose
 * length is not a multiple of LANES, and builds with -DGENERIC take the plain loops, which the compiler vectorizes as
 * it can.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "matvec.c"  /* one_row, add_bias, halves_to_floats, dense_rows_wide; vec.h */

#define G32 32

#if WIDE
#if LANES == 16
/* LANES packed bytes of a W4A16-AWQ row pair as its two rows' weights: each signed nibble times its row's group scale
 * (s0: the low nibbles' row, s1: the high ones'), picked from the 16 values a nibble can take (vpermps reads the low 4
 * bits of each lane). */
static inline void awq_weights(const int8_t *p, float s0, float s1, vf *low, vf *high)
{
    const vf nibbles = _mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, 7, 6, 5, 4, 3, 2, 1, 0);  /* lane k: k as int4 */
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = _mm512_permutexvar_ps(v, _mm512_mul_ps(nibbles, _mm512_set1_ps(s0)));
    *high = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), _mm512_mul_ps(nibbles, _mm512_set1_ps(s1)));
}

/* A group's 32 4-bit codes dequantized, d * q + m: inputs 0-15 (the low nibbles of its 16 bytes), then 16-31 (the high
 * ones). The 16 values a code can take are made once and each code picks its own (vpermps reads the low 4 bits of
 * each lane): two fewer operations than converting the codes and scaling them. */
static inline void q4_weights(const uint8_t *codes, float d, float m, vf *w)
{
    const vf codes16 = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const vf table = _mm512_fmadd_ps(codes16, _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    w[0] = _mm512_permutexvar_ps(b, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
#else
static inline void awq_weights(const int8_t *p, float s0, float s1, vf *low, vf *high)
{
    const __m256i v = widen8(p);  /* arithmetic shifts sign-extend each nibble */
    *low = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28)), _mm256_set1_ps(s0));
    *high = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(v, 4)), _mm256_set1_ps(s1));
}

/* A group's 32 4-bit codes dequantized, d * q + m, as four vectors: inputs 0-7, 8-15, 16-23, 24-31. */
static inline void q4_weights(const uint8_t *codes, float d, float m, vf *w)
{
    const __m256i low = _mm256_set1_epi32(0x0f);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    /* bytes 0-7 hold inputs 0-7 (low nibbles) and 16-23 (high); bytes 8-15 inputs 8-15 and 24-31 */
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8)));
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), dv, mv);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), dv, mv);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), dv, mv);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), dv, mv);
}
#endif
#define GROUP_VECTORS (G32 / LANES)  /* vectors of a group of 32 inputs */
/* P packed int4 rows (2P output rows, y's from the first) over N tokens, both constants where inlined so the 2P * N
 * sums stay in registers: each LANES codes of a row are dequantized (times their group's scale) once for the N
 * tokens, then each token multiply-adds them into its sums; a token's x is loaded once for the P rows. */
static inline __attribute__((always_inline)) void int4_block(const int8_t *packed, const float *scale, const float *x,
                                                             float *y, int64_t rows, int64_t cols, int64_t group,
                                                             const int P, const int N)
{
    const int64_t groups = cols / group;
    vf sums[MAX_SUMS];  /* row 2p + h, token t: sums[(2 * p + h) * N + t] */
    _Pragma("GCC unroll 16")
    for (int k = 0; k < 2 * P * N; k++) sums[k] = vf_zero();
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = g * group; i < (g + 1) * group; i += LANES) {
            if (i % 64 == 0)
                _Pragma("GCC unroll 2")
                for (int p = 0; p < P; p++)
                    _mm_prefetch((const char *)(packed + (PREFETCH_BLOCKS * P + p) * cols + i), _MM_HINT_T0);
            vf xv[4];
            _Pragma("GCC unroll 4")
            for (int t = 0; t < N; t++) xv[t] = vf_load(x + t * cols + i);
            _Pragma("GCC unroll 2")
            for (int p = 0; p < P; p++) {
                vf low, high;
                awq_weights(packed + p * cols + i, scale[2 * p * groups + g], scale[(2 * p + 1) * groups + g], &low,
                            &high);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < N; t++)
                    sums[2 * p * N + t] = vf_fmadd(low, xv[t], sums[2 * p * N + t]),
                    sums[(2 * p + 1) * N + t] = vf_fmadd(high, xv[t], sums[(2 * p + 1) * N + t]);
            }
        }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < 2 * P; r++)
        _Pragma("GCC unroll 4")
        for (int t = 0; t < N; t++) y[t * rows + r] = vf_sum(sums[r * N + t]);
}

/* Units of 2 packed rows (4 output rows; FLOAT_ROWS / 2 for several tokens), a single packed row at the end, the tokens
 * in chunks of up to 4. */
static void int4_rows_wide(const int8_t *packed, const float *scale, const float *x, float *y, int64_t n,
                           int64_t rows, int64_t cols, int64_t group)
{
    const int64_t groups = cols / group, block = n == 1 ? 2 : FLOAT_ROWS / 2, pairs = rows / 2, blocks = pairs / block;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t u = 0; u < blocks + pairs % block; u++) {
        const int64_t p = u < blocks ? u * block : blocks * block + (u - blocks), P = u < blocks ? block : 1;
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
            const int64_t N = n - t0 < 4 ? n - t0 : 4;
#define INT4_BLOCK(PP, NN) int4_block(packed + p * cols, scale + 2 * p * groups, x + t0 * cols, y + t0 * rows + 2 * p, \
                                      rows, cols, group, PP, NN)
#define INT4_BLOCK_2(NN) INT4_BLOCK(2, NN)
#define INT4_BLOCK_1(NN) INT4_BLOCK(1, NN)
            if (P == 2) {
                TOKEN_CHUNK(INT4_BLOCK_2, N)
            } else {
                TOKEN_CHUNK(INT4_BLOCK_1, N)
            }
#undef INT4_BLOCK_1
#undef INT4_BLOCK_2
#undef INT4_BLOCK
        }
    }
}

static inline void q8_weights(const int8_t *codes, float d, vf *w)  /* a group's 32 int8 codes times d */
{
    for (int i = 0; i < GROUP_VECTORS; i++) w[i] = vf_mul(vf_int8(codes + LANES * i), vf_set1(d));
}

/* R rows of codes (row_bytes apart) over N tokens, both constants where inlined so the R * N sums stay in
 * registers: acc[r * N + t] = sum_g sum_j (d[r][g] * q_rgj + m[r][g]) x_tgj (4-bit codes; int8 ones have no m). Each
 * group's weights are dequantized in registers once for the N tokens, then each token multiply-adds them into its
 * sums (the minimum term costs nothing per token). A later block's codes (PREFETCH_BLOCKS blocks on) are prefetched
 * a slice per group, its size a constant so that no loop is left around the prefetches: with the hardware prefetcher
 * alone the loop waits on memory (half the speed). */
static inline __attribute__((always_inline)) void g32_block(const uint8_t *codes, int64_t row_bytes, const float *d,
                                                            const float *m, const float *x, int64_t cols, float *acc,
                                                            const int R, const int N, const int four_bits)
{
    const int64_t groups = cols / G32;
    const int slice = R * (four_bits ? 16 : G32);  /* bytes of a group's R rows */
    const uint8_t *next = codes + PREFETCH_BLOCKS * R * row_bytes;
    vf sums[MAX_SUMS];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < R * N; i++) sums[i] = vf_zero();
    for (int64_t g = 0; g < groups; g++) {
        _Pragma("GCC unroll 4")
        for (int k = 0; k < slice; k += 64) _mm_prefetch((const char *)(next + g * slice + k), _MM_HINT_T0);
        vf xv[4][GROUP_VECTORS];  /* the group's x of each token, loaded once for the R rows */
        _Pragma("GCC unroll 4")
        for (int t = 0; t < N; t++)
            _Pragma("GCC unroll 4")
            for (int i = 0; i < GROUP_VECTORS; i++) xv[t][i] = vf_load(x + t * cols + g * G32 + LANES * i);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            vf w[GROUP_VECTORS];
            if (four_bits) q4_weights(codes + r * row_bytes + g * 16, d[r * groups + g], m[r * groups + g], w);
            else q8_weights((const int8_t *)codes + r * row_bytes + g * G32, d[r * groups + g], w);
            _Pragma("GCC unroll 4")
            for (int t = 0; t < N; t++)
                _Pragma("GCC unroll 4")
                for (int i = 0; i < GROUP_VECTORS; i++) sums[r * N + t] = vf_fmadd(w[i], xv[t][i], sums[r * N + t]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < R * N; i++) acc[i] = vf_sum(sums[i]);
}

/* A group's 32 4-bit codes as bytes in input order (llama.cpp's bytes_from_nibbles_32). */
static inline __m256i q4_bytes(const uint8_t *codes)
{
    const __m128i c = _mm_loadu_si128((const __m128i *)codes), low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), low), _mm_and_si128(c, low));
}

#if !defined(NO_VNNI) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define VNNI 1
#else
#define VNNI 0
#endif

/* acc plus the four-byte sums of unsigned u times signed s in 32-bit lanes: one VNNI instruction where the CPU has
 * it, else pairs summed to 16 bits (exact while u <= 128: 4-bit codes, int8 magnitudes) and then to 32. */
static inline __m256i dot_add(__m256i acc, __m256i u, __m256i s)
{
#if VNNI && defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* g32_block on int8 activations: xq holds each group's 32 codes of the tokens one after another (n of them, the
 * first N here), e their scales likewise (groups, n), d the weights' scales (R, groups). Each group's 32 products
 * are summed as integers (dot_add takes unsigned times signed bytes: 4-bit codes as they are, int8 codes by their
 * magnitude with the sign moved onto x), then acc[r * N + t] += d[r][g] * e[g][t] * sum. */
static inline __attribute__((always_inline)) void g32_block_int8(const uint8_t *codes, int64_t row_bytes,
                                                                 const float *d, const int8_t *xq, const float *e,
                                                                 int64_t n, int64_t groups, float *acc, const int R,
                                                                 const int N, const int four_bits)
{
    const int group_bytes = four_bits ? 16 : 32, slice = R * group_bytes;  /* bytes of a group's R rows */
    const uint8_t *next = codes + PREFETCH_BLOCKS * R * row_bytes;
    __m256 sums[MAX_SUMS];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R * N; i++) sums[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, codes += group_bytes, next += slice, xq += n * G32, e += n, d++) {
        _Pragma("GCC unroll 4")
        for (int k = 0; k < slice; k += 64) _mm_prefetch((const char *)(next + k), _MM_HINT_T0);
        __m256i xv[4];
        __m256 ev[4];
        _Pragma("GCC unroll 8")
        for (int t = 0; t < N; t++)
            xv[t] = _mm256_loadu_si256((const __m256i *)(xq + t * G32)), ev[t] = _mm256_broadcast_ss(e + t);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            const __m256i w = four_bits ? q4_bytes(codes + r * row_bytes)
                                        : _mm256_loadu_si256((const __m256i *)(codes + r * row_bytes));
            const __m256i magnitude = four_bits ? w : _mm256_sign_epi8(w, w);
            const __m256 dv = _mm256_broadcast_ss(d + r * groups);
            _Pragma("GCC unroll 8")
            for (int t = 0; t < N; t++) {
                const __m256i signed_x = four_bits ? xv[t] : _mm256_sign_epi8(xv[t], w);
                const __m256i products = dot_add(_mm256_setzero_si256(), magnitude, signed_x);
                sums[r * N + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_mul_ps(dv, ev[t]),
                                                  sums[r * N + t]);
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R * N; i++) acc[i] = sum8(sums[i]);
}

/* Both group formats: the R rows from r0 (a block of 4 for one token, FLOAT_ROWS for several, or a single row), the
 * tokens in chunks of up to 4 (a block is in L1 after the first chunk); each unit's scales and minima
 * are converted to floats once. Float x (the minimum in the dequantized weights), or (xq given) int8 x with scales e
 * (the minimum term sum_g m_g * xsum_tg, the x sums computed once per call). Inlined with four_bits constant (q4_rows_wide, q8_rows_wide). */
static inline __attribute__((always_inline)) void g32_unit(const void *codes, const uint16_t *scale,
                                                           const uint16_t *minimum, const float *x, const int8_t *xq,
                                                           const float *e, const float *xsum, float *y, int64_t n,
                                                           int64_t rows, int64_t cols, int64_t r0, int64_t R,
                                                           const int four_bits)
{
    const int64_t groups = cols / G32, row_bytes = four_bits ? cols / 2 : cols;
    float d[R * groups], m[R * groups];
    const uint8_t *row = (const uint8_t *)codes + r0 * row_bytes;
    halves_to_floats(scale + r0 * groups, d, R * groups);
    if (minimum) halves_to_floats(minimum + r0 * groups, m, R * groups);
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
        const int64_t N = n - t0 < 4 ? n - t0 : 4;
        float acc[MAX_SUMS];  /* the R * N sums */
#define FLOAT_X(RR, NN) g32_block(row, row_bytes, d, minimum ? m : NULL, x + t0 * cols, cols, acc, RR, NN, four_bits)
#define INT8_X(RR, NN) g32_block_int8(row, row_bytes, d, xq + t0 * G32, e + t0, n, groups, acc, RR, NN, four_bits)
        if (xq) {
            BLOCK_SHAPES(INT8_X)
        } else {
            BLOCK_SHAPES(FLOAT_X)
        }
#undef INT8_X
#undef FLOAT_X
        for (int64_t r = 0; r < R; r++)
            for (int64_t t = 0; t < N; t++) {
                float lift = 0.0f;
                if (minimum && xq)  /* float x: in the block's weights */
                    for (int64_t g = 0; g < groups; g++) lift += m[r * groups + g] * xsum[(t0 + t) * groups + g];
                y[(t0 + t) * rows + r0 + r] = acc[r * N + t] + lift;
            }
    }
}

/* The units of every row, shared by the threads torch runs (one OpenMP runtime: torch.set_num_threads sets both). */
#define G32_ROWS_WIDE(NAME, FOUR_BITS) \
    static void NAME(const void *codes, const uint16_t *scale, const uint16_t *minimum, const float *x, \
                     const int8_t *xq, const float *e, const float *xsum, float *y, int64_t n, int64_t rows, \
                     int64_t cols) \
    { \
        const int64_t block = n == 1 ? 4 : FLOAT_ROWS, blocks = rows / block, units = blocks + rows % block; \
        _Pragma("omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)") \
        for (int64_t u = 0; u < units; u++) \
            g32_unit(codes, scale, minimum, x, xq, e, xsum, y, n, rows, cols, \
                     u < blocks ? u * block : blocks * block + (u - blocks), u < blocks ? block : 1, FOUR_BITS); \
    }
G32_ROWS_WIDE(q4_rows_wide, 1)
G32_ROWS_WIDE(q8_rows_wide, 0)
#undef G32_ROWS_WIDE

/* Eight rows' 16 bytes at codes (row_bytes apart) as four vectors of one row per 32-bit lane: v[k] lane r holds
 * bytes 4k to 4k + 3 of row r (a 4 x 4 transpose of 32-bit words in each 128-bit half). */
static inline void rows8_words(const uint8_t *codes, int64_t row_bytes, __m256i *v)
{
    __m256i a[4];
    for (int r = 0; r < 4; r++)
        a[r] = _mm256_loadu2_m128i((const __m128i *)(codes + (r + 4) * row_bytes), (const __m128i *)(codes + r * row_bytes));
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* One group of eight rows as unsigned bytes, one row per lane: w[k] holds inputs 4k to 4k + 3 of every row (x's
 * word k), w[4 + k] inputs 16 + 4k to 16 + 4k + 3 (word 4 + k). int8 codes are offset by 128 (rows8_int8 takes
 * 128 times the sum of x's codes off again). */
static inline void rows8_group(const uint8_t *codes, int64_t row_bytes, __m256i *w, const int four_bits)
{
    __m256i v[8];
    rows8_words(codes, row_bytes, v);
    if (four_bits) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (int k = 0; k < 4; k++)
            w[4 + k] = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), low), w[k] = _mm256_and_si256(v[k], low);
    } else {
        rows8_words(codes + 16, row_bytes, v + 4);
        for (int k = 0; k < 8; k++) w[k] = _mm256_xor_si256(v[k], _mm256_set1_epi8(-128));
    }
}

static inline __m256i word(const int8_t *p)  /* four bytes broadcast to every 32-bit lane */
{
    int32_t w;
    memcpy(&w, p, sizeof w);
    return _mm256_set1_epi32(w);
}

/* y[t][r] for rows r0 to r0 + 7 and N tokens on int8 x, one row per lane: each group's codes are laid out by
 * rows8_group once for the N tokens and every token's x words broadcast to the lanes, so a group's eight integer
 * sums come out in one vector, scaled by d * e and lifted by m * xsum at once (no horizontal sums). dT and mT
 * hold the eight rows' scales and minima group by group (g * 8 + r); psum the sums of x's codes (int8 codes). */
static inline __attribute__((always_inline)) void rows8_int8(const uint8_t *codes, int64_t row_bytes,
                                                             const float *dT, const float *mT, const int8_t *xq,
                                                             const float *e, const float *xsum, const int32_t *psum,
                                                             float *y, int64_t n, int64_t rows, int64_t groups,
                                                             const int N, const int four_bits)
{
    const int group_bytes = four_bits ? 16 : 32;
    const uint8_t *next = codes + PREFETCH_BLOCKS * 8 * row_bytes;
    __m256 sums[4];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < N; t++) sums[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (g * group_bytes % 64 == 0)
            for (int r = 0; r < 8; r++) _mm_prefetch((const char *)(next + r * row_bytes + g * group_bytes), _MM_HINT_T0);
        __m256i w[8];
        rows8_group(codes + g * group_bytes, row_bytes, w, four_bits);
        const __m256 dg = _mm256_loadu_ps(dT + 8 * g), mg = mT ? _mm256_loadu_ps(mT + 8 * g) : _mm256_setzero_ps();
        _Pragma("GCC unroll 4")
        for (int t = 0; t < N; t++) {
            const int8_t *xt = xq + (g * n + t) * G32;
            __m256i a = _mm256_setzero_si256(), b = a;
            _Pragma("GCC unroll 4")
            for (int k = 0; k < 4; k++) a = dot_add(a, w[k], word(xt + 4 * k)), b = dot_add(b, w[4 + k], word(xt + 16 + 4 * k));
            a = _mm256_add_epi32(a, b);
            if (!four_bits) a = _mm256_sub_epi32(a, _mm256_set1_epi32(128 * psum[g * n + t]));
            sums[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(dg, _mm256_broadcast_ss(e + g * n + t)), sums[t]);
            if (mT) sums[t] = _mm256_fmadd_ps(mg, _mm256_broadcast_ss(xsum + t * groups + g), sums[t]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < N; t++) _mm256_storeu_ps(y + t * rows, sums[t]);
}

/* Eight vectors as the columns of the 8 x 8 matrix they were the rows of. */
static inline void transpose8(__m256 *r)
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

/* Eight rows' fp16 values (each row's groups one after another) as floats group by group: out[g * 8 + r]; eight
 * groups at a time converted and transposed in registers. */
static void rows8_floats(const uint16_t *h, int64_t groups, float *out)
{
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i * groups + g)));
        transpose8(r);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + (g + i) * 8, r[i]);
    }
    for (; g < groups; g++)
        for (int r = 0; r < 8; r++) out[g * 8 + r] = half_to_float(h[r * groups + g]);
}

/* A group format on int8 x in units of eight rows (rows8_int8, the tokens in chunks of up to 4), the last rows % 8
 * one at a time (g32_unit). Takes 4-bit codes, and int8 codes where the CPU has VNNI (without it, an offset code
 * times x overflows maddubs' 16-bit pair sums). */
static void rows8_int8_wide(const void *codes, const uint16_t *scale, const uint16_t *minimum, const int8_t *xq,
                            const float *e, const float *xsum, const int32_t *psum, float *y, int64_t n, int64_t rows,
                            int64_t cols, const int four_bits)
{
    const int64_t groups = cols / G32, row_bytes = four_bits ? cols / 2 : cols, units = rows / 8;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t u = 0; u < units + rows % 8; u++) {
        if (u >= units) {
            g32_unit(codes, scale, minimum, NULL, xq, e, xsum, y, n, rows, cols, 8 * units + (u - units), 1, four_bits);
            continue;
        }
        float dT[8 * groups], mT[8 * groups];
        rows8_floats(scale + 8 * u * groups, groups, dT);
        if (minimum) rows8_floats(minimum + 8 * u * groups, groups, mT);
        const uint8_t *row = (const uint8_t *)codes + 8 * u * row_bytes;
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
#define ROWS8(NN) rows8_int8(row, row_bytes, dT, minimum ? mT : NULL, xq + t0 * G32, e + t0, xsum + t0 * groups, \
                             psum + t0, y + t0 * rows + 8 * u, n, rows, groups, NN, four_bits)
            TOKEN_CHUNK(ROWS8, n - t0 < 4 ? n - t0 : 4)
#undef ROWS8
        }
    }
}
#endif

static void int8_rows(const int8_t *restrict w, const float *restrict scale, const float *restrict x,
                      float *restrict y, int64_t n, int64_t rows, int64_t cols)
{
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *w0 = w + r * cols;
        for (int64_t t = 0; t < n; t++) {
            const float *xt = x + t * cols;
            float a0 = 0.0f;
            #pragma omp simd reduction(+:a0)
            for (int64_t i = 0; i < cols; i++) a0 += (float)w0[i] * xt[i];
            y[t * rows + r] = a0 * scale[r];
        }
    }
}

static void int4_rows(const int8_t *restrict packed, const float *restrict scale, const float *restrict x,
                      float *restrict y, int64_t n, int64_t rows, int64_t cols, int64_t group)
{
    const int64_t groups = cols / group;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t p = 0; p < rows / 2; p++) {
        float w0[cols], w1[cols];  /* one packed row dequantized (both output rows, one per thread): stays in L1 */
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
        for (int64_t t = 0; t < n; t++) {
            const float *xt = x + t * cols;
            float a0 = 0.0f, a1 = 0.0f;
            #pragma omp simd reduction(+:a0, a1)
            for (int64_t i = 0; i < cols; i++) {
                a0 += w0[i] * xt[i];
                a1 += w1[i] * xt[i];
            }
            y[t * rows + 2 * p] = a0, y[t * rows + 2 * p + 1] = a1;
        }
    }
}

#if !WIDE  /* AVX2 builds take the group formats' wide loops only */
/* The plain loops of the group formats: a row dequantized into an L1-resident buffer, then dotted with each x. */
static void q4g32_rows(const uint8_t *restrict codes, const uint16_t *restrict scale,
                       const uint16_t *restrict minimum, const float *restrict x, float *restrict y, int64_t n,
                       int64_t rows, int64_t cols)
{
    const int64_t groups = cols / G32;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t r = 0; r < rows; r++) {
        float w[cols];  /* one row dequantized (one per thread) */
        const uint8_t *row = codes + r * (cols / 2);
        for (int64_t g = 0; g < groups; g++) {
            const float d = half_to_float(scale[r * groups + g]), m = half_to_float(minimum[r * groups + g]);
            const uint8_t *b = row + g * 16;
            float *wg = w + g * G32;
            #pragma omp simd
            for (int64_t j = 0; j < 16; j++) {
                wg[j] = (float)(b[j] & 0x0f) * d + m;
                wg[j + 16] = (float)(b[j] >> 4) * d + m;
            }
        }
        one_row(w, x, y + r, n, rows, cols);
    }
}

static void q8g32_rows(const int8_t *restrict codes, const uint16_t *restrict scale, const float *restrict x,
                       float *restrict y, int64_t n, int64_t rows, int64_t cols)
{
    const int64_t groups = cols / G32;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t r = 0; r < rows; r++) {
        float w[cols];  /* one row dequantized (one per thread) */
        for (int64_t g = 0; g < groups; g++) {
            const float d = half_to_float(scale[r * groups + g]);
            const int8_t *q = codes + r * cols + g * G32;
            #pragma omp simd
            for (int64_t j = 0; j < G32; j++) w[g * G32 + j] = (float)q[j] * d;
        }
        one_row(w, x, y + r, n, rows, cols);
    }
}

/* The plain loop of both group formats on int8 x (int8_blocks' xq, e and xsum): each group's integer products summed,
 * the minimum term added per group. */
static void g32_rows_int8(const uint8_t *restrict codes, const uint16_t *restrict scale,
                          const uint16_t *restrict minimum, const int8_t *restrict xq, const float *restrict e,
                          const float *restrict xsum, float *restrict y, int64_t n, int64_t rows, int64_t cols,
                          int four_bits)
{
    const int64_t groups = cols / G32, row_bytes = four_bits ? cols / 2 : cols;
    #pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t r = 0; r < rows; r++) {
        int8_t q[cols];  /* one row's codes as signed bytes, 4-bit ones unpacked into input order */
        const uint8_t *row = codes + r * row_bytes;
        for (int64_t g = 0; g < groups; g++)
            for (int64_t j = 0; j < 16; j++) {
                if (four_bits) {
                    q[g * G32 + j] = (int8_t)(row[g * 16 + j] & 0x0f), q[g * G32 + j + 16] = (int8_t)(row[g * 16 + j] >> 4);
                } else {
                    q[g * G32 + j] = (int8_t)row[g * G32 + j], q[g * G32 + j + 16] = (int8_t)row[g * G32 + j + 16];
                }
            }
        for (int64_t t = 0; t < n; t++) {
            float a = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *qg = q + g * G32, *pg = xq + (g * n + t) * G32;
                int32_t sum = 0;
                #pragma omp simd reduction(+:sum)
                for (int64_t j = 0; j < G32; j++) sum += (int32_t)qg[j] * (int32_t)pg[j];
                a += half_to_float(scale[r * groups + g]) * e[g * n + t] * (float)sum;
                if (minimum) a += half_to_float(minimum[r * groups + g]) * xsum[t * groups + g];
            }
            y[t * rows + r] = a;
        }
    }
}

#endif

/* x (n, cols) as int8 per 32 inputs, group by group: codes xq (groups, n, 32), scales e and the codes' sums psum
 * (groups, n), each group's n tokens one after another; the lifts xsum = e * sum p per token (n, groups). */
static void int8_blocks(const float *restrict x, int8_t *restrict xq, float *restrict e, float *restrict xsum,
                        int32_t *restrict psum, int64_t n, int64_t cols)
{
    const int64_t groups = cols / G32;
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xb = x + t * cols + g * G32;
            int8_t *q = xq + (g * n + t) * G32;
            float most = 0.0f;
            for (int64_t j = 0; j < G32; j++) most = fmaxf(most, fabsf(xb[j]));
            const float eb = most * (1.0f / 127.0f), inverse = most > 0.0f ? 1.0f / eb : 0.0f;
            int32_t sum = 0;
            #pragma omp simd reduction(+:sum)
            for (int64_t j = 0; j < G32; j++) {
                const float p = nearbyintf(xb[j] * inverse);
                q[j] = (int8_t)(p > 127.0f ? 127.0f : p < -127.0f ? -127.0f : p);
                sum += q[j];
            }
            e[g * n + t] = eb, psum[g * n + t] = sum, xsum[t * groups + g] = eb * (float)sum;
        }
}

/* The group formats' int8-x path (xsum: scratch of n * cols / 32 floats). */
static void g32_int8_x(const void *codes, const uint16_t *scale, const uint16_t *minimum, const float *x, float *xsum,
                       float *y, int64_t n, int64_t rows, int64_t cols, int four_bits)
{
    int8_t xq[n * cols];
    float e[n * (cols / G32)];
    int32_t psum[n * (cols / G32)];
    int8_blocks(x, xq, e, xsum, psum, n, cols);
#if WIDE
    if (four_bits || VNNI) rows8_int8_wide(codes, scale, minimum, xq, e, xsum, psum, y, n, rows, cols, four_bits);
    else q8_rows_wide(codes, scale, minimum, NULL, xq, e, xsum, y, n, rows, cols);
#else
    g32_rows_int8(codes, scale, minimum, xq, e, xsum, y, n, rows, cols, four_bits);
#endif
}

void matvec_int8(const int8_t *restrict w, const float *restrict scale, const float *restrict x,
                 const float *restrict bias, float *restrict y, int64_t n, int64_t rows, int64_t cols)
{
#if WIDE
    if (cols % LANES == 0)
        dense_rows_wide(w, DENSE_INT8, scale, x, y, n, rows, cols);
    else
#endif
        int8_rows(w, scale, x, y, n, rows, cols);
    add_bias(bias, y, n, rows);
}

void matvec_int4(const int8_t *restrict packed, const float *restrict scale, const float *restrict x,
                 const float *restrict bias, float *restrict y, int64_t n, int64_t rows, int64_t cols, int64_t group)
{
#if WIDE
    if (group % LANES == 0)
        int4_rows_wide(packed, scale, x, y, n, rows, cols, group);
    else
#endif
        int4_rows(packed, scale, x, y, n, rows, cols, group);
    add_bias(bias, y, n, rows);
}

void matvec_q4g32(const uint8_t *restrict codes, const uint16_t *restrict scale, const uint16_t *restrict minimum,
                  const float *restrict x, const float *restrict bias, float *restrict y, int64_t n, int64_t rows,
                  int64_t cols, int64_t int8_x)
{
    if (int8_x) {
        float xsum[n * (cols / G32)];
        g32_int8_x(codes, scale, minimum, x, xsum, y, n, rows, cols, 1);
    } else {
#if WIDE
        q4_rows_wide(codes, scale, minimum, x, NULL, NULL, NULL, y, n, rows, cols);
#else
        q4g32_rows(codes, scale, minimum, x, y, n, rows, cols);
#endif
    }
    add_bias(bias, y, n, rows);
}

void matvec_q8g32(const int8_t *restrict codes, const uint16_t *restrict scale, const float *restrict x,
                  const float *restrict bias, float *restrict y, int64_t n, int64_t rows, int64_t cols,
                  int64_t int8_x)
{
    if (int8_x) {
        float xsum[n * (cols / G32)];
        g32_int8_x(codes, scale, NULL, x, xsum, y, n, rows, cols, 0);
    } else {
#if WIDE
        q8_rows_wide(codes, scale, NULL, x, NULL, NULL, NULL, y, n, rows, cols);
#else
        q8g32_rows(codes, scale, x, y, n, rows, cols);
#endif
    }
    add_bias(bias, y, n, rows);
}
