/* One decode step of n sequences (one token each) through every layer in a single call: the decode path of
 * runtime/model/transformer.py (Transformer.step), with no Python or torch work between the layer's parts. The
 * linear ops take the n tokens at once (the weights read once per step), the rest runs per token.
 *
 * Per layer: RMS norm, the qkv product, where the model has them RMS norms of each query and key head (Qwen3's
 * q_norm / k_norm), RoPE (GPT-NeoX halves of the first ``rotary`` channels) on the query and key heads, the new
 * token's K and V stored at its slot of the layer's pools (int8: round(x / scale) clamped to +-127 as
 * runtime/kv_quant.py does; fp16: rounded to nearest even; fp32 as is), attention over the sequence's
 * blocks (decode_attention.c, the new token included), the dense product added to the residual, RMS
 * norm, act(fc) * gate (act: SiLU, GELU or its tanh form), and the proj product added to the residual.
 * Each linear op is one of the
 * formats of runtime/quant_linear.py, run by the kernels of matvec.c and quant_matvec.c.
 *
 * Compiled per element type, head size and group like decode_attention.c (-DELEMENT, -DHEAD_SIZE,
 * -DGROUP, -DHALF_ELEMENTS), which it includes with the linear kernels, so one library holds the step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_attention.c"
#include "matvec.c"
#include "quant_matvec.c"

enum { WEIGHTS_FP32 = 0, WEIGHTS_FP16 = 1, WEIGHTS_INT8 = 2, WEIGHTS_INT4 = 3, WEIGHTS_Q4G32 = 4, WEIGHTS_Q4G32_INT8_X = 5 };
enum { ACT_SILU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2 };

/* The MLP's activation of x, as torch computes silu, gelu and gelu(approximate="tanh"). */
static float activation(float x, int64_t act)
{
    if (act == ACT_SILU) return x / (1.0f + expf(-x));
    if (act == ACT_GELU) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

/* One linear op, y = W x + b; int4: W is packed (rows / 2, cols) and x is multiplied by prequant first; q4g32: scale
 * and minimum are fp16 per 32 inputs (q4g32 int8 x: x rounded to int8 per 32 inputs, as quant_matvec.c's int8_x). */
typedef struct {
    int64_t kind, rows, cols, group;  /* kind: a WEIGHTS_* code */
    const void *weight, *scale;
    const float *prequant, *bias;
    const uint16_t *minimum;
} LinearOp;

typedef struct {
    const float *input_norm, *post_norm;
    LinearOp qkv, dense, fc, gate, proj;
    const float *q_norm, *k_norm;  /* (HEAD_SIZE,) each, or NULL: no norm of the heads */
} LayerWeights;

/* y (n, rows) = x (n, cols) W^T + b; scaled_x holds n rows of the widest input. */
static void run_linear(const LinearOp *op, const float *x, float *y, float *scaled_x, int64_t n)
{
    switch (op->kind) {
    case WEIGHTS_FP32:
        matvec(op->weight, x, op->bias, y, n, op->rows, op->cols);
        break;
    case WEIGHTS_FP16:
        matvec_half(op->weight, x, op->bias, y, n, op->rows, op->cols);
        break;
    case WEIGHTS_INT8:
        matvec_int8(op->weight, op->scale, x, op->bias, y, n, op->rows, op->cols);
        break;
    case WEIGHTS_Q4G32:
    case WEIGHTS_Q4G32_INT8_X:
        matvec_q4g32(op->weight, op->scale, op->minimum, x, op->bias, y, n, op->rows, op->cols,
                     op->kind == WEIGHTS_Q4G32_INT8_X);
        break;
    default:
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < op->cols; i++) scaled_x[t * op->cols + i] = x[t * op->cols + i] * op->prequant[i];
        matvec_int4(op->weight, op->scale, scaled_x, op->bias, y, n, op->rows, op->cols, op->group);
    }
}

static void rms_norm(const float *restrict x, const float *restrict weight, float eps, int64_t n, float *restrict out)
{
    float sum = 0.0f;
    #pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(sum / (float)n + eps);
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inverse * weight[i];
}

/* Normalizes each head of x (heads, HEAD_SIZE) in place by the RMS of its channels, times weight. */
static void head_norms(float *restrict x, const float *restrict weight, float eps, int64_t heads)
{
    for (int64_t h = 0; h < heads; h++, x += HEAD_SIZE) {
        float sum = 0.0f;
        for (int i = 0; i < HEAD_SIZE; i++) sum += x[i] * x[i];
        const float inverse = 1.0f / sqrtf(sum / (float)HEAD_SIZE + eps);
        for (int i = 0; i < HEAD_SIZE; i++) x[i] = x[i] * inverse * weight[i];
    }
}

/* Rotates the first ``rotary`` channels of each head of x (heads, HEAD_SIZE) in place: x * cos + (-x[half:],
 * x[:half]) * sin with half = rotary / 2; the other channels pass. */
static void rope(float *restrict x, const float *restrict cos, const float *restrict sin, int64_t heads,
                 int64_t rotary)
{
    const int64_t half = rotary / 2;
    for (int64_t h = 0; h < heads; h++, x += HEAD_SIZE) {
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* The new token's K or V (n values) into its slot, in the pool's element type. */
static void store(ELEMENT *restrict slot, const float *restrict x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++) {
#if defined(HALF_ELEMENTS)
        slot[i] = float_to_half(x[i]);
        (void)scale;
#elif defined(INT8_ELEMENTS)
        const float q = nearbyintf(x[i] / scale);
        slot[i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
#else
        slot[i] = x[i];
        (void)scale;
#endif
    }
}

/* x (n, hidden): each sequence's new token's embedding in, its last hidden state out. k_pools / v_pools: (layers,
 * blocks, tokens_per_block, kv_heads, HEAD_SIZE); k_scales / v_scales: each layer's static INT8 scales (1 for float
 * pools); cos / sin (n, rotary): the RoPE rows of each token's position; block_tables: the sequences' tables one
 * after another, sequence t's from tables_start[t]; slots[t]: its token's flat slot in a layer's pool;
 * num_tokens[t]: its sequence's tokens, this one included. Returns 0, or -1 (nothing done) when the work buffers
 * cannot be allocated. */
int decode_step(const LayerWeights *layers, int64_t num_layers, float *x, int64_t n, int64_t hidden,
                int64_t kv_heads, int64_t intermediate, int64_t act, float eps, const float *cos, const float *sin,
                int64_t rotary, ELEMENT *k_pools, ELEMENT *v_pools, int64_t layer_elements, const float *k_scales,
                const float *v_scales, const int64_t *block_tables, const int64_t *tables_start,
                const int64_t *slots, const int64_t *num_tokens, int64_t tokens_per_block)
{
    const int64_t heads = kv_heads * GROUP, q_size = heads * HEAD_SIZE, kv_size = kv_heads * HEAD_SIZE;
    const int64_t qkv_size = q_size + 2 * kv_size, widest = hidden > intermediate ? hidden : intermediate;
    int64_t longest = 0;
    for (int64_t t = 0; t < n; t++) longest = num_tokens[t] > longest ? num_tokens[t] : longest;
    float *work = malloc(sizeof(float) * (n * (2 * hidden + qkv_size + q_size + 2 * intermediate + widest)
                                          + decode_attention_scratch(longest, tokens_per_block, kv_heads)));
    if (!work) return -1;
    float *h = work, *qkv = h + n * hidden, *attended = qkv + n * qkv_size, *fc = attended + n * q_size;
    float *gate = fc + n * intermediate, *branch = gate + n * intermediate, *scaled_x = branch + n * hidden;
    float *partials = scaled_x + n * widest;  /* decode_attention's scratch */
    const float inverse_sqrt = 1.0f / sqrtf((float)HEAD_SIZE);
    for (int64_t l = 0; l < num_layers; l++) {
        const LayerWeights *layer = layers + l;
        ELEMENT *k_pool = k_pools + l * layer_elements, *v_pool = v_pools + l * layer_elements;
        for (int64_t t = 0; t < n; t++) rms_norm(x + t * hidden, layer->input_norm, eps, hidden, h + t * hidden);
        run_linear(&layer->qkv, h, qkv, scaled_x, n);
        for (int64_t t = 0; t < n; t++) {
            float *mine = qkv + t * qkv_size;
            if (layer->q_norm) {
                head_norms(mine, layer->q_norm, eps, heads);
                head_norms(mine + q_size, layer->k_norm, eps, kv_heads);
            }
            rope(mine, cos + t * rotary, sin + t * rotary, heads + kv_heads, rotary);
            store(k_pool + slots[t] * kv_size, mine + q_size, kv_size, k_scales[l]);
            store(v_pool + slots[t] * kv_size, mine + q_size + kv_size, kv_size, v_scales[l]);
        }
        for (int64_t t = 0; t < n; t++)  /* after every token's K/V is stored; each reads its own sequence */
            decode_attention(qkv + t * qkv_size, k_pool, v_pool, NULL, NULL, block_tables + tables_start[t],
                             num_tokens[t], 0, tokens_per_block, kv_heads, k_scales[l] * inverse_sqrt, v_scales[l],
                             partials, attended + t * q_size);
        run_linear(&layer->dense, attended, branch, scaled_x, n);
        for (int64_t i = 0; i < n * hidden; i++) x[i] += branch[i];
        for (int64_t t = 0; t < n; t++) rms_norm(x + t * hidden, layer->post_norm, eps, hidden, h + t * hidden);
        run_linear(&layer->fc, h, fc, scaled_x, n);
        run_linear(&layer->gate, h, gate, scaled_x, n);
        for (int64_t i = 0; i < n * intermediate; i++) fc[i] = activation(fc[i], act) * gate[i];
        run_linear(&layer->proj, fc, branch, scaled_x, n);
        for (int64_t i = 0; i < n * hidden; i++) x[i] += branch[i];
    }
    free(work);
    return 0;
}
