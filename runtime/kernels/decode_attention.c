/* Decode attention of one token straight from a paged KV cache, in the cache's element type.
 *
 * One call covers one layer. The history is cut into runs of whole blocks (RUN_TOKENS tokens or the nearest
 * number of blocks above), and a run is one unit of work: every query head's scores against the run's keys (one
 * pass over them), their maximum m, p = exp(score - m) and its sum l, and the values weighted by p (one pass over the
 * run's values). The runs' results are then combined per query head as flash-decoding does:
 * out = v_scale * sum_r exp(m_r - M) o_r / sum_r exp(m_r - M) l_r, M the largest m_r. Elements
 * are read from their blocks and converted on the fly; nothing is gathered or dequantized into a copy of the
 * history. Query head j reads KV head j / GROUP.
 * A static INT8 cache's K scale and 1/sqrt(head_size) come in as qk_scale, its V scale as v_scale.
 * A per-token INT8 cache also passes its fp16 scales per token and KV head (blocks,
 * tokens_per_block, kv_heads) as k_token_scales and v_token_scales; they are NULL otherwise.
 *
 * Compiled per element type and model with -DELEMENT=... (int8_t, float, or uint16_t with
 * -DHALF_ELEMENTS for fp16 bits), -DHEAD_SIZE=... and -DGROUP=... (query heads per KV head), so
 * the inner loops have fixed lengths.
 * Pools are one layer's (blocks, tokens_per_block, kv_heads, HEAD_SIZE) tensors.
 * A long history's runs are split over the OpenMP threads torch runs. The runs do not depend on the thread count
 * and each is computed by one thread in the same order, so the results do not either. With AVX2 and FMA
 * (x86-64) both loops take vec.h's vectors (16 lanes with AVX-512, 8 with AVX2): the scores of 8 tokens are summed at
 * once (8 independent sums, added across lanes together) and the query heads of a KV head share each key and value
 * converted to floats as far as the registers hold their sums; other CPUs, head sizes that are no multiple of the
 * lanes and builds with -DGENERIC take the plain loops. The rows read next are prefetched AHEAD tokens on.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "vec.h"

#define PARALLEL_TOKENS 256  /* histories at least this long are split over the OpenMP threads */
#define RUN_TOKENS 128  /* tokens of a run, rounded up to whole blocks */
#define PARTIAL (HEAD_SIZE + 2)  /* floats of a query head's result over one run: o, then m and l */

#ifdef HALF_ELEMENTS
#define TO_FLOAT(x) half_to_float(x)
#else
#define TO_FLOAT(x) ((float)(x))
#endif
#define MIN(a, b) ((a) < (b) ? (a) : (b))

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

/* The scale of a key or value: the cache's static one, times its token's where the cache has per-token scales. */
static inline float token_scale(const uint16_t *token_scales, int64_t t, int64_t kv_heads, int64_t h, float scale)
{
    return token_scales ? scale * half_to_float(token_scales[t * kv_heads + h]) : scale;
}

/* Blocks of a run. */
static inline int64_t run_blocks(int64_t tokens_per_block)
{
    return (RUN_TOKENS + tokens_per_block - 1) / tokens_per_block;
}

/* Floats of scratch a call needs for a history of num_tokens: each unit's partial results. */
int64_t decode_attention_scratch(int64_t num_tokens, int64_t tokens_per_block, int64_t kv_heads)
{
    const int64_t per_run = run_blocks(tokens_per_block) * tokens_per_block;
    return (num_tokens + per_run - 1) / per_run * kv_heads * GROUP * PARTIAL;
}

#if WIDE && HEAD_SIZE % LANES == 0
#define WIDE_ATTENTION 1
#define SPAN 8  /* tokens whose scores are summed together */
/* Vector registers the loops keep sums in: AVX-512 gives 32, AVX2 16. The query heads of a KV head share each key and
 * value converted to floats: as many as the sums fit (HEADS_AT_ONCE of the GROUP for the scores, all of them over
 * CHUNK channels for the values; a KV head's 3 on AVX-512: each row converted once, not once per query head). */
#if LANES == 16
#define SUM_REGISTERS 24
#else
#define SUM_REGISTERS 12
#endif
#define HEADS_AT_ONCE MIN(GROUP, (SUM_REGISTERS / SPAN > 0 ? SUM_REGISTERS / SPAN : 1))

static inline vf load_lanes(const ELEMENT *p)  /* LANES elements as floats */
{
#if defined(HALF_ELEMENTS)
    return vf_half(p);
#elif defined(INT8_ELEMENTS)
    return vf_int8(p);
#else
    return vf_load(p);
#endif
}

/* Lane t: the sum of a[t]'s lanes (SPAN vectors): halves, then quarters of the vectors added pairwise across them. */
static inline __m256 span_sums(const vf *a)
{
#if LANES == 16
    __m512 t[4], u[2];
    for (int p = 0; p < 4; p++)  /* a[2p]'s halves added in the low 256 bits, a[2p + 1]'s in the high */
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
    for (int p = 0; p < 2; p++)  /* 128-bit quarter k: token 4p + k's four partial sums */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0xdd));
    __m512 v = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xdd));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));  /* quarter k: token k's sum in lane 0, token 4 + k's in 2 */
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8,
                                                                         4, 0), v));
#else
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
#endif
}
#else
#define WIDE_ATTENTION 0
#endif

#define AHEAD 16  /* tokens ahead whose rows are prefetched (the hardware prefetcher alone leaves the loops waiting) */

/* The row of token j of a block of n (first row at p; past its end, the next block's, from next: NULL for none) into
 * the cache, row elements of it. */
static inline void prefetch_row(const ELEMENT *p, const ELEMENT *next, int64_t j, int64_t n, int64_t row)
{
#if WIDE
    const ELEMENT *at = j < n ? p + j * row : next ? next + (j - n) * row : NULL;
    if (at)
        for (int64_t i = 0; i < row * (int64_t)sizeof(ELEMENT); i += 64) _mm_prefetch((const char *)at + i, _MM_HINT_T0);
#else
    (void)p, (void)next, (void)j, (void)n, (void)row;
#endif
}

/* Scores of a KV head's query heads q (GROUP, HEAD_SIZE) against a block's n keys (k: the head's key in the block's
 * first row, rows `row` elements apart): s[g * stride + t], times qk_scale and the token's scale. With next (the
 * first row of the block read after this one; given with KV head 0 only, whose k is its rows' start) the whole row
 * AHEAD tokens on is prefetched as each token is read. */
static void block_scores(const float *restrict q, const ELEMENT *restrict k, const ELEMENT *next,
                         const uint16_t *restrict token_scales, int64_t n, int64_t row, int64_t kv_heads, int64_t h,
                         float qk_scale, float *restrict s, int64_t stride)
{
    int64_t t0 = 0;
#if WIDE_ATTENTION
    for (; t0 + SPAN <= n; t0 += SPAN) {
        if (next)
            for (int t = 0; t < SPAN; t++) prefetch_row(k, next, t0 + t + AHEAD, n, row);
        float scale[SPAN];
        for (int t = 0; t < SPAN; t++) scale[t] = token_scale(token_scales, t0 + t, kv_heads, h, qk_scale);
        const __m256 scale_v = _mm256_loadu_ps(scale);
        for (int g0 = 0; g0 < GROUP; g0 += HEADS_AT_ONCE) {
            const int heads = MIN(HEADS_AT_ONCE, GROUP - g0);
            vf a[HEADS_AT_ONCE][SPAN];
            for (int g = 0; g < heads; g++)
                for (int t = 0; t < SPAN; t++) a[g][t] = vf_zero();
            for (int i = 0; i < HEAD_SIZE; i += LANES)
                _Pragma("GCC unroll 8")
                for (int t = 0; t < SPAN; t++) {
                    const vf key = load_lanes(k + (t0 + t) * row + i);
                    _Pragma("GCC unroll 8")
                    for (int g = 0; g < heads; g++)
                        a[g][t] = vf_fmadd(key, vf_load(q + (g0 + g) * HEAD_SIZE + i), a[g][t]);
                }
            for (int g = 0; g < heads; g++)
                _mm256_storeu_ps(s + (g0 + g) * stride + t0, _mm256_mul_ps(span_sums(a[g]), scale_v));
        }
    }
#endif
    for (int64_t t = t0; t < n; t++) {
        if (next) prefetch_row(k, next, t + AHEAD, n, row);
        const ELEMENT *kt = k + t * row;
        const float scale = token_scale(token_scales, t, kv_heads, h, qk_scale);
        float key[HEAD_SIZE];
        for (int i = 0; i < HEAD_SIZE; i++) key[i] = TO_FLOAT(kt[i]);
        for (int g = 0; g < GROUP; g++) {
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int i = 0; i < HEAD_SIZE; i++) dot += q[g * HEAD_SIZE + i] * key[i];
            s[g * stride + t] = dot * scale;
        }
    }
}

/* o[g] += sum_t p[g * stride + t] v_t over a block's n values (v: the head's value in the block's first row; next
 * as for block_scores). */
static void block_values(const float *restrict p, const ELEMENT *restrict v, const ELEMENT *next, int64_t n,
                         int64_t row, int64_t stride, float *restrict o)
{
#if WIDE_ATTENTION
    enum { CHUNK = LANES * MIN(HEAD_SIZE / LANES, SUM_REGISTERS / GROUP > 0 ? SUM_REGISTERS / GROUP : 1) };
    for (int c0 = 0; c0 < HEAD_SIZE; c0 += CHUNK) {
        const int width = MIN(HEAD_SIZE - c0, CHUNK) / LANES;
        vf a[GROUP][CHUNK / LANES];
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < width; c++) a[g][c] = vf_load(o + g * PARTIAL + c0 + LANES * c);
        for (int64_t t = 0; t < n; t++) {
            if (c0 == 0 && next) prefetch_row(v, next, t + AHEAD, n, row);
            _Pragma("GCC unroll 8")
            for (int c = 0; c < width; c++) {
                const vf value = load_lanes(v + t * row + c0 + LANES * c);
                _Pragma("GCC unroll 8")
                for (int g = 0; g < GROUP; g++) a[g][c] = vf_fmadd(vf_set1(p[g * stride + t]), value, a[g][c]);
            }
        }
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < width; c++) vf_store(o + g * PARTIAL + c0 + LANES * c, a[g][c]);
    }
#else
    (void)next;  /* the plain loops leave prefetching to the hardware */
    for (int g = 0; g < GROUP; g++)
        for (int64_t t = 0; t < n; t++) {
            const float w = p[g * stride + t];
            const ELEMENT *vt = v + t * row;
            #pragma omp simd
            for (int i = 0; i < HEAD_SIZE; i++) o[g * PARTIAL + i] += w * TO_FLOAT(vt[i]);
        }
#endif
}

/* The blocks [b0, b1) of the table: each query head's o (the values weighted by p), m and l into partial
 * (kv_heads * GROUP, PARTIAL). Tokens before ``first`` are left out; a run with none left has m = -inf, l = 0. The
 * KV heads take turns over each block (in L1 after the first), the first one prefetching the rows read next: the next
 * block's, else the run's first values (after its last keys) or the next run's first keys (after its last values). */
static void attend_run(const float *q, const ELEMENT *k_pool, const ELEMENT *v_pool, const uint16_t *k_token_scales,
                       const uint16_t *v_token_scales, const int64_t *block_table, int64_t b0, int64_t b1,
                       int64_t num_tokens, int64_t first, int64_t tokens_per_block, int64_t kv_heads, float qk_scale,
                       float *partial)
{
    const int64_t row = kv_heads * HEAD_SIZE, start = b0 * tokens_per_block, heads = kv_heads * GROUP;
    const int64_t n = MIN(b1 * tokens_per_block, num_tokens) - start;
    const int64_t blocks = (num_tokens + tokens_per_block - 1) / tokens_per_block;
    float s[heads * n];  /* scores, then p times the token's V scale */
    for (int64_t b = b0; b < b1; b++) {
        const int64_t count = tokens_in_block(b * tokens_per_block, num_tokens, tokens_per_block);
        const ELEMENT *k = k_pool + block_table[b] * tokens_per_block * row;
        const ELEMENT *next = (b + 1 < b1 ? k_pool + block_table[b + 1] * tokens_per_block * row
                                          : v_pool + block_table[b0] * tokens_per_block * row);
        for (int64_t h = 0; h < kv_heads; h++)
            block_scores(q + h * GROUP * HEAD_SIZE, k + h * HEAD_SIZE, h == 0 ? next : NULL,
                         block_scales(k_token_scales, block_table[b], tokens_per_block, kv_heads), count, row,
                         kv_heads, h, qk_scale, s + h * GROUP * n + (b - b0) * tokens_per_block, n);
    }
    const int64_t skip = first > start ? MIN(first - start, n) : 0;  /* the window's start inside this run */
    for (int64_t j = 0; j < heads; j++) {
        float *sj = s + j * n, max = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < skip; t++) sj[t] = 0.0f;
        for (int64_t t = skip; t < n; t++) max = sj[t] > max ? sj[t] : max;
        if (skip < n) {
            #pragma omp simd reduction(+:sum)
            for (int64_t t = skip; t < n; t++) {
                sj[t] = expf(sj[t] - max);
                sum += sj[t];
            }
        }
        partial[j * PARTIAL + HEAD_SIZE] = max, partial[j * PARTIAL + HEAD_SIZE + 1] = sum;
        memset(partial + j * PARTIAL, 0, sizeof(float) * HEAD_SIZE);
    }
    if (v_token_scales)
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *scales = block_scales(v_token_scales, block_table[b0 + t / tokens_per_block],
                                                  tokens_per_block, kv_heads);
            for (int64_t j = 0; j < heads; j++) s[j * n + t] *= token_scale(scales, t % tokens_per_block, kv_heads,
                                                                            j / GROUP, 1.0f);
        }
    for (int64_t b = b0; b < b1; b++) {
        const int64_t count = tokens_in_block(b * tokens_per_block, num_tokens, tokens_per_block);
        const ELEMENT *v = v_pool + block_table[b] * tokens_per_block * row;
        const ELEMENT *next = (b + 1 < b1 ? v_pool + block_table[b + 1] * tokens_per_block * row
                               : b1 < blocks ? k_pool + block_table[b1] * tokens_per_block * row : NULL);
        for (int64_t h = 0; h < kv_heads; h++)
            block_values(s + h * GROUP * n + (b - b0) * tokens_per_block, v + h * HEAD_SIZE, h == 0 ? next : NULL,
                         count, row, n, partial + h * GROUP * PARTIAL);
    }
}

/* q: (kv_heads * GROUP, HEAD_SIZE); scratch of decode_attention_scratch(num_tokens, ...) floats;
 * out: (kv_heads * GROUP, HEAD_SIZE). The table's tokens before ``first`` are not attended to (a sliding window's
 * start inside its first block). */
void decode_attention(const float *q, const ELEMENT *k_pool, const ELEMENT *v_pool,
                      const uint16_t *k_token_scales, const uint16_t *v_token_scales,
                      const int64_t *block_table, int64_t num_tokens, int64_t first, int64_t tokens_per_block,
                      int64_t kv_heads, float qk_scale, float v_scale, float *scratch, float *out)
{
    const int64_t per_run = run_blocks(tokens_per_block), blocks = (num_tokens + tokens_per_block - 1) / tokens_per_block;
    const int64_t runs = (blocks + per_run - 1) / per_run, heads = kv_heads * GROUP;
    #pragma omp parallel for schedule(static) if (num_tokens >= PARALLEL_TOKENS)
    for (int64_t r = 0; r < runs; r++)
        attend_run(q, k_pool, v_pool, k_token_scales, v_token_scales, block_table, r * per_run,
                   MIN((r + 1) * per_run, blocks), num_tokens, first, tokens_per_block, kv_heads, qk_scale,
                   scratch + r * heads * PARTIAL);
    for (int64_t j = 0; j < heads; j++) {  /* query head j's runs combined */
        float most = -INFINITY, total = 0.0f, *o = out + j * HEAD_SIZE;
        for (int64_t r = 0; r < runs; r++) most = fmaxf(most, scratch[(r * heads + j) * PARTIAL + HEAD_SIZE]);
        memset(o, 0, sizeof(float) * HEAD_SIZE);
        for (int64_t r = 0; r < runs; r++) {
            const float *partial = scratch + (r * heads + j) * PARTIAL;
            if (partial[HEAD_SIZE + 1] == 0.0f) continue;  /* a run before the window */
            const float weight = expf(partial[HEAD_SIZE] - most);
            total += weight * partial[HEAD_SIZE + 1];
            #pragma omp simd
            for (int i = 0; i < HEAD_SIZE; i++) o[i] += weight * partial[i];
        }
        const float norm = v_scale / total;
        #pragma omp simd
        for (int i = 0; i < HEAD_SIZE; i++) o[i] *= norm;
    }
}
