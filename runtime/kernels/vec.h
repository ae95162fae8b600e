/* The float vector of the linear kernels' wide loops (matvec.c, quant_matvec.c): 16 lanes where the CPU has AVX-512,
 * else AVX2's 8 (-DNO_AVX512 builds those, as for an AVX2-only CPU). WIDE is 0 without AVX2, FMA and F16C and in
 * builds with -DGENERIC: there the plain loops run. A step of several tokens is bound by the multiply-adds, one per
 * weight per token, and an instruction does LANES of them.
 *
 * The blocks of rows these loops take keep their sums in registers: R rows and a chunk of N tokens (BLOCK_SHAPES,
 * TOKEN_CHUNK), both constants where a block is inlined, in arrays of a fixed size (R * N <= MAX_SUMS). A
 * variable-length array, even of a size constant after inlining, stays on the stack, and each sum went through
 * memory.
 */
#ifndef CABIN_VEC_H
#define CABIN_VEC_H
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(GENERIC)
#include <immintrin.h>
#define WIDE 1
#define MAX_SUMS 16

static inline float sum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256i widen8(const int8_t *p)  /* eight int8 -> eight int32 lanes */
{
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(NO_AVX512)
#define LANES 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vf_int8(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vf_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#else
#define LANES 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_sum(vf v) { return sum8(v); }
static inline vf vf_int8(const int8_t *p) { return _mm256_cvtepi32_ps(widen8(p)); }
static inline vf vf_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* Rows of a block for several tokens: with AVX-512's 32 registers the sums of 4 rows and 4 tokens stay in registers
 * (each x then serves 4 rows); AVX2's 16 hold 2 rows' (one token: 4 rows either way). */
#define FLOAT_ROWS (LANES == 16 ? 4 : 2)

/* CALL(N) with N the constant size of a chunk of 1 to 4 tokens. */
#define TOKEN_CHUNK(CALL, size) \
    switch (size) { \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    default: CALL(4); \
    }

/* BLOCK(R, N) with both constant, for the blocks the loops take: 4 rows for one token, FLOAT_ROWS for a chunk of N
 * tokens (1 to 4), a single row at the end. */
#define BLOCK_SHAPES(BLOCK) \
    switch (N) { \
    case 1: if (R == 4) { BLOCK(4, 1); } else if (R == FLOAT_ROWS) { BLOCK(FLOAT_ROWS, 1); } else { BLOCK(1, 1); } break; \
    case 2: if (R == FLOAT_ROWS) { BLOCK(FLOAT_ROWS, 2); } else { BLOCK(1, 2); } break; \
    case 3: if (R == FLOAT_ROWS) { BLOCK(FLOAT_ROWS, 3); } else { BLOCK(1, 3); } break; \
    default: if (R == FLOAT_ROWS) { BLOCK(FLOAT_ROWS, 4); } else { BLOCK(1, 4); } \
    }
#else
#define WIDE 0
#endif
#endif
