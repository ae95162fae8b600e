"""What speech costs an audio-language model on a target: the tokens of the seconds of speech a turn holds (counted
by the model's own processor, as the runtime counts them: Qwen2-Audio's 25 a second), the memory of the audio
encoder and of its output cache, and per KV dtype the KV of one turn's speech and the turns with speech that fit
beside the dialogue."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cabinllm.builders.dialogue_turns import MediaCost
from cabinllm.runtime.model.audio import AUDIO_FOLDER, FEATURE_CACHE_BYTES, AudioEncoder
from cabinllm.runtime.sources.hf_vision import is_audio_folder, encoder_parameters
from cabinllm.runtime.speech.audio import SAMPLE_RATE, Clip

SPEECH_SECONDS = 8.0  # a spoken request in the cabin, per turn
AUDIO_BYTES_PER_PARAMETER = 2  # the encoder runs in fp16 on the board


@dataclass(frozen=True)
class AudioCost(MediaCost):
    """The tokens of a turn's speech and what the audio part holds in memory."""

    seconds: float  # of speech per turn
    tokens: int
    encoder_weight_bytes: int
    feature_cache_bytes: int
    request_tokens: int  # the most audio rows one request may hold: clips per message x a full encoder window

    @property
    def memory_bytes(self) -> int:
        """Memory the audio part takes beside the text model: its weights and the encoder's output cache."""
        return self.encoder_weight_bytes + self.feature_cache_bytes

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {**asdict(self), "memory_bytes": self.memory_bytes}


def audio_cost(model: str, seconds: float = SPEECH_SECONDS) -> AudioCost | None:
    """The speech costs of an HF audio-language folder or an engine built from one (None for any other model):
    ``seconds`` of speech per turn, counted by the processor (a clip longer than the encoder's window counts as
    that many windows' clips)."""
    folder = Path(model)
    folder = folder / AUDIO_FOLDER if is_audio_folder(folder / AUDIO_FOLDER) else folder
    if not is_audio_folder(folder):
        return None
    encoder = AudioEncoder(folder)
    window = encoder.window_seconds
    pieces = [window] * int(seconds // window) + ([seconds % window] if seconds % window else [])
    tokens = sum(encoder.prepare(Clip.from_pcm(np.zeros(round(s * SAMPLE_RATE), np.float32), "speech")).tokens
                 for s in pieces)
    full = encoder.prepare(Clip.from_pcm(np.zeros(round(window * SAMPLE_RATE), np.float32), "speech")).tokens
    return AudioCost(seconds, tokens, encoder_parameters(folder) * AUDIO_BYTES_PER_PARAMETER, FEATURE_CACHE_BYTES,
                     encoder.limits.max_clips * full)
