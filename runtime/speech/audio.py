"""Audio as every voice path takes it: 16 kHz mono float32 PCM, identified by the digest of the decoded samples.

WAV files (integer PCM, any rate and channel count: mixed down to mono, resampled to 16 kHz with a polyphase
filter) and raw 16-bit little-endian PCM at 16 kHz mono are read; other formats are refused by name, as are empty,
corrupt and over-long clips (``AudioLimits``). The digest is of the decoded 16 kHz samples, so the same speech sent
as another file (another header, another container) is the same clip.
"""
from __future__ import annotations

import hashlib
import io
import wave
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path

import numpy as np

from cabinllm.runtime.errors import AudioError, Fix, Hint

SAMPLE_RATE = 16_000
MIN_SECONDS = 0.1
RATES = (1_000, 192_000)  # sample rates read: resampling an odd rate far beyond these would take gigabytes
RAW_SUFFIXES = (".raw", ".pcm")  # files read as raw 16-bit little-endian 16 kHz mono PCM


@dataclass
class AudioLimits:
    """Caps on what one message may send: seconds per clip, clips per message."""

    max_seconds: float = field(default=60.0, metadata={"help": "longest clip one message may send, in seconds"})
    max_clips: int = field(default=4, metadata={"help": "most clips in one message"})


@dataclass
class Clip:
    """One clip of speech: ``pcm`` float32 mono samples at 16 kHz in [-1, 1], its ``digest`` (sha256 of the
    16-bit samples) and the ``name`` the user gave it."""

    pcm: np.ndarray
    digest: bytes
    name: str = ""

    @property
    def seconds(self) -> float:
        """Length in seconds."""
        return len(self.pcm) / SAMPLE_RATE

    @classmethod
    def from_pcm(cls, pcm: np.ndarray, name: str) -> "Clip":
        """A clip of float32 16 kHz mono samples, its digest taken from them as 16-bit integers."""
        pcm = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
        return cls(pcm, hashlib.sha256(to_s16le(pcm)).digest(), name)


def to_s16le(pcm: np.ndarray) -> bytes:
    """Float samples in [-1, 1] as 16-bit little-endian PCM bytes."""
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def check_length(clip: Clip, limits: AudioLimits) -> Clip:
    """The clip, or AudioError where it is too short to hold speech or longer than ``limits.max_seconds``."""
    if clip.seconds < MIN_SECONDS:
        raise AudioError(f"{clip.name}: {clip.seconds:.2f} s of audio holds no speech; send at least "
                         f"{MIN_SECONDS} s")
    if clip.seconds > limits.max_seconds:
        raise too_long(clip.name, clip.seconds, limits)
    return clip


def too_long(name: str, seconds: float, limits: AudioLimits) -> AudioError:
    """The error of a clip of ``seconds`` over ``limits.max_seconds``."""
    return AudioError(f"{name}: {seconds:.1f} s of audio is over the {limits.max_seconds:g} s a clip may take; cut it "
                      "into shorter clips", (Hint(Fix.SHORTER_AUDIO, f"{limits.max_seconds:g} s"),))


def read_pcm(data: bytes, name: str, limits: AudioLimits | None = None) -> Clip:
    """Raw 16-bit little-endian mono PCM at 16 kHz as a clip (checked against ``limits``)."""
    if len(data) % 2:
        raise AudioError(f"{name}: raw PCM must be 16-bit samples (an even number of bytes), got {len(data)} bytes")
    pcm = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    return check_length(Clip.from_pcm(pcm, name), limits or AudioLimits())


def read_wav(data: bytes, name: str, limits: AudioLimits | None = None) -> Clip:
    """A WAV file's bytes as a 16 kHz mono clip; AudioError naming the file and the fix for another format, a
    corrupt or truncated file, an empty or over-long clip."""
    limits = limits or AudioLimits()
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        kind = sniff_format(data)
        raise AudioError(f"{name}: {kind} is not a WAV file; send 16-bit PCM WAV (e.g. `sox {name} -r 16000 -c 1 "
                         "-b 16 out.wav`)")
    try:
        with wave.open(io.BytesIO(data)) as wav:
            channels, width, rate, frames = (wav.getnchannels(), wav.getsampwidth(), wav.getframerate(),
                                             wav.getnframes())
            raw = wav.readframes(frames)
    except (wave.Error, EOFError, RuntimeError) as err:  # RuntimeError: a chunk that claims more bytes than follow
        raise AudioError(f"{name}: not a readable PCM WAV ({err}); send 16-bit PCM WAV (e.g. `sox {name} -r 16000 "
                         "-c 1 -b 16 out.wav`)") from err
    if width not in (1, 2, 4) or not channels or not rate:
        raise AudioError(f"{name}: {8 * width}-bit WAV samples are not read; send 16-bit PCM WAV")
    if not RATES[0] <= rate <= RATES[1]:
        raise AudioError(f"{name}: a sample rate of {rate:,} Hz is not read; send 16-bit PCM WAV at 16 kHz (any rate "
                         f"from {RATES[0]:,} to {RATES[1]:,} Hz is resampled)")
    usable = len(raw) // (width * channels) * width * channels
    if usable < frames * width * channels:
        raise AudioError(f"{name}: the WAV file is cut short ({len(raw)} of {frames * width * channels} bytes of "
                         "samples); send the whole file")
    samples = np.frombuffer(raw[:usable], dtype={1: np.uint8, 2: "<i2", 4: "<i4"}[width]).astype(np.float32)
    samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(2 ** (8 * width - 1))
    pcm = samples.reshape(-1, channels).mean(axis=1)
    if len(pcm) > rate * limits.max_seconds:  # refuse before resampling a long clip
        raise too_long(name, len(pcm) / rate, limits)
    return check_length(Clip.from_pcm(resample(pcm, rate), name), limits)


def read_clips(paths: list[str | Path], limits: AudioLimits | None = None) -> list[Clip]:
    """Clips of audio files (WAV; ``.raw`` / ``.pcm``: raw 16-bit 16 kHz mono PCM), named by their file names;
    AudioError naming one that cannot be read or taken."""
    clips = []
    for path in map(Path, paths):
        try:
            data = path.read_bytes()
        except OSError as err:
            raise AudioError(f"{path}: cannot read the audio ({err.strerror}); check the path") from err
        read = read_pcm if path.suffix.lower() in RAW_SUFFIXES else read_wav
        clips.append(read(data, path.name, limits))
    return clips


def resample(pcm: np.ndarray, rate: int) -> np.ndarray:
    """Samples at ``rate`` as samples at 16 kHz (scipy's polyphase filter)."""
    if rate == SAMPLE_RATE:
        return pcm
    from scipy.signal import resample_poly

    g = gcd(rate, SAMPLE_RATE)
    return resample_poly(pcm, SAMPLE_RATE // g, rate // g).astype(np.float32)


def sniff_format(data: bytes) -> str:
    """What audio container some bytes look like, for an error message."""
    heads = {b"ID3": "MP3", b"\xff\xfb": "MP3", b"OggS": "Ogg", b"fLaC": "FLAC", b"\x1aE\xdf\xa3": "WebM"}
    kind = next((kind for head, kind in heads.items() if data.startswith(head)), None)
    if kind is None and data[4:8] == b"ftyp":
        kind = "MP4/M4A"
    return f"{kind} audio" if kind else ("an empty file" if not data else "this data")
