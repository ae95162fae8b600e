"""A live stream of raw PCM (16-bit little-endian, 16 kHz mono: ``arecord -f S16_LE -r 16000 -c 1``) cut into
utterances by the Silero VAD that faster-whisper ships.

The VAD scores each 32 ms window (512 samples) with the model's state carried from one read to the next, so a
stream is scored once, as it comes. An utterance starts at the first window whose speech probability reaches
``ListenConfig.threshold`` (with ``pad_s`` of audio before it) and ends once ``silence_s`` of silence follows the
last speech (with ``pad_s`` after it); one longer than ``max_utterance_s`` is cut there and goes on as the next;
the end of the stream ends the last. Bursts shorter than ``min_speech_s`` (a click, a cough) are dropped. The stream
is read by a thread of its own, so a microphone is drained while a turn runs.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from cabinllm.runtime.errors import AudioError, Fix, Hint
from cabinllm.runtime.speech.audio import SAMPLE_RATE, Clip

WINDOW = 512  # samples the VAD scores at once at 16 kHz (32 ms)
CONTEXT = 64  # samples of the window before that Silero v6 reads with each window
CHUNK_BYTES = 4096  # most bytes read from the stream at once (128 ms)


@dataclass(frozen=True)
class ListenConfig:
    """Where the listener cuts a stream: the silence that ends an utterance, the longest one, the VAD's threshold."""

    silence_s: float = field(default=0.7, metadata={"help": "silence that ends a spoken command, in seconds"})
    max_utterance_s: float = field(default=20.0, metadata={
        "help": "longest spoken command, in seconds; a longer one is cut there and goes on as the next"})
    threshold: float = field(default=0.5, metadata={
        "help": "speech probability (Silero VAD) from which a 32 ms window counts as speech"})
    min_speech_s: float = 0.25  # speech shorter than this is noise, dropped
    pad_s: float = 0.2  # audio kept before an utterance's first speech and after its last


class StreamingVad:
    """Silero VAD's speech probability per 512-sample window, its state carried across calls."""

    def __init__(self) -> None:
        try:
            from faster_whisper.vad import get_vad_model
        except ImportError as err:
            raise AudioError("listening needs the speech front end (faster-whisper, which ships Silero VAD), which "
                             "is not installed", (Hint(Fix.INSTALL_VOICE),)) from err
        self.session = get_vad_model().session  # one ONNX Runtime session, shared; the state is this stream's
        self.state = np.zeros((2, 1, 1, 128), dtype=np.float32)  # h, c
        self.context = np.zeros(CONTEXT, dtype=np.float32)

    def __call__(self, windows: np.ndarray) -> np.ndarray:
        """Speech probabilities of ``windows`` (n, 512), the stream's next n windows."""
        before = np.concatenate([self.context[None], windows[:-1, -CONTEXT:]])
        out, h, c = self.session.run(None, {"input": np.concatenate([before, windows], axis=1),
                                            "h": self.state[0], "c": self.state[1]})
        self.state = np.stack([h, c])
        self.context = windows[-1, -CONTEXT:].copy()
        return np.asarray(out, dtype=np.float32).reshape(-1)


class Segmenter:
    """Samples in, utterances out: the VAD's windows followed through speech and silence."""

    def __init__(self, config: ListenConfig = ListenConfig(), vad: StreamingVad | None = None) -> None:
        self.config, self.vad = config, vad or StreamingVad()
        self.pad = int(config.pad_s * SAMPLE_RATE)
        self.before: deque[np.ndarray] = deque(maxlen=max(1, -(-self.pad // WINDOW)))  # windows before speech
        self.rest = np.zeros(0, dtype=np.float32)  # samples short of a window
        self.position = 0  # stream samples scored so far
        self.spoken = 0  # utterances emitted
        self.parts: list[np.ndarray] = []  # the utterance's windows (none: not in speech)
        self.start = self.first_voice = self.last_voice = 0  # stream samples
        self.silent = 0  # samples of silence since the last speech

    def feed(self, pcm: np.ndarray) -> list[Clip]:
        """The utterances that ``pcm``, the stream's next samples (float32 in [-1, 1]), ends."""
        pcm = np.concatenate([self.rest, pcm.astype(np.float32, copy=False)])
        whole = len(pcm) // WINDOW * WINDOW
        self.rest = pcm[whole:]
        if not whole:
            return []
        windows = pcm[:whole].reshape(-1, WINDOW)
        return [clip for window, p in zip(windows, self.vad(windows)) if (clip := self._step(window, float(p)))]

    def flush(self) -> list[Clip]:
        """The utterance the end of the stream ends, if one was under way."""
        if not self.parts:
            return []
        self.parts.append(self.rest)
        self.rest = np.zeros(0, dtype=np.float32)
        clip = self._end(min(self.last_voice + self.pad, self.start + sum(map(len, self.parts))))
        return [clip] if clip else []

    def _step(self, window: np.ndarray, p: float) -> Clip | None:
        """Follow one window with speech probability ``p``; the utterance it ends, if any."""
        config, at = self.config, self.position
        self.position += WINDOW
        speech = p >= config.threshold or (p >= config.threshold - 0.15 and not self.silent)  # Silero's hysteresis
        if not self.parts:
            if not p >= config.threshold:
                self.before.append(window)
                return None
            self.parts = [*self.before, window]
            self.before.clear()
            self.start = at - WINDOW * (len(self.parts) - 1)
            self.first_voice, self.last_voice, self.silent = at, at + WINDOW, 0
            return None
        self.parts.append(window)
        if speech:
            self.last_voice, self.silent = at + WINDOW, 0
        else:
            self.silent += WINDOW
        if self.silent >= config.silence_s * SAMPLE_RATE:
            return self._end(self.last_voice + self.pad)
        if self.position + WINDOW - self.start > config.max_utterance_s * SAMPLE_RATE:  # the next would be over
            clip = self._end(self.position, cut=True)
            self.parts, self.start, self.first_voice = [np.zeros(0, dtype=np.float32)], self.position, self.position
            self.last_voice = self.position
            return clip
        return None

    def _end(self, end: int, cut: bool = False) -> Clip | None:
        """The utterance up to stream sample ``end`` (None: too little speech, noise); the listener waits for the
        next."""
        pcm = np.concatenate(self.parts)[: end - self.start]
        voiced = self.last_voice - self.first_voice
        if not cut:  # the silence heard last is the next utterance's audio before its speech
            self.before.extend(self.parts[-self.before.maxlen:])
        self.parts, self.silent = [], 0
        if not cut and voiced < self.config.min_speech_s * SAMPLE_RATE:
            return None
        self.spoken += 1
        name = f"utterance {self.spoken} ({self.start / SAMPLE_RATE:.1f}-{end / SAMPLE_RATE:.1f} s)"
        return Clip.from_pcm(pcm, name)


def read_chunks(stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of a binary stream as they come, read by a thread of its own (a stream that keeps coming is
    drained while the caller works); AudioError where reading fails."""
    chunks: queue.Queue[bytes | OSError | None] = queue.Queue()
    read = getattr(stream, "read1", stream.read)  # what is there, not a full chunk: a live stream is not held back

    def pump() -> None:
        try:
            while chunk := read(chunk_bytes):
                chunks.put(chunk)
        except (OSError, ValueError) as err:
            chunks.put(OSError(str(err)))
        finally:
            chunks.put(None)

    threading.Thread(target=pump, name="pcm-reader", daemon=True).start()
    while (item := chunks.get()) is not None:
        if isinstance(item, OSError):
            raise AudioError(f"reading the audio stream failed: {item}")
        yield item


def utterances(chunks: Iterable[bytes], config: ListenConfig = ListenConfig()) -> Iterator[Clip]:
    """The utterances of raw 16-bit little-endian 16 kHz mono PCM coming as ``chunks`` (any sizes), each as soon
    as its silence (or the stream's end) ends it."""
    segmenter, odd = Segmenter(config), b""
    for chunk in chunks:
        data = odd + chunk
        even = len(data) // 2 * 2
        odd = data[even:]
        yield from segmenter.feed(np.frombuffer(data[:even], dtype="<i2").astype(np.float32) / 32768.0)
    yield from segmenter.flush()


def listen(stream: BinaryIO, config: ListenConfig = ListenConfig()) -> Iterator[Clip]:
    """The utterances of a live raw PCM stream (e.g. stdin), each as soon as it ends."""
    return utterances(read_chunks(stream), config)
