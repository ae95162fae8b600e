/* Dequantizes a sequence's INT4 blocks of one layer into fp32 K and V, as runtime.kv_int4 defines them.
 *
 * Keys: one fp16 scale and zero per block, KV head and channel. Values: one fp16 scale and zero per
 * token, KV head and group of VALUE_GROUP channels. Codes hold two channels per byte, the even channel
 * in the low nibble. x = code * scale + zero.
 *
 * Compiled per model with -DHEAD_SIZE=... -DVALUE_GROUP=... . Inputs are one layer's pools:
 * codes (blocks, tokens_per_block, kv_heads, HEAD_SIZE / 2), key scales and zeros
 * (blocks, kv_heads, HEAD_SIZE), value scales and zeros (blocks, tokens_per_block, kv_heads,
 * HEAD_SIZE / VALUE_GROUP). Outputs are (num_blocks, tokens_per_block, kv_heads, HEAD_SIZE), in
 * block-table order.
 */
#include <stdint.h>

#include "half.h"

#define HALF (HEAD_SIZE / 2)
#define GROUPS (HEAD_SIZE / VALUE_GROUP)

static void keys_of_block(const uint8_t *restrict codes, const uint16_t *restrict scale,
                          const uint16_t *restrict zero, int64_t tokens_per_block, int64_t kv_heads,
                          float *restrict out)
{
    for (int64_t h = 0; h < kv_heads; h++) {
        float s[HEAD_SIZE], z[HEAD_SIZE];
        for (int i = 0; i < HEAD_SIZE; i++) {
            s[i] = half_to_float(scale[h * HEAD_SIZE + i]);
            z[i] = half_to_float(zero[h * HEAD_SIZE + i]);
        }
        for (int64_t t = 0; t < tokens_per_block; t++) {
            const uint8_t *c = codes + (t * kv_heads + h) * HALF;
            float *o = out + (t * kv_heads + h) * HEAD_SIZE;
            for (int i = 0; i < HALF; i++) {
                o[2 * i] = (float)(c[i] & 15) * s[2 * i] + z[2 * i];
                o[2 * i + 1] = (float)(c[i] >> 4) * s[2 * i + 1] + z[2 * i + 1];
            }
        }
    }
}

static void values_of_block(const uint8_t *restrict codes, const uint16_t *restrict scale,
                            const uint16_t *restrict zero, int64_t rows, float *restrict out)
{
    for (int64_t r = 0; r < rows; r++) {  /* one row per token and KV head */
        for (int g = 0; g < GROUPS; g++) {
            const float s = half_to_float(scale[r * GROUPS + g]), z = half_to_float(zero[r * GROUPS + g]);
            const uint8_t *c = codes + r * HALF + g * (VALUE_GROUP / 2);
            float *o = out + r * HEAD_SIZE + g * VALUE_GROUP;
            for (int i = 0; i < VALUE_GROUP / 2; i++) {
                o[2 * i] = (float)(c[i] & 15) * s + z;
                o[2 * i + 1] = (float)(c[i] >> 4) * s + z;
            }
        }
    }
}

void int4_dequantize(const uint8_t *k_codes, const uint16_t *k_scale, const uint16_t *k_zero,
                     const uint8_t *v_codes, const uint16_t *v_scale, const uint16_t *v_zero,
                     const int64_t *block_table, int64_t num_blocks, int64_t tokens_per_block, int64_t kv_heads,
                     float *k_out, float *v_out)
{
    const int64_t rows = tokens_per_block * kv_heads;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t block = block_table[b];
        keys_of_block(k_codes + block * rows * HALF, k_scale + block * kv_heads * HEAD_SIZE,
                      k_zero + block * kv_heads * HEAD_SIZE, tokens_per_block, kv_heads,
                      k_out + b * rows * HEAD_SIZE);
        values_of_block(v_codes + block * rows * HALF, v_scale + block * rows * GROUPS,
                        v_zero + block * rows * GROUPS, rows, v_out + b * rows * HEAD_SIZE);
    }
}
