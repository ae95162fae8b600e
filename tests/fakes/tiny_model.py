"""A tiny random Llama saved as an HF folder (config.json, model.safetensors, tokenizer files), without transformers.

Its tokenizer knows a few words (the default), or every byte (``byte_tokens``: a byte-level BPE without merges, so
any text, JSON included, can be written token by token)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

WORDS = "navigate to the nearest charging station set cabin temperature play some jazz what does light mean".split()
SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024}


def write_tiny_llama(folder: Path, seed: int = 0, byte_tokens: bool = False, layer_std: float = 0.3,
                     **shape: int) -> Path:
    """Write the tiny model (``SHAPE``, with any key overridden by ``shape``) into ``folder`` and return it; its
    layers' projections have standard deviation ``layer_std`` (small: a calm model, whose replies survive
    quantization noise)."""
    folder.mkdir(parents=True, exist_ok=True)
    shape = {**SHAPE, **shape}
    words = sorted(pre_tokenizers.ByteLevel.alphabet()) if byte_tokens else WORDS
    vocab = {token: i for i, token in enumerate(SPECIAL + words)}
    gen = torch.Generator().manual_seed(seed)
    h, inter, heads, kv_heads = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                    "num_key_value_heads"))
    d = h // heads

    def rand(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": rand(len(vocab), h), "model.norm.weight": 1 + rand(h),
               "lm_head.weight": rand(len(vocab), h)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        weights.update({
            f"{p}.input_layernorm.weight": 1 + rand(h), f"{p}.post_attention_layernorm.weight": 1 + rand(h),
            f"{p}.self_attn.q_proj.weight": rand(heads * d, h, std=layer_std), f"{p}.self_attn.k_proj.weight": rand(kv_heads * d, h, std=layer_std),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * d, h, std=layer_std), f"{p}.self_attn.o_proj.weight": rand(h, heads * d, std=layer_std),
            f"{p}.mlp.gate_proj.weight": rand(inter, h, std=layer_std), f"{p}.mlp.up_proj.weight": rand(inter, h, std=layer_std),
            f"{p}.mlp.down_proj.weight": rand(h, inter, std=layer_std),
        })
    save_file(weights, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": len(vocab), "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, **shape}
    (folder / "config.json").write_text(json.dumps(config))
    if byte_tokens:
        tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    tok_config = {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder
