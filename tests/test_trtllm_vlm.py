"""Pictures on the TensorRT-LLM backend: tiny random vision-language engines (random weights: mechanics only) whose
pictures reach a fake ModelRunnerCpp (tests/test_trtllm_session.py, copying TensorRT-LLM's prompt-table path) as
MultimodalModelRunner sends them: fake ids from the vocabulary's end, the encoder's rows as the prompt table, and
per-token extra ids that keep KV block reuse from mixing pictures up."""
from __future__ import annotations

import json

import pytest
import torch
from test_hf_folders import cabin_build
from test_trtllm_session import MAX_INPUT_LEN, MAX_SEQ_LEN, REPLY, FakeRunner, FakeRunner012, install_fake
from test_vlm import png

from cabinllm.benchmarks.random_vlm import image, write_random_vlm
from cabinllm.runtime.backends.select import SessionRequest, open_session
from cabinllm.runtime.backends.trtllm import media_key
from cabinllm.runtime.errors import ImageError
from cabinllm.runtime.formats.engine_folder import TRT_ENGINE_DIR
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.vision import Vision
from cli_words import raises_in_cli_words

QUESTION = "what does the camera at the back show?"


def write_trt_config(folder, table_rows: int) -> None:
    """trt_engine/config.json as trtllm-build writes it for a vision-language model's LLM part (the fields the
    runner and the session read)."""
    vocab = json.loads((folder / "checkpoint" / "config.json").read_text())["vocab_size"]
    engine_dir = folder / TRT_ENGINE_DIR
    engine_dir.mkdir(exist_ok=True)
    (engine_dir / "config.json").write_text(json.dumps(
        {"pretrained_config": {"vocab_size": vocab},
         "build_config": {"max_input_len": MAX_INPUT_LEN, "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 1,
                          "max_beam_width": 1, "max_prompt_embedding_table_size": table_rows}}))


def engine_folder(root, family: str):
    """A tiny random VLM's engine folder (cabin-build) with the TensorRT engine's config beside it."""
    folder = cabin_build(write_random_vlm(root / "hf", family), root / "engine", kv_cache="fp16")
    write_trt_config(folder, 4096)
    return folder


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def vlm_folder(request, tmp_path_factory):
    """A LLaVA or Idefics3 engine folder: the families whose pictures this backend sends."""
    return engine_folder(tmp_path_factory.mktemp(f"trt_{request.param}"), request.param)


@pytest.fixture
def runner(monkeypatch, vlm_folder):
    """The fake ModelRunnerCpp as ``tensorrt_llm.runtime``, replying REPLY."""
    return install(monkeypatch, vlm_folder, FakeRunner)


def install(monkeypatch, folder, runner_class):
    return install_fake(monkeypatch, runner_class, ChatTokenizer(folder / "checkpoint"))


def session(folder):
    return open_session(SessionRequest(folder, KvCacheConfig("fp16", 8 << 20), backend="tensorrt-llm"))


def picture(seed: int) -> tuple[str, bytes]:
    return f"cam{seed}.png", png(image(120, 90, seed=seed))


def expected_prompt(folder, message: dict, images: dict) -> list[int]:
    """The prompt's ids as the reference engine feeds them (placeholders at the pictures' rows)."""
    vision = Vision(folder / "vision")
    tok = ChatTokenizer(folder / "checkpoint").with_images(images, vision.placeholder)
    return tok.encode_prompt_media(tok.render([message]))[0]


def test_pictures_go_as_a_prompt_table_whose_rows_are_the_encoders(runner, vlm_folder):
    chat = session(vlm_folder)
    stats = chat.chat(QUESTION, images=[picture(1)])
    assert stats.error is None and stats.reply == REPLY
    call, vision = runner.calls[-1], chat.vision
    (held,) = chat.images.values()
    rows = vision.encode(held).rows
    assert call["prompt_tasks"] == "0" and call["prompt_table"].shape == (1, *rows.shape)
    ids, vocab = call["input_ids"], chat.vocab_size
    expected = expected_prompt(vlm_folder, chat.messages[0], chat.images)
    placeholders = [i for i, t in enumerate(expected) if t == vision.image_token_id]
    assert len(placeholders) == len(rows)
    assert [i for i, t in enumerate(ids) if t >= vocab] == placeholders  # one fake id per encoder row
    assert [t for i, t in enumerate(ids) if i not in placeholders] == [
        t for i, t in enumerate(expected) if i not in placeholders]  # the text, and a tiled picture's text tokens
    embedded = runner.embedded[-1]
    assert torch.equal(torch.stack([embedded[i] for i in placeholders]), rows.to(torch.float16))
    (extra,) = call["input_token_extra_ids"]
    key = media_key(held.digest)
    assert key > 0 and [e for i, e in enumerate(extra) if i in placeholders] == [key] * len(rows)
    assert not any(e for i, e in enumerate(extra) if i not in placeholders)


def test_later_turns_resend_the_picture_with_the_same_keys_and_reuse_its_blocks(runner, vlm_folder):
    chat = session(vlm_folder)
    first = chat.chat(QUESTION, images=[picture(1)])
    second = chat.chat("and the lane beside us?")
    a, b = runner.calls[-2], runner.calls[-1]
    assert b["input_ids"][:len(a["input_ids"])] == a["input_ids"]
    assert b["input_token_extra_ids"][0][:len(a["input_ids"])] == a["input_token_extra_ids"][0]
    assert torch.equal(b["prompt_table"], a["prompt_table"])  # the history's picture, from the feature cache
    (held,) = chat.images.values()
    assert first.reused_tokens == 0 and second.reused_tokens >= held.image_tokens


def test_another_picture_at_the_same_place_has_the_same_fake_ids_but_another_key(runner, vlm_folder):
    session(vlm_folder).chat(QUESTION, images=[picture(1)])
    session(vlm_folder).chat(QUESTION, images=[picture(2)])
    a, b = runner.calls
    assert a["input_ids"] == b["input_ids"]  # what TensorRT-LLM's block keys see without extra ids
    assert a["input_token_extra_ids"] != b["input_token_extra_ids"]


def test_a_runner_without_extra_ids_sends_pictures_with_block_reuse_off(monkeypatch, vlm_folder):
    runner = install(monkeypatch, vlm_folder, FakeRunner012)
    chat = session(vlm_folder)
    assert runner.created[-1]["kv_cache_enable_block_reuse"] is False
    chat.chat(QUESTION, images=[picture(1)])
    chat.chat("and the lane beside us?")
    assert chat.chat("thanks").reused_tokens == 0 and runner.calls[-1]["prompt_table"] is not None


def test_qwen2_vl_pictures_are_refused_and_the_session_goes_on(monkeypatch, tmp_path):
    folder = engine_folder(tmp_path, "qwen2_vl")
    runner = install(monkeypatch, folder, FakeRunner)
    chat = session(folder)
    with raises_in_cli_words(ImageError, match="mrope_params.*--backend reference"):
        chat.chat(QUESTION, images=[picture(1)])
    assert chat.chat(QUESTION).reply == REPLY and runner.calls[-1]["prompt_table"] is None


def test_a_conversation_over_the_engines_table_is_refused_before_anything_changes(runner, vlm_folder):
    chat = session(vlm_folder)
    chat.chat(QUESTION, images=[picture(1)])
    (held,) = chat.images.values()
    chat.table_rows = len(held.offsets) + 1  # room for the first picture's rows, not for a second's
    messages, calls = list(chat.messages), len(runner.calls)
    with pytest.raises(ImageError, match=r"need \d+ rows of the prompt table, over the \d+ the engine was built"):
        chat.chat("and this one?", images=[picture(2)])
    assert chat.messages == messages and len(chat.images) == 1 and len(runner.calls) == calls
    assert chat.chat("and the lane beside us?").error is None


def test_an_engine_without_a_prompt_table_refuses_pictures(runner, vlm_folder):
    write_trt_config(vlm_folder, 0)
    try:
        with raises_in_cli_words(ImageError, match="without a prompt table.*--max_multimodal_len"):
            session(vlm_folder).chat(QUESTION, images=[picture(1)])
    finally:
        write_trt_config(vlm_folder, 4096)


def test_cabin_chat_sends_a_scripts_pictures_to_the_tensorrt_llm_engine(runner, vlm_folder, tmp_path, capsys):
    from cabinllm.cli.chat import main

    (tmp_path / "cam.png").write_bytes(picture(3)[1])
    lines = [{"role": "user", "content": QUESTION, "images": ["cam.png"]}, {"role": "user", "content": "thanks"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    code = main(["--engine", str(vlm_folder), "--backend", "tensorrt-llm", "--kv-cache", "fp16", "--script",
                 str(tmp_path / "d.jsonl"), "--json", "--max-new-tokens", "64"])
    out, err = capsys.readouterr()
    turns = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [t["reply"] for t in turns] == [REPLY, REPLY] and "Traceback" not in err
    assert [call["prompt_table"] is not None for call in runner.calls] == [True, True]  # the history's picture too
