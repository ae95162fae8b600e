"""Speech for the voice tests: sentences spoken by espeak-ng (tests that need it skip where it is missing), streams of
commands between silences, WAV files of any shape."""
from __future__ import annotations

import io
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from cabinllm.runtime.speech.audio import SAMPLE_RATE, Clip, read_wav, to_s16le

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (apt-get install "
                                                                            "espeak-ng) to speak test sentences")


def wav_bytes(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    """16-bit PCM WAV of float ``samples`` ((n,) or (n, channels)) at ``rate``."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(to_s16le(np.asarray(samples, dtype=np.float32).reshape(-1)))
    return out.getvalue()


def speak_wav(text: str, path: Path, voice: str = "en-us", words_per_minute: int = 175) -> Path:
    """``text`` spoken by espeak-ng into the WAV file ``path`` (22.05 kHz, as espeak-ng writes it)."""
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(path), text], check=True,
                   timeout=60)
    return path


def spoken(text: str, folder: Path, voice: str = "en-us", words_per_minute: int = 175) -> Clip:
    """``text`` spoken by espeak-ng as a 16 kHz clip."""
    return read_wav(speak_wav(text, folder / "spoken.wav", voice, words_per_minute).read_bytes(), text)


def command_stream(texts: list[str], silences: list[float], folder: Path,
                   words_per_minute: int = 175) -> tuple[bytes, list[tuple[float, float]]]:
    """Raw 16-bit 16 kHz mono PCM of ``texts`` spoken one after another, silence ``silences[i]`` seconds after the
    i-th (and 0.5 s before the first); and the (start, end) seconds of each command's clip in the stream."""
    parts, spans, at = [np.zeros(SAMPLE_RATE // 2, dtype=np.float32)], [], 0.5
    for text, silence in zip(texts, silences):
        clip = spoken(text, folder, words_per_minute=words_per_minute)
        parts += [clip.pcm, np.zeros(int(silence * SAMPLE_RATE), dtype=np.float32)]
        spans.append((at, at + clip.seconds))
        at += clip.seconds + int(silence * SAMPLE_RATE) / SAMPLE_RATE
    return to_s16le(np.concatenate(parts)), spans
