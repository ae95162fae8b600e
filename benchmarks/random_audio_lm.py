"""Random-weight audio-language models (Qwen2-Audio) saved as complete offline HF folders, for the tests. Random
weights prove mechanics (placeholders, encoder rows, cache reuse, logits against transformers), never answers.

``write_random_audio_lm(folder)`` writes what a Hub folder holds: ``config.json`` and ``model.safetensors`` (a
randomly initialised ``Qwen2AudioForConditionalGeneration``, ``save_pretrained``), the tokenizer (byte-level, with
Qwen2-Audio's special tokens and its processor's own chat template) and the processor's files (a
``WhisperFeatureExtractor`` of 80 mel bins over 30 s windows: no download), so that
``AutoProcessor.from_pretrained(folder)`` and ``Qwen2AudioForConditionalGeneration.from_pretrained(folder)`` work
from the folder alone.

The shape follows transformers' own test (tests/models/qwen2_audio/test_modeling_qwen2_audio.py): text hidden 32,
2 layers; audio d_model 16, 2 layers, 80 mel bins; adjusted where a test needs it: a SwiGLU text MLP whose
intermediate size is a multiple of 32 (grouped quantization), a context of 4096 positions, and the encoder's 1500
source positions of the real model (the feature extractor pads every clip to 30 s = 3000 mel frames, which conv
stride 2 makes 1500 positions and the pool 750: 25 tokens a second of speech). ``TEXT_SHAPES`` are larger text
models for the benchmarks, on the default model's tokenizer (``tokenizer_json``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from cabinllm.benchmarks.random_vlm import MAX_POSITIONS, byte_tokenizer

SPECIAL = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>", "<|endoftext|>"]
EOS = "<|im_end|>"
CONFIG = {
    "text_config": {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
                    "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": False,
                    "use_sliding_window": False},
    "audio_config": {"model_type": "qwen2_audio_encoder", "d_model": 16, "encoder_layers": 2,
                     "encoder_attention_heads": 4, "encoder_ffn_dim": 16, "num_mel_bins": 80,
                     "max_source_positions": 1500},
    "tie_word_embeddings": False,
}
TEXT_SHAPES = {
    # the KV shape of Qwen2-1.5B (28 layers, 2 KV heads of 128: 28 KiB a token at fp16) on a narrow residual stream
    # (256) so that a CPU runs it: the media compaction study, where 64 MiB hold 2,340 tokens, about 9 spoken turns
    "qwen2-1.5b-kv": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 28,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
}


def write_random_audio_lm(folder: Path, seed: int = 0, text_shape: str = "",
                          tokenizer_json: Path | None = None) -> Path:
    """Write a random Qwen2-Audio into ``folder`` as an HF folder (weights, tokenizer, processor); returns it. Its text
    model is the tiny one, or ``TEXT_SHAPES[text_shape]``; its tokenizer bytes, or that of ``tokenizer_json``."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    template = transformers.Qwen2AudioProcessor.default_chat_template.fget(None)
    tokenizer = byte_tokenizer(SPECIAL, EOS, template, tokenizer_json)
    data = json.loads(json.dumps(CONFIG))
    data["text_config"].update(TEXT_SHAPES[text_shape] if text_shape else {})
    data["text_config"].update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                               eos_token_id=tokenizer.eos_token_id)
    config = transformers.Qwen2AudioConfig(**data, audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model.save_pretrained(folder)
    features = transformers.WhisperFeatureExtractor(feature_size=80)
    transformers.Qwen2AudioProcessor(features, tokenizer, chat_template=template).save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    tok_config = json.loads(path.read_text(encoding="utf-8"))
    tok_config.update(chat_template=template, stop_token_ids=[tokenizer.eos_token_id],
                      processor_class="Qwen2AudioProcessor")
    path.write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    return folder
