"""The speech room: audio files read (or refused in one clear line), real speech transcribed, a live PCM stream cut
into its commands, and a session on a text engine that hears them."""
import sys

import jiwer
import numpy as np
import pytest

from cabinllm.benchmarks.studies.speech_wer import normalize
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.errors import AudioError, Fix
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.speech import asr
from cabinllm.runtime.speech.audio import SAMPLE_RATE, AudioLimits, Clip, read_clips, read_pcm, read_wav, to_s16le
from cabinllm.runtime.speech.listen import ListenConfig, utterances
from cli_words import raises_in_cli_words
from speech_helpers import command_stream, needs_espeak, spoken, wav_bytes

COMMAND = "turn the temperature up to twenty two degrees"
MAX_WER = 0.15  # at most one word in 7 wrong on a clean espeak-ng sentence (Whisper tiny.en gets this one exact)
THREE = ["Open the sunroof.", "Set the fan speed to three.", "Navigate to the nearest charging station."]
TWELVE = ["Please set the temperature on the driver side to twenty one degrees and turn the fan down to level two",
          "Open the sunroof halfway and switch on the blue ambient light at forty percent brightness for the kids",
          "Navigate to the nearest fast charging station along the motorway and tell me how long it takes to get there",
          "Turn on the heating of the passenger seat to level three because my wife is cold in the front",
          "Play the morning news podcast from the beginning and set the volume to twelve for the whole car",
          "Close all the windows and the sunroof because it is starting to rain heavily on the road ahead",
          "Find a restaurant near the next exit that is open now and has parking for an electric car",
          "Set the charge limit to eighty percent tonight and remind me to unplug the cable tomorrow morning",
          "Switch off the fog lights and turn the headlights on since the tunnel coming up is quite long and dark",
          "Defrost the front windshield and the rear window and turn the air conditioning on to dry the air",
          "Call my office and tell them I will be twenty minutes late because of the traffic on the ring road",
          "Read me the last message from Anna and then play some quiet jazz on the radio while we drive home"]


def chunks_of(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` cut into chunks of the given sizes, in turn (odd sizes cut samples in two)."""
    out, at, i = [], 0, 0
    while at < len(data):
        out.append(data[at: at + sizes[i % len(sizes)]])
        at, i = at + sizes[i % len(sizes)], i + 1
    return out


def overlaps(clip_span: tuple[float, float], spans: list[tuple[float, float]]) -> list[int]:
    """The commands (indices) whose spans a clip's span overlaps."""
    return [i for i, (start, end) in enumerate(spans) if clip_span[0] < end and start < clip_span[1]]


def span_of(clip: Clip) -> tuple[float, float]:
    """The stream seconds of an utterance, from its name ``utterance N (a-b s)``."""
    start, end = clip.name.split("(")[1].rstrip(" s)").split("-")
    return float(start), float(end)


def test_a_44k_stereo_wav_is_resampled_to_16k_mono():
    t = np.arange(22_050) / 44_100  # half a second
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    clip = read_wav(wav_bytes(np.stack([tone, tone], axis=1), 44_100, channels=2), "tone.wav")
    assert len(clip.pcm) == SAMPLE_RATE // 2
    spectrum = np.abs(np.fft.rfft(clip.pcm))
    assert abs(np.argmax(spectrum) * SAMPLE_RATE / len(clip.pcm) - 440) <= 2
    samples = np.round(tone * 32767) / 32767  # the same samples as a WAV and as raw PCM: one clip
    assert read_wav(wav_bytes(samples, SAMPLE_RATE), "a.wav").digest == read_pcm(to_s16le(samples), "a.raw").digest


@pytest.mark.parametrize("data, match", [
    (wav_bytes(np.zeros(8000), 8000)[:-4000], "cut short"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + bytes(range(200)), "not a readable PCM WAV"),
    (b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(500), "MP3 audio is not a WAV file"),
    (wav_bytes(np.zeros(100), 16_000), "holds no speech"),
])
def test_a_cut_corrupt_mp3_or_empty_file_is_refused_naming_it(data, match):
    with pytest.raises(AudioError, match=match) as caught:
        read_wav(data, "cmd.wav")
    assert "cmd.wav" in caught.value.message


def test_ten_minutes_are_refused_with_the_limit_to_change():
    with raises_in_cli_words(AudioError, r"over the 60 s a clip may take.*--audio-max-seconds"):
        read_wav(wav_bytes(np.zeros(600 * 8000), 8000), "long.wav")
    assert read_wav(wav_bytes(np.zeros(61 * SAMPLE_RATE), SAMPLE_RATE), "long.wav",
                    AudioLimits(max_seconds=120)).seconds == 61


def test_raw_pcm_is_read_as_16k_mono_and_a_torn_sample_refused(tmp_path):
    pcm = np.linspace(-0.5, 0.5, SAMPLE_RATE, dtype=np.float32)
    (tmp_path / "cmd.raw").write_bytes(to_s16le(pcm))
    clip, = read_clips([tmp_path / "cmd.raw"])
    assert clip.name == "cmd.raw" and np.abs(clip.pcm - pcm).max() < 1e-4
    with pytest.raises(AudioError, match="even number of bytes"):
        read_pcm(to_s16le(pcm) + b"\x00", "torn.raw")
    with pytest.raises(AudioError, match="missing.wav: cannot read the audio"):
        read_clips([tmp_path / "missing.wav"])


@needs_espeak
def test_a_spoken_sentence_is_transcribed_within_the_wer_bound(tmp_path):
    heard = asr.front_end(asr.AsrConfig()).transcribe(spoken(COMMAND, tmp_path))
    assert jiwer.wer(normalize(COMMAND), normalize(heard.text)) <= MAX_WER, heard.text
    assert heard.segments and 0 < heard.rtf < 1 and heard.audio_s == pytest.approx(2.8, abs=0.5)


@needs_espeak
def test_three_commands_in_a_stream_are_three_utterances_however_it_is_read(tmp_path):
    stream, spans = command_stream(THREE, [1.5, 2.5, 1.0], tmp_path)
    whole = list(utterances([stream]))
    assert [overlaps(span_of(clip), spans) for clip in whole] == [[0], [1], [2]]
    for clip, (start, end) in zip(whole, spans):  # each holds its command's speech, padded
        assert span_of(clip)[0] <= start + 0.3 and span_of(clip)[1] >= end - 0.3
    pieces = list(utterances(chunks_of(stream, [4097, 333, 8000, 1])))  # the VAD's state carried across reads
    assert [clip.name for clip in pieces] == [clip.name for clip in whole]
    assert [clip.name.split(" (")[0] for clip in whole] == ["utterance 1", "utterance 2", "utterance 3"]


@needs_espeak
def test_a_long_utterance_is_cut_at_the_maximum_and_the_end_of_the_stream_ends_the_last(tmp_path):
    stream, spans = command_stream(THREE, [1.5, 1.5, 0.0], tmp_path)  # no silence after the last
    clips = list(utterances([stream], ListenConfig(max_utterance_s=1.0)))
    assert all(clip.seconds <= 1.0 + 1e-9 for clip in clips) and len(clips) > len(THREE)
    assert span_of(clips[-1])[1] == pytest.approx(spans[-1][1], abs=0.05)  # the last, flushed at the end
    assert len(list(utterances([stream]))) == len(THREE)


@needs_espeak
@pytest.mark.slow
def test_a_two_minute_stream_of_twelve_commands_gives_twelve_utterances(tmp_path):
    silences = [1.5 + 2.5 * ((i * 7) % 12) / 11 for i in range(12)]  # 1.5 to 4 s
    stream, spans = command_stream(TWELVE, silences, tmp_path, words_per_minute=140)
    assert 110 < len(stream) / 2 / SAMPLE_RATE < 130  # two minutes
    clips = list(utterances(chunks_of(stream, [4096])))
    assert [overlaps(span_of(clip), spans) for clip in clips] == [[i] for i in range(12)]


def session(engine, **kwargs) -> DialogueSession:
    return DialogueSession(engine, engine.new_cache(KvCacheConfig(max_bytes=8 << 20)), system_prompt="Be brief.",
                           **kwargs)


@needs_espeak
def test_a_text_engine_hears_the_clip_and_the_typed_text_follows(tiny_engine, tmp_path):
    chat = session(tiny_engine)
    chat.params.max_new_tokens = 4
    stats = chat.chat("and the passenger side", audio=[spoken(COMMAND, tmp_path)])
    user = chat.messages[-2]
    assert user["role"] == "user" and user["content"].endswith("\nand the passenger side")
    heard, = stats.heard
    assert user["content"].startswith(heard["text"]) and heard["clip"] == COMMAND
    assert jiwer.wer(normalize(COMMAND), normalize(heard["text"])) <= MAX_WER
    assert {"segments", "asr_s", "rtf", "audio_s"} <= heard.keys() and stats.to_dict()["heard"] == stats.heard


def test_without_the_front_end_a_clip_is_refused_and_nothing_changes(tiny_engine, monkeypatch):
    chat = session(tiny_engine)
    before = list(chat.messages), chat.turns
    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # import faster_whisper raises ImportError
    asr.front_end.cache_clear()
    try:
        with raises_in_cli_words(AudioError, r"not installed.*pip install 'cabinllm\[voice\]'") as caught:
            chat.chat("", audio=[Clip.from_pcm(np.zeros(SAMPLE_RATE), "cmd.wav")])
        assert caught.value.hints[0].fix is Fix.INSTALL_VOICE
    finally:
        asr.front_end.cache_clear()
    assert (chat.messages, chat.turns) == before


def test_silence_too_many_clips_or_a_tool_message_with_audio_are_refused(tiny_engine):
    chat = session(tiny_engine, audio_limits=AudioLimits(max_clips=1))
    quiet = Clip.from_pcm(np.zeros(SAMPLE_RATE), "quiet.wav")
    with pytest.raises(AudioError, match="quiet.wav: no words heard"):
        chat.chat("", audio=[quiet])
    with pytest.raises(AudioError, match="2 clips in one message, over the 1"):
        chat.chat("", audio=[quiet, quiet])
    with pytest.raises(AudioError, match="audio comes with a user's message"):
        chat.chat({"role": "tool", "content": "{}"}, audio=[quiet])
    assert chat.turns == 0 and len(chat.messages) == 1
