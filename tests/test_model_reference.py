"""Our forward pass against Hugging Face transformers' LlamaForCausalLM on the same weights."""
import pytest
import torch

from runtime.checkpoint import layer_prefix, load_checkpoint
from runtime.engine import CHECKPOINT_DIR
from runtime.generate import generate
from runtime.kv_cache import PagedKVCache
from runtime.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


def hf_model_from_checkpoint(folder):
    """A transformers LlamaForCausalLM holding exactly our checkpoint's weights, in fp32."""
    config, weights = load_checkpoint(folder)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_size,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_epsilon,
        rope_theta=config.rotary_base, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_config).float().eval()
    q, kv = config.num_attention_heads * config.head_size, config.kv_channels
    state = {"model.embed_tokens.weight": weights["transformer.vocab_embedding.weight"],
             "model.norm.weight": weights["transformer.ln_f.weight"], "lm_head.weight": weights["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        p, h = layer_prefix(i), f"model.layers.{i}"
        state[f"{h}.self_attn.q_proj.weight"], state[f"{h}.self_attn.k_proj.weight"], \
            state[f"{h}.self_attn.v_proj.weight"] = weights[f"{p}.attention.qkv.weight"].split([q, kv, kv])
        state[f"{h}.self_attn.o_proj.weight"] = weights[f"{p}.attention.dense.weight"]
        state[f"{h}.mlp.gate_proj.weight"] = weights[f"{p}.mlp.fc.weight"]
        state[f"{h}.mlp.up_proj.weight"] = weights[f"{p}.mlp.gate.weight"]
        state[f"{h}.mlp.down_proj.weight"] = weights[f"{p}.mlp.proj.weight"]
        state[f"{h}.input_layernorm.weight"] = weights[f"{p}.input_layernorm.weight"]
        state[f"{h}.post_attention_layernorm.weight"] = weights[f"{p}.post_layernorm.weight"]
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


@pytest.fixture(scope="module")
def hf_model(default_engine_dir):
    return hf_model_from_checkpoint(default_engine_dir / CHECKPOINT_DIR)


@pytest.fixture(scope="module")
def prompt_256(default_engine):
    tok = default_engine.tokenizer
    messages = [{"role": "system", "content": "You are the in-car assistant."}]
    ids: list[int] = []
    turn = 0
    while len(ids) < 256:
        messages.append({"role": "user", "content": f"Question {turn}: how do I pair my phone over Bluetooth, "
                                                    "and can you also lower the fan speed a little?"})
        ids = tok.encode(tok.render(messages))
        turn += 1
    return ids[:256]


def test_logits_match_transformers_on_256_tokens(default_engine, hf_model, prompt_256):
    cache = default_engine.new_cache("fp32", 32 << 20, tokens_per_block=16)
    cache.allocate(0, prompt_256)
    ours = default_engine.model.forward(prompt_256, 0, cache, 0, all_logits=True)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt_256])).logits[0]
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-3, f"max abs logits diff {diff}"


def test_64_greedy_tokens_match_transformers(default_engine, hf_model, prompt_256):
    prompt = prompt_256[:100]
    cache = default_engine.new_cache("fp32", 32 << 20)
    params = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=[])
    ours = generate(default_engine.model, cache, 0, prompt, params, default_engine.tokenizer.decode_reply)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == out[0, len(prompt):].tolist()
