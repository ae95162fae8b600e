"""Qwen2-Audio: a Qwen2 text model (plain RoPE: a clip's tokens take consecutive positions) fed by a Whisper-style
encoder (``audio_tower``: conv stride 2 then average pool 2 over 100 mel frames a second, 25 rows a second of
speech) through ``multi_modal_projector``; the processor writes ``<|audio_bos|><|AUDIO|>*N<|audio_eos|>``.

Qwen2.5-Omni's thinker would take the same path for its audio (the same encoder shape and 25 rows a second through
the processor's ``<|AUDIO|>`` expansion), but it places audio on M-RoPE positions with time-aligned ids
(``get_rope_index`` interleaving audio and video by 2 s chunks) and its folder holds a talker and token2wav beside
the thinker; Qwen2-Audio came first because its text model is plain Qwen2, which every CabinLLM backend runs, and
transformers builds it from a small config offline.
"""
from __future__ import annotations

from cabinllm.runtime.model.families.family import AudioFamily, AudioLanguage

AUDIO_LANGUAGE = AudioLanguage(
    "Qwen2AudioForConditionalGeneration", "qwen2",
    AudioFamily("qwen2_audio", "audio_token", ("input_features", "feature_attention_mask"),
                ("audio_tower.", "multi_modal_projector."), tokens_per_second=25.0))
