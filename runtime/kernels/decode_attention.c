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
 * thread count.
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
        for (int64_t t = 0; t < n; t++) {
            for (int64_t h = 0; h < kv_heads; h++, k += HEAD_SIZE) {
                const float scale = token_scales ? qk_scale * half_to_float(token_scales[t * kv_heads + h]) : qk_scale;
                float key[HEAD_SIZE];
                for (int i = 0; i < HEAD_SIZE; i++) key[i] = TO_FLOAT(k[i]);
                for (int g = 0; g < GROUP; g++) {
                    const float *qg = q + (h * GROUP + g) * HEAD_SIZE;
                    float dot = 0.0f;
                    #pragma omp simd reduction(+:dot)
                    for (int i = 0; i < HEAD_SIZE; i++) dot += qg[i] * key[i];
                    out[(h * GROUP + g) * num_tokens + start + t] = dot * scale;
                }
            }
        }
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

/* Weighted sum of the cached values for every query head, token rows read in order (one pass over V; each KV
 * head's slice of it by one thread). */
static void weighted_values(const float *restrict weights, const ELEMENT *restrict v_pool,
                            const uint16_t *restrict v_token_scales, const int64_t *restrict block_table,
                            int64_t num_tokens, int64_t tokens_per_block,
                            int64_t kv_heads, float *restrict out)
{
    const int64_t row = kv_heads * HEAD_SIZE;
    memset(out, 0, sizeof(float) * kv_heads * GROUP * HEAD_SIZE);
    #pragma omp parallel for schedule(static) if (num_tokens >= PARALLEL_TOKENS)
    for (int64_t h = 0; h < kv_heads; h++) {
        for (int64_t start = 0, b = 0; start < num_tokens; start += tokens_per_block, b++) {
            const int64_t n = tokens_in_block(start, num_tokens, tokens_per_block);
            const ELEMENT *v = v_pool + block_table[b] * tokens_per_block * row + h * HEAD_SIZE;
            const uint16_t *token_scales = block_scales(v_token_scales, block_table[b], tokens_per_block, kv_heads);
            for (int64_t t = 0; t < n; t++, v += row) {
                const float scale = token_scales ? half_to_float(token_scales[t * kv_heads + h]) : 1.0f;
                for (int g = 0; g < GROUP; g++) {
                    const float p = weights[(h * GROUP + g) * num_tokens + start + t] * scale;
                    float *acc = out + (h * GROUP + g) * HEAD_SIZE;
                    #pragma omp simd
                    for (int i = 0; i < HEAD_SIZE; i++) acc[i] += p * TO_FLOAT(v[i]);
                }
            }
        }
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
