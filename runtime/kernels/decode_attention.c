/* Decode attention of one token straight from a paged KV cache, in the cache's element type.
 *
 * One call covers one layer: the scores of every query head against every cached key (one pass over
 * K, token rows in order), a softmax per head, and the weighted sum of the cached values (one pass
 * over V). Query head j reads KV head j / GROUP. Elements are read from their blocks and
 * converted on the fly; nothing is gathered or dequantized into a copy of the history.
 * A static INT8 cache's K scale and 1/sqrt(head_size) come in as qk_scale, its V scale as v_scale.
 * A per-token INT8 cache also passes its fp16 scales per token and KV head (blocks,
 * tokens_per_block, kv_heads) as k_token_scales and v_token_scales; they are NULL otherwise.
 *
 * Compiled per element type and model with -DELEMENT=... (int8_t, float, or uint16_t with
 * -DHALF_ELEMENTS for fp16 bits), -DHEAD_SIZE=... and -DGROUP=... (query heads per KV head), so
 * the inner loops have fixed lengths.
 * Pools are one layer's (blocks, tokens_per_block, kv_heads, HEAD_SIZE) tensors.
 * A long history is split over the OpenMP threads torch runs: the scores by blocks, the values by KV heads; each
 * score and each head's sum is computed by one thread in the same order, so the results do not depend on the
 * thread count. With AVX2 and FMA (x86-64) the scores of 8 tokens are summed at once (8 independent sums, added
 * across lanes together), each head's weighted values stay in registers over the history, and the query heads of a
 * KV head share each key and value converted to floats as far as the registers hold their sums; other CPUs, head
 * sizes that are no multiple of 8 and builds with -DGENERIC take the plain loops.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

#define PARALLEL_TOKENS 256  /* histories at least this long are split over the OpenMP threads */

#ifdef HALF_ELEMENTS
#define TO_FLOAT(x) half_to_float(x)
#else
#define TO_FLOAT(x) ((float)(x))
#endif

/* How many of a block's tokens, from token `start` of the sequence on, are among its num_tokens. */
static inline int64_t tokens_in_block(int64_t start, int64_t num_tokens, int64_t tokens_per_block)
{
    return num_tokens - start < tokens_per_block ? num_tokens - start : tokens_per_block;
}

/* A block's per-token scales (tokens_per_block, kv_heads), or NULL where the cache has none. */
static inline const uint16_t *block_scales(const uint16_t *scales, int64_t block, int64_t tokens_per_block,
                                           int64_t kv_heads)
{
    return scales ? scales + block * tokens_per_block * kv_heads : NULL;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(GENERIC) && HEAD_SIZE % 8 == 0
#include <immintrin.h>
#define WIDE_ATTENTION 1
#define SPAN 8    /* tokens whose scores are summed together */
#define AHEAD 16  /* tokens ahead whose rows are prefetched (the hardware prefetcher alone leaves the loops waiting) */
/* Vector registers the loops keep sums in: AVX-512 gives 32 (ymm0-31), AVX2 16. The query heads of a KV head share each
 * key and value converted to floats: as many as the sums fit (HEADS_AT_ONCE of the GROUP for the scores, all of them
 * over CHUNK channels for the values; a KV head's 3 on AVX-512: each row converted once, not once per query head). */
#if defined(__AVX512VL__) && !defined(NO_AVX512)
#define SUM_REGISTERS 24
#else
#define SUM_REGISTERS 12
#endif
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define HEADS_AT_ONCE MIN(GROUP, (SUM_REGISTERS / SPAN > 0 ? SUM_REGISTERS / SPAN : 1))
#define CHUNK (8 * MIN(HEAD_SIZE / 8, (SUM_REGISTERS / GROUP > 0 ? SUM_REGISTERS / GROUP : 1)))  /* channels at once */

static inline __m256 load8(const ELEMENT *p)  /* eight elements as floats */
{
#if defined(HALF_ELEMENTS)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif defined(INT8_ELEMENTS)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return _mm256_loadu_ps(p);
#endif
}

/* The row AHEAD tokens after token t of block b (in a later block where that is past this one's end): what the
 * loops prefetch. Past the history's last block it points beyond it, which a prefetch never faults on. */
static inline const char *row_ahead(const ELEMENT *pool, const int64_t *block_table, int64_t b, int64_t blocks,
                                    int64_t t, int64_t tokens_per_block, int64_t row)
{
    t += AHEAD;
    while (t >= tokens_per_block && b + 1 < blocks) b++, t -= tokens_per_block;
    return (const char *)(pool + (block_table[b] * tokens_per_block + t) * row);
}

/* Lane t: the sum of a[t]'s eight lanes. */
static inline __m256 lane_sums(const __m256 *a)
{
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
#else
#define WIDE_ATTENTION 0
#endif

/* The scale of a key or value: the cache's static one, times its token's where the cache has per-token scales. */
static inline float token_scale(const uint16_t *token_scales, int64_t t, int64_t kv_heads, int64_t h, float scale)
{
    return token_scales ? scale * half_to_float(token_scales[t * kv_heads + h]) : scale;
}

/* Scores of every query head against tokens [from, n) of one block (k: its first token's row), one at a time. */
static void block_scores(const float *restrict q, const ELEMENT *restrict k, const uint16_t *restrict token_scales,
                         int64_t from, int64_t n, int64_t kv_heads, float qk_scale, float *restrict out,
                         int64_t num_tokens)
{
    for (int64_t t = from; t < n; t++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const ELEMENT *kt = k + (t * kv_heads + h) * HEAD_SIZE;
            const float scale = token_scale(token_scales, t, kv_heads, h, qk_scale);
            float key[HEAD_SIZE];
            for (int i = 0; i < HEAD_SIZE; i++) key[i] = TO_FLOAT(kt[i]);
            for (int g = 0; g < GROUP; g++) {
                const float *qg = q + (h * GROUP + g) * HEAD_SIZE;
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int i = 0; i < HEAD_SIZE; i++) dot += qg[i] * key[i];
                out[(h * GROUP + g) * num_tokens + t] = dot * scale;
            }
        }
    }
}

/* Scores of every query head against each cached key, token rows read in order (one pass over K). */
static void scores(const float *restrict q, const ELEMENT *restrict k_pool, const uint16_t *restrict k_token_scales,
                   const int64_t *restrict block_table, int64_t num_tokens, int64_t tokens_per_block,
                   int64_t kv_heads, float qk_scale, float *restrict out)
{
    const int64_t row = kv_heads * HEAD_SIZE, blocks = (num_tokens + tokens_per_block - 1) / tokens_per_block;
    #pragma omp parallel for schedule(static) if (num_tokens >= PARALLEL_TOKENS)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * tokens_per_block, n = tokens_in_block(start, num_tokens, tokens_per_block);
        const ELEMENT *k = k_pool + block_table[b] * tokens_per_block * row;
        const uint16_t *token_scales = block_scales(k_token_scales, block_table[b], tokens_per_block, kv_heads);
        int64_t t0 = 0;
#if WIDE_ATTENTION
        for (; t0 + SPAN <= n; t0 += SPAN) {
            for (int64_t i = 0; i < SPAN * row * (int64_t)sizeof(ELEMENT); i += 64)
                _mm_prefetch(row_ahead(k_pool, block_table, b, blocks, t0, tokens_per_block, row) + i, _MM_HINT_T0);
            for (int64_t h = 0; h < kv_heads; h++) {
                const ELEMENT *kt = k + (t0 * kv_heads + h) * HEAD_SIZE;
                float scale[SPAN];
                for (int t = 0; t < SPAN; t++) scale[t] = token_scale(token_scales, t0 + t, kv_heads, h, qk_scale);
                const __m256 scale_v = _mm256_loadu_ps(scale);
                for (int g0 = 0; g0 < GROUP; g0 += HEADS_AT_ONCE) {
                    const int heads = MIN(HEADS_AT_ONCE, GROUP - g0);
                    const float *qg = q + (h * GROUP + g0) * HEAD_SIZE;
                    __m256 a[HEADS_AT_ONCE][SPAN];
                    for (int g = 0; g < heads; g++)
                        for (int t = 0; t < SPAN; t++) a[g][t] = _mm256_setzero_ps();
                    for (int i = 0; i < HEAD_SIZE; i += 8)
                        _Pragma("GCC unroll 8")
                        for (int t = 0; t < SPAN; t++) {
                            const __m256 key = load8(kt + t * row + i);
                            _Pragma("GCC unroll 8")
                            for (int g = 0; g < heads; g++)
                                a[g][t] = _mm256_fmadd_ps(key, _mm256_loadu_ps(qg + g * HEAD_SIZE + i), a[g][t]);
                        }
                    for (int g = 0; g < heads; g++)
                        _mm256_storeu_ps(out + (h * GROUP + g0 + g) * num_tokens + start + t0,
                                         _mm256_mul_ps(lane_sums(a[g]), scale_v));
                }
            }
        }
#endif
        block_scores(q, k, token_scales, t0, n, kv_heads, qk_scale, out + start, num_tokens);
    }
}

/* Turns each row of scores into softmax weights times v_scale. */
static void softmax_rows(float *restrict scores, int64_t rows, int64_t num_tokens, float v_scale)
{
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * num_tokens, max = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < num_tokens; t++) max = s[t] > max ? s[t] : max;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < num_tokens; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        const float weight = v_scale / sum;
        #pragma omp simd
        for (int64_t t = 0; t < num_tokens; t++) s[t] *= weight;
    }
}

/* Weighted sum of the cached values for every query head, token rows read in order (one pass over V per query
 * head; each KV head's slice of it by one thread). */
static void weighted_values(const float *restrict weights, const ELEMENT *restrict v_pool,
                            const uint16_t *restrict v_token_scales, const int64_t *restrict block_table,
                            int64_t num_tokens, int64_t tokens_per_block,
                            int64_t kv_heads, float *restrict out)
{
    const int64_t row = kv_heads * HEAD_SIZE;
#if WIDE_ATTENTION
    const int64_t blocks = (num_tokens + tokens_per_block - 1) / tokens_per_block;
#endif
    #pragma omp parallel for schedule(static) if (num_tokens >= PARALLEL_TOKENS)
    for (int64_t h = 0; h < kv_heads; h++) {
#if WIDE_ATTENTION
        const float *w = weights + h * GROUP * num_tokens;
        for (int c0 = 0; c0 < HEAD_SIZE; c0 += CHUNK) {
            const int width = (HEAD_SIZE - c0 < CHUNK ? HEAD_SIZE - c0 : CHUNK) / 8;
            __m256 a[GROUP][CHUNK / 8];
            for (int g = 0; g < GROUP; g++)
                for (int c = 0; c < CHUNK / 8; c++) a[g][c] = _mm256_setzero_ps();
            for (int64_t start = 0, b = 0; start < num_tokens; start += tokens_per_block, b++) {
                const int64_t n = tokens_in_block(start, num_tokens, tokens_per_block);
                const ELEMENT *v = v_pool + block_table[b] * tokens_per_block * row + h * HEAD_SIZE + c0;
                const uint16_t *scales = block_scales(v_token_scales, block_table[b], tokens_per_block, kv_heads);
                for (int64_t t = 0; t < n; t++, v += row) {
                    _mm_prefetch(row_ahead(v_pool, block_table, b, blocks, t, tokens_per_block, row) +
                                 (h * HEAD_SIZE + c0) * (int64_t)sizeof(ELEMENT), _MM_HINT_T0);
                    const float scale = token_scale(scales, t, kv_heads, h, 1.0f);
                    _Pragma("GCC unroll 8")
                    for (int c = 0; c < width; c++) {
                        const __m256 value = load8(v + 8 * c);
                        _Pragma("GCC unroll 8")
                        for (int g = 0; g < GROUP; g++)
                            a[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[g * num_tokens + start + t] * scale), value,
                                                      a[g][c]);
                    }
                }
            }
            for (int g = 0; g < GROUP; g++)
                for (int c = 0; c < width; c++) _mm256_storeu_ps(out + (h * GROUP + g) * HEAD_SIZE + c0 + 8 * c, a[g][c]);
        }
#else
        for (int g = 0; g < GROUP; g++) {
            const float *w = weights + (h * GROUP + g) * num_tokens;
            float *acc = out + (h * GROUP + g) * HEAD_SIZE;
            memset(acc, 0, sizeof(float) * HEAD_SIZE);
            for (int64_t start = 0, b = 0; start < num_tokens; start += tokens_per_block, b++) {
                const int64_t n = tokens_in_block(start, num_tokens, tokens_per_block);
                const ELEMENT *v = v_pool + block_table[b] * tokens_per_block * row + h * HEAD_SIZE;
                const uint16_t *scales = block_scales(v_token_scales, block_table[b], tokens_per_block, kv_heads);
                for (int64_t t = 0; t < n; t++, v += row) {
                    const float p = w[start + t] * token_scale(scales, t, kv_heads, h, 1.0f);
                    #pragma omp simd
                    for (int i = 0; i < HEAD_SIZE; i++) acc[i] += p * TO_FLOAT(v[i]);
                }
            }
        }
#endif
    }
}

/* q: (kv_heads * GROUP, HEAD_SIZE); scratch of (kv_heads * GROUP, num_tokens);
 * out: (kv_heads * GROUP, HEAD_SIZE). The table's tokens before ``first`` are not attended to (a sliding window's
 * start inside its first block). */
void decode_attention(const float *q, const ELEMENT *k_pool, const ELEMENT *v_pool,
                      const uint16_t *k_token_scales, const uint16_t *v_token_scales,
                      const int64_t *block_table, int64_t num_tokens, int64_t first, int64_t tokens_per_block,
                      int64_t kv_heads, float qk_scale, float v_scale, float *scratch, float *out)
{
    const int64_t rows = kv_heads * GROUP;
    scores(q, k_pool, k_token_scales, block_table, num_tokens, tokens_per_block, kv_heads, qk_scale, scratch);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < first; t++) scratch[r * num_tokens + t] = -INFINITY;
    softmax_rows(scratch, rows, num_tokens, v_scale);
    weighted_values(scratch, v_pool, v_token_scales, block_table, num_tokens, tokens_per_block, kv_heads, out);
}
