"""Pictures in the dialogue, on tiny random vision-language models of the three families (LLaVA, Idefics3,
Qwen2-VL) that cabinllm.benchmarks.random_vlm writes with transformers' own classes: cabin-build makes an engine
of each, and its prompt ids, logits and greedy replies are transformers' own on the same weights (random weights
prove mechanics only). Then media-aware block reuse, overflow around pictures, bad pictures, session files,
cabin-serve through the openai client and cabin-chat."""
from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from dataclasses import replace

import pytest
import torch
from PIL import Image
from serve_helpers import running_server
from test_hf_folders import cabin_build

from cabinllm.cli.args import CLI_WORDS
from cabinllm.benchmarks.random_vlm import FAMILIES, image, picture_dialogues, write_random_vlm
from cabinllm.runtime.dialogue.overflow import OverflowPolicy, sink_window
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import ImageError
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import BlockManager, MediaSpan, Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.media import EncodedRows

QUESTION = "what does the camera at the back show, and is the lane beside us free to change into?"
FOLLOW_UP = "and what about the cyclist on the right side of the road, is he moving away from us?"


def png(picture: Image.Image) -> bytes:
    """A picture as PNG bytes."""
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory) -> dict:
    """One family's HF folder, its transformers model and processor, and its engine (fp16 KV, float32 weights)."""
    import transformers

    root = tmp_path_factory.mktemp(request.param)
    folder = write_random_vlm(root / "hf", request.param, seed=FAMILIES.index(request.param))
    engine = Engine.load(cabin_build(folder, root / "engine", kv_cache="fp16"))
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).float().eval()
    return {"family": request.param, "folder": folder, "engine": engine, "model": model,
            "processor": engine.vision.processor}


def session(engine: Engine, cache=None, max_new_tokens: int = 6) -> DialogueSession:
    """A greedy session on an fp32 KV cache (``cache`` shared with other sessions where given)."""
    cache = cache or engine.new_cache(KvCacheConfig("fp32"), max_sequences=4)
    return DialogueSession(engine, cache, SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                                                         stop_token_ids=engine.stop_token_ids()))


def hf_inputs(vlm: dict, messages: list[dict], pictures: list[Image.Image]) -> dict:
    """transformers' processor inputs for the conversation (image parts where the pictures go)."""
    processor = vlm["processor"]
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [pictures] if vlm["family"] == "idefics3" else pictures
    return processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)


def hf_inputs_of_ids(vlm: dict, ids: list[int], prepared) -> dict:
    """transformers' inputs for prompt ids holding one prepared picture's tokens (its processor tensors)."""
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
              **prepared.inputs}
    if vlm["family"] == "qwen2_vl":  # which tokens M-RoPE places on the picture's grid
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == vlm["engine"].vision.image_token_id).long()
    return inputs


def hf_greedy(vlm: dict, inputs: dict, max_new_tokens: int = 6) -> list[int]:
    """transformers' greedy continuation of the inputs (stopping at the end of turn)."""
    with torch.no_grad():
        out = vlm["model"].generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def as_parts(message: dict) -> dict:
    """A session message in the parts the fixture's chat template renders (an image part per picture)."""
    content = message["content"]
    if isinstance(content, str):
        return message
    return {**message, "content": [{"type": "image"} if p["type"] == "image" else p for p in content]}


def test_prompt_ids_and_logits_equal_transformers(vlm):
    engine, picture = vlm["engine"], image(120, 90, seed=1)
    chat = session(engine)
    message = chat._with_images({"role": "user", "content": QUESTION}, [("cam.png", png(picture))])
    ids, media = chat.tokenizer.encode_prompt_media(chat.tokenizer.render([message]))
    inputs = hf_inputs(vlm, [as_parts(message)], [picture])
    assert ids == inputs["input_ids"][0].tolist()
    prepared = chat.images[message["content"][0]["digest"]]
    assert [(m.start, m.length) for m in media] == [(ids.index(prepared.token_ids[0]), len(prepared.token_ids))]
    seq = Sequence()
    chat.cache.allocate(seq, ids, media)
    ours = engine.model.forward(ids, 0, chat.cache, seq, all_logits=True,
                                media=EncodedRows(engine.vision, chat.images))
    with torch.no_grad():
        theirs = vlm["model"](**inputs).logits[0]
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), float((ours - theirs).abs().max())


def test_an_image_turn_then_a_text_turn_reply_as_transformers_does(vlm):
    """The second turn appends onto the cached first (Qwen2-VL: decode past the picture at its M-RoPE offset), and
    each reply equals transformers' uncached greedy decoding of the whole conversation."""
    picture = image(100, 140, seed=2)
    chat = session(vlm["engine"])
    first = chat.chat(QUESTION, images=[("cam.png", png(picture))])
    assert first.token_ids == hf_greedy(vlm, hf_inputs(vlm, [as_parts(m) for m in chat.messages[:1]], [picture]))
    second = chat.chat(FOLLOW_UP)
    assert second.reused_tokens >= chat.seq.media[0].end  # the picture's KV is the first turn's
    prompt = chat.seq.token_ids[:len(chat.seq) - len(second.token_ids) + 1]  # the last token is not fed back
    assert second.token_ids == hf_greedy(vlm, hf_inputs_of_ids(vlm, prompt, next(iter(chat.images.values()))))


@pytest.mark.parametrize("size", [(120, 90), (33, 400), (640, 480), (7, 7)])
@pytest.mark.parametrize("detail", ["auto", "low"])
def test_image_token_counts_equal_the_processors_before_anything_runs(vlm, size, detail):
    vision = vlm["engine"].vision
    prepared = vision.prepare(png(image(*size, seed=3)), "cam.png", detail)
    kwargs = vision._resize_kwargs(detail)
    pictures = [[image(*size, seed=3)]] if vlm["family"] == "idefics3" else [image(*size, seed=3)]
    expected = vlm["processor"](text=[vision.placeholder], images=pictures, return_tensors="pt",
                                add_special_tokens=False, images_kwargs=kwargs)["input_ids"][0].tolist()
    assert prepared.token_ids == expected
    if vlm["family"] == "qwen2_vl":  # Qwen2-VL's smart_resize: one token per 28 x 28 pixels of the resized picture
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        pixels = kwargs["size"]
        assert pixels["longest_edge"] == min(112 * 112, vision.limits.max_image_tokens * 28 ** 2,
                                             *([448 * 448] if detail == "low" else []))
        height, width = smart_resize(size[1], size[0], 28, pixels["shortest_edge"], pixels["longest_edge"])
        assert len(prepared.offsets) == height * width // 28 ** 2
        assert prepared.grid == (1, height // 28, width // 28)


def test_the_encoder_runs_once_per_picture(vlm):
    vision, data = vlm["engine"].vision, png(image(64, 48, seed=4))
    prepared = vision.prepare(data, "cam.png")
    calls = []
    original = vision._features
    vision._features = lambda inputs: calls.append(1) or original(inputs)
    try:
        rows = vision.encode(prepared)
        again = vision.encode(vision.prepare(data, "same.png"))
    finally:
        del vision._features
    assert len(calls) == 1 and again is rows and vision.features.bytes_used >= rows.rows.numel() * 4


# -- media-aware block reuse (no model) ----------------------------------------------------------------------


def test_the_same_picture_at_another_offset_or_another_picture_misses():
    bm = BlockManager(num_blocks=32, block_size=4)
    ids = [7] * 4 + [99] * 8 + [5] * 8  # text, 8 image tokens, text
    cat, dog = b"c" * 16, b"d" * 16
    bm.allocate(Sequence(), ids, media=[MediaSpan(4, 8, cat)])
    assert bm.allocate(Sequence(), ids, media=[MediaSpan(4, 8, dog)]) == 4  # the text before the picture only
    shifted = [7] * 8 + [99] * 8 + [5] * 4  # same ids where the picture's would be, the picture 4 tokens later
    assert bm.allocate(Sequence(), shifted, media=[MediaSpan(8, 8, cat)]) == 4
    assert bm.allocate(Sequence(), ids, media=[MediaSpan(4, 8, cat)]) == 16  # identical: every full block but the last


def test_a_reused_prefix_never_ends_inside_a_picture():
    bm = BlockManager(num_blocks=32, block_size=4)
    cat = b"c" * 16
    first = [1, 2] + [99] * 9 + [3] * 9  # the picture covers positions 2..10: blocks 0, 1 and 2 hold part of it
    bm.allocate(Sequence(), first, media=[MediaSpan(2, 9, cat)])
    # the same picture, then different text: blocks 0-1 match but end inside the picture, so nothing is reused
    assert bm.allocate(Sequence(), first[:11] + [4] * 9, media=[MediaSpan(2, 9, cat)]) == 0
    # the same conversation, further: reuse runs past the picture
    assert bm.allocate(Sequence(), first + [6] * 4, media=[MediaSpan(2, 9, cat)]) == 20


def saved_and_restored(engine: Engine, picture: bytes, folder) -> tuple[DialogueSession, DialogueSession]:
    """A session after a turn with the picture, and the session restored from its file on a new cache."""
    chat = session(engine)
    chat.chat(QUESTION, images=[("cam.png", picture)])
    chat.save(folder / "s.json")
    restored = DialogueSession.restore(folder / "s.json", engine, engine.new_cache(KvCacheConfig("fp32")))
    restored.params = chat.params
    return chat, restored


def test_a_failed_forward_pass_leaves_no_block_keyed_to_kv_it_never_wrote():
    bm = BlockManager(num_blocks=16, block_size=4)
    ids = list(range(20))
    bm.allocate(Sequence(), ids[:8])  # blocks 0 and 1 written and keyed
    failed = Sequence()
    assert bm.allocate(failed, ids) == 8
    bm.discard(failed, 8)  # the pass over positions 8..19 failed: blocks 2..4 lose their keys
    assert not failed and bm.allocate(Sequence(), ids) == 8


def test_a_picture_whose_rows_are_gone_is_an_error_and_the_next_turn_rebuilds(vlm, tmp_path):
    """A restored session keeps no pixels: a turn that must compute the picture again (here: its KV dropped from
    the cache) asks for the picture, and the conversation goes on."""
    engine, data = vlm["engine"], png(image(80, 60, seed=14))
    _, restored = saved_and_restored(engine, data, tmp_path)
    engine.vision.features = type(engine.vision.features)(engine.vision.features.max_bytes)  # the rows forgotten
    restored._release()  # the restored KV gone too (evicted): the next turn must compute the picture
    restored.cache = engine.new_cache(KvCacheConfig("fp32"))
    with pytest.raises(ImageError, match="send the picture again"):
        restored.chat(FOLLOW_UP)
    assert restored.cache.stats().blocks_cached == 0 and len(restored.messages) == 2
    assert restored.chat(FOLLOW_UP, images=[("cam.png", data)]).finish_reason in ("stop", "length")


def test_overflow_keeps_or_drops_a_picture_whole():
    tokens = list(range(40))
    media = [MediaSpan(2, 6, b"a" * 16), MediaSpan(20, 10, b"b" * 16)]
    for sink in range(0, 10):
        for limit in range(sink, 40):
            kept, spans = sink_window(tokens, sink, limit, media)
            assert len(kept) <= limit
            for span in spans:  # each kept picture is whole, where its tokens now are
                original = next(m for m in media if m.digest == span.digest)
                assert kept[span.start:span.end] == tokens[original.start:original.end]
            gone = {m.digest for m in media} - {s.digest for s in spans}
            for m in media:  # a dropped picture left no token behind
                if m.digest in gone:
                    assert not set(tokens[m.start:m.end]) & set(kept)


def test_two_pictures_of_the_same_size_never_share_their_blocks(vlm):
    """The bug where prefix caching ignores the picture (the same placeholder ids): the second picture's reply is
    its own, as on a cache that never saw the first."""
    engine = vlm["engine"]
    shared = engine.new_cache(KvCacheConfig("fp32"), max_sequences=4)
    cat, dog = png(image(96, 96, seed=5)), png(image(96, 96, seed=6))
    first = session(engine, shared).chat(QUESTION, images=[("cat.png", cat)])
    other = session(engine, shared)
    dog_stats = other.chat(QUESTION, images=[("dog.png", dog)])
    assert dog_stats.reused_tokens <= other.seq.media[0].start
    assert dog_stats.token_ids == session(engine).chat(QUESTION, images=[("dog.png", dog)]).token_ids
    again = session(engine, shared).chat(QUESTION, images=[("cat.png", cat)])
    assert again.token_ids == first.token_ids and again.reused_tokens >= other.seq.media[0].end


def test_a_session_file_keeps_the_pictures_and_restores_without_them(vlm, tmp_path):
    chat, restored = saved_and_restored(vlm["engine"], png(image(80, 60, seed=7)), tmp_path)
    assert restored.seq.media == chat.seq.media
    assert restored.chat(FOLLOW_UP).token_ids == chat.chat(FOLLOW_UP).token_ids


# -- bad pictures ----------------------------------------------------------------------------------------------


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` and whose pixels are one empty row."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


BAD_PICTURES = {
    "truncated PNG": (png(image(64, 64))[:300], "truncated"),
    "0 x 0": (png_header(0, 0), "not a picture"),
    "20000 x 20000": (png_header(20_000, 20_000), "pixels"),
    "not a picture": (b"%PDF-1.4 not an image at all", "not a picture Pillow can read"),
}


@pytest.mark.parametrize("kind", BAD_PICTURES)
def test_a_bad_picture_is_one_clear_error_and_the_session_goes_on(vlm, kind):
    data, words = BAD_PICTURES[kind]
    chat = session(vlm["engine"])
    chat.chat("hello")
    before = [dict(m) for m in chat.messages]
    with pytest.raises(ImageError, match=words) as err:
        chat.chat(QUESTION, images=[("bad.png", data)])
    assert "bad.png" in str(err.value)
    assert chat.messages == before
    assert chat.chat(FOLLOW_UP).finish_reason in ("stop", "length")


def test_more_pictures_than_the_cap_are_refused_naming_the_cap(vlm):
    chat = session(vlm["engine"])
    cap = vlm["engine"].vision.limits.max_images
    with pytest.raises(ImageError, match=f"cap of {cap}"):
        chat.chat(QUESTION, images=[(f"{i}.png", png(image(32, 32, seed=i))) for i in range(cap + 1)])
    assert chat.messages == [] and chat.chat(QUESTION).finish_reason in ("stop", "length")



# -- cabin-serve through the openai client ---------------------------------------------------------------------


def data_url(data: bytes, kind: str = "png") -> str:
    """A picture as the data: URL an image_url part carries."""
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def image_message(text: str, *urls: str, detail: str = "auto") -> dict:
    """A user message with pictures (image_url parts) before its text."""
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": detail}}
                                        for url in urls] + [{"type": "text", "text": text}]}


def test_the_openai_client_sends_pictures_to_cabin_serve(vlm):
    import openai

    engine = vlm["engine"]
    cat, dog = png(image(90, 120, seed=8)), png(image(90, 120, seed=9))
    want, picture_end = {}, 0
    for name, data in (("cat", cat), ("dog", dog)):
        chat = DialogueSession(engine, engine.new_cache(KvCacheConfig("fp16", 16 << 20)),
                               SamplingParams(6, temperature=0, stop_token_ids=engine.stop_token_ids()))
        want[name] = chat.chat(QUESTION, images=[(f"{name}.png", data)])
        picture_end = chat.seq.media[0].end
    with running_server(engine.folder, "--kv-budget-mb", "16", "--kv-cache", "fp16") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        def ask(*urls: str, detail: str = "auto"):
            return client.chat.completions.create(model="tiny", messages=[image_message(QUESTION, *urls,
                                                                                       detail=detail)],
                                                  temperature=0, max_tokens=6)

        first = ask(data_url(cat))
        assert first.choices[0].message.content == want["cat"].reply
        assert first.usage.prompt_tokens == want["cat"].prefill_tokens + want["cat"].reused_tokens
        again = ask(data_url(cat))  # the identical request: its prefix, picture included, from the cache
        assert again.choices[0].message.content == want["cat"].reply
        assert again.usage.prompt_tokens_details.cached_tokens >= picture_end
        other = ask(data_url(dog))  # the same placeholder ids, another picture: its own reply
        assert other.choices[0].message.content == want["dog"].reply
        bad = {"invalid base64": "data:image/png;base64,@@@@",
               "truncated PNG": data_url(cat[:200]),
               "not a picture": data_url(b"GIF89a but not really"),
               "20000 x 20000": data_url(png_header(20_000, 20_000)),
               "remote URL": "https://example.com/cam.png"}
        for kind, url in bad.items():
            with pytest.raises(openai.BadRequestError) as caught:
                ask(url)
            assert caught.value.status_code == 400 and "messages" in str(caught.value), kind
        with pytest.raises(openai.BadRequestError, match="cap of"):
            ask(*[data_url(png(image(32, 32, seed=i))) for i in range(engine.vision.limits.max_images + 1)])
        assert ask(data_url(cat)).choices[0].message.content == want["cat"].reply  # serving goes on
        assert ask(data_url(cat), detail="low").choices  # OpenAI's detail is taken


# -- cabin-chat ------------------------------------------------------------------------------------------------


def test_cabin_chat_shows_a_scripts_pictures_and_names_a_missing_one(vlm, tmp_path, capsys):
    from cabinllm.cli.chat import main

    (tmp_path / "cam.png").write_bytes(png(image(70, 50, seed=10)))
    lines = [{"role": "user", "content": QUESTION, "images": ["cam.png"]},
             {"role": "user", "content": "and now?", "images": ["gone.png"]},
             {"role": "user", "content": FOLLOW_UP}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    code = main(["--engine", str(vlm["engine"].folder), "--script", str(tmp_path / "d.jsonl"), "--json",
                 "--max-new-tokens", "4", "--kv-budget-mb", "8"])
    out, err = capsys.readouterr()
    turns = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [t["turn"] for t in turns] == [1, 2]
    block = vlm["engine"].kv_cache_config().tokens_per_block  # the picture's turn, from the cache: at least its full
    assert turns[1]["reused_tokens"] >= turns[0]["prefill_tokens"] // block * block  # blocks (random replies re-encode)
    assert "message 2 of the script" in err and "gone.png" in err and "Traceback" not in err


def test_cabin_chat_image_command_attaches_to_the_next_message(vlm, tmp_path, monkeypatch, capsys):
    import builtins

    from cabinllm.cli.chat import main

    (tmp_path / "cam.png").write_bytes(png(image(70, 50, seed=11)))
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    typed = iter([f"/image {tmp_path / 'cam.png'}", QUESTION, f"/image {tmp_path / 'bad.png'}", "and now?",
                  "/image", "/stats", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(typed))
    assert main(["--engine", str(vlm["engine"].folder), "--max-new-tokens", "4", "--kv-budget-mb", "8"]) == 0
    out = capsys.readouterr().out
    assert "1 picture(s) attached" in out and "usage: /image PATH" in out
    assert "bad.png is not a picture Pillow can read" in out and "the conversation is kept" in out
    assert "Traceback" not in out


def test_cabin_chat_caps_pictures_as_its_flags_say(vlm, tmp_path, capsys):
    from cabinllm.cli.chat import main

    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(png(image(40, 40, seed=len(name))))
    line = {"role": "user", "content": QUESTION, "images": ["a.png", "b.png"]}
    (tmp_path / "d.jsonl").write_text(json.dumps(line), encoding="utf-8")
    argv = ["--engine", str(vlm["engine"].folder), "--script", str(tmp_path / "d.jsonl"), "--max-new-tokens", "2"]
    assert main(argv + ["--max-images", "1"]) == 0
    assert "over the cap of 1 per message" in capsys.readouterr().err
    assert main(argv + ["--max-image-tokens", "3"]) == 0
    assert "over the cap of 3 image tokens per picture" in capsys.readouterr().err


# -- the vision encoder for the board --------------------------------------------------------------------------


@pytest.mark.slow  # an export per family
def test_the_vision_graph_computes_the_encoders_rows_for_another_frame(vlm, tmp_path):
    import onnxruntime as ort

    from cabinllm.builders.image_plan import CAMERA_FRAME
    from cabinllm.builders.vision_onnx import export_vision_onnx

    vision = vlm["engine"].vision
    record = export_vision_onnx(vision, tmp_path)
    other = vision.prepare(png(image(*CAMERA_FRAME, seed=12)), "frame.png")  # the graph's size, other pixels
    session = ort.InferenceSession(str(tmp_path / record["file"]), providers=["CPUExecutionProvider"])
    rows = session.run(None, {i.name: other.inputs[i.name].numpy() for i in session.get_inputs()})[0]
    assert all(list(other.inputs[name].shape) == spec["shape"] for name, spec in record["inputs"].items())
    assert all(other.inputs[name].tolist() == value for name, value in record["traced"].items())
    assert torch.allclose(torch.from_numpy(rows), vision.encode(other).rows, atol=1e-4)


@pytest.mark.slow  # a graph export per family
def test_npu_graphs_take_the_pictures_rows_as_inputs_embeds(vlm, tmp_path):
    from cabinllm.builders.onnx_export import OnnxExportRequest, export_onnx
    from cabinllm.runtime.backends.onnxruntime import load_onnx_engine

    engine, data = vlm["engine"], png(image(90, 60, seed=13))
    export_onnx(OnnxExportRequest(engine.folder, tmp_path / "npu", 512, 64, "fp16", "npu", "fp16"), log=lambda _: None)
    graphs = load_onnx_engine(tmp_path / "npu", threads=1)
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=engine.stop_token_ids())
    on_graphs = DialogueSession(graphs, graphs.new_cache(KvCacheConfig("fp16")), params)
    if vlm["family"] == "qwen2_vl":  # its M-RoPE positions are not in the host tables: refused, nothing changed
        with pytest.raises(ImageError, match="takes text only"):
            on_graphs.chat(QUESTION, images=[("cam.png", data)])
        assert on_graphs.messages == [] and on_graphs.chat(QUESTION).finish_reason in ("stop", "length")
        return
    reference = DialogueSession(engine, engine.new_cache(KvCacheConfig("fp16")), params)
    assert on_graphs.chat(QUESTION, images=[("cam.png", data)]).token_ids == reference.chat(
        QUESTION, images=[("cam.png", data)]).token_ids
    assert on_graphs.chat(FOLLOW_UP).token_ids == reference.chat(FOLLOW_UP).token_ids


# -- cabin-plan ------------------------------------------------------------------------------------------------


def test_cabin_plan_counts_a_camera_frame_and_the_vision_memory(vlm, capsys):
    from cabinllm.builders.image_plan import CAMERA_FRAME
    from cabinllm.cli.plan import main as plan

    frame = vlm["engine"].vision.prepare(png(image(*CAMERA_FRAME, seed=15)), "frame.png")
    assert plan(["--model", str(vlm["folder"]), "--target", "orin-nano-8gb", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    pictures = record["images"]
    assert pictures["tokens"] == frame.image_tokens and pictures["picture"] == list(CAMERA_FRAME)
    assert pictures["memory_bytes"] == pictures["vision_weight_bytes"] + pictures["feature_cache_bytes"] > 0
    memory = record["memory_bytes"]
    assert memory["for_activations_and_kv"] == (memory["total"] - memory["os_reserve"] - memory["co_resident"]
                                                - memory["runtime_overhead"] - memory["weights"]
                                                - pictures["memory_bytes"])
    for dtype, per_token in record["kv_bytes_per_token"].items():
        assert pictures["kv_bytes_per_picture"][dtype] == per_token * frame.image_tokens
        turn = record["turn_tokens"]
        assert pictures["turns_with_a_picture"][dtype] == (record["max_seq_len"][dtype] - turn["system"]) // (
            turn["per_turn"] + frame.image_tokens)
    assert plan(["--model", str(vlm["folder"]), "--target", "orin-nano-8gb"]) == 0
    table = capsys.readouterr().out
    assert f"camera frame takes {frame.image_tokens} tokens" in table and "turns with a picture" in table
    assert "--max_multimodal_len" in table


def test_a_turn_whose_picture_cannot_fit_names_the_picture_and_the_cap(vlm):
    engine = vlm["engine"]
    config = engine.kv_cache_config(KvCacheConfig("fp32", tokens_per_block=16))
    small = engine.new_cache(replace(config, max_bytes=config.bytes_per_token(engine.model.kv_layout) * 48))
    chat = DialogueSession(engine, small, SamplingParams(4, temperature=0, stop_token_ids=engine.stop_token_ids()),
                           overflow=OverflowPolicy("error"))
    stats = chat.chat(QUESTION, images=[("rear-camera.png", png(image(120, 90, seed=16)))])
    assert stats.finish_reason == "capacity"
    shown = stats.error_words(CLI_WORDS)  # as cabin-chat prints it
    assert "rear-camera.png takes" in shown and "--max-image-tokens" in shown
    assert chat.messages == [] and chat.chat("hi").finish_reason in ("stop", "length", "capacity")


def test_calibration_reads_a_dialogues_pictures_as_transformers_does(vlm, tmp_path):
    """A dialogue of the data file is the processor's ids, its pictures' positions are the placeholder's, its
    logits are transformers' own; the statistics at image positions are those K values."""
    from cabinllm.calibration.calibrate import BY_KIND, CalibrationRequest, calibrate
    from cabinllm.calibration.evaluate import run_logits
    from cabinllm.calibration.selection import tokenize_dialogue
    from cabinllm.calibration.sources import open_source
    from cabinllm.runtime.model.run_tokens import run_tokens
    from cabinllm.runtime.kv.modes import kv_mode
    from cabinllm.runtime.sources.model_source import load_model

    data = picture_dialogues(tmp_path, 12)
    model = load_model(str(vlm["engine"].folder))
    dialogue = next(iter(open_source(str(data))[0]))
    tokenized = tokenize_dialogue(dialogue, model.tokenizer, 4096, model.vision)
    pictures = [Image.open(path) for m in dialogue.messages for path in m.get("images", [])]
    parts = [{"role": m["role"], "content": [{"type": "image"}] * len(m.get("images", []))
              + [{"type": "text", "text": m["content"]}]} for m in dialogue.messages]
    processor = vlm["processor"]
    text = processor.tokenizer.apply_chat_template(parts, add_generation_prompt=False, tokenize=False)
    inputs = processor(text=[text], images=[pictures] if vlm["family"] == "idefics3" else pictures,
                       return_tensors="pt", add_special_tokens=False)
    ids = inputs["input_ids"][0]
    assert tokenized.token_ids == ids.tolist()
    assert tokenized.image_positions == (ids == model.vision.image_token_id).nonzero().flatten().tolist()
    ours = run_logits(model.transformer(), tokenized, kv_mode("fp32"), None)
    with torch.no_grad():
        theirs = vlm["model"](**inputs).logits[0]
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), float((ours - theirs).abs().max())

    result = calibrate(model, CalibrationRequest(str(data), num_dialogues=4, max_tokens=1024, grade=False),
                       progress=False)
    kinds = result.scales_file.data[BY_KIND]
    assert kinds["image"]["positions"] == result.scales_file.data["pictures"]["image_positions"] > 0
    chosen = [tokenize_dialogue(d, model.tokenizer, 1024, model.vision) for d in open_source(str(data))[0]
              if d.id in result.scales_file.data["ids"]]
    image_k = [[] for _ in range(model.config.num_hidden_layers)]
    for d in chosen:
        run = run_tokens(model.transformer(), d.token_ids, media=d.media)
        for layer, found in enumerate(image_k):
            found.append(run.kv(layer)[0][d.image_positions].abs().amax())
    assert kinds["image"]["k_amax"] == pytest.approx([float(max(k)) for k in image_k], abs=1e-4)
    assert kinds["text"]["k_amax"] != kinds["image"]["k_amax"]


@pytest.mark.slow
def test_cabin_calibrate_and_cabin_eval_split_by_text_and_image_positions(vlm, tmp_path, capsys):
    from cabinllm.cli import calibrate as cli_calibrate
    from cabinllm.cli import eval as cli_eval

    data = picture_dialogues(tmp_path, 12)
    scales, report = tmp_path / "kv_scales.json", tmp_path / "report"
    assert cli_calibrate.main(["--model", str(vlm["engine"].folder), "--data", str(data), "--num-dialogues", "4",
                               "--output", str(scales), "--report", str(report)]) == 0
    summary = (report / "summary.md").read_text(encoding="utf-8")
    assert "## K/V at image and text positions" in summary and (report / "ranges_by_kind.png").is_file()
    assert "KL text / image" in summary  # the held-out grade, split
    capsys.readouterr()
    assert cli_eval.main(["--model", str(vlm["engine"].folder), "--data", str(data), "--scales", str(scales),
                          "--split", "all", "--num-dialogues", "3", "--kv-cache", "int8-shared,int8-dynamic",
                          "--output", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "eval" / "eval.json").read_text(encoding="utf-8"))
    kinds = record["modes"]["int8-shared"]["by_kind"]
    assert kinds["image"]["tokens"] == record["data"]["pictures"]["image_positions"] > 0
    assert kinds["text"]["tokens"] + kinds["image"]["tokens"] == record["data"]["tokens"] - 3  # a next token each
    assert f"image ({kinds['image']['tokens']} positions)" in out


def test_calibration_data_with_pictures_names_what_cannot_be_read(vlm, tiny_engine_dir, tmp_path, capsys):
    """A text-only model, a missing picture, a picture that is no picture: one error each, naming it; an images
    field that is not a list of paths on a user message is a malformed record, skipped and counted."""
    from cabinllm.calibration.dialogue_data import LoadReport
    from cabinllm.calibration.jsonl import load_jsonl
    from cabinllm.cli import calibrate as cli_calibrate

    data = picture_dialogues(tmp_path, 12)
    args = ["--data", str(data), "--num-dialogues", "2", "--no-grade", "--output", str(tmp_path / "s.json")]
    assert cli_calibrate.main(["--model", str(tiny_engine_dir), *args]) == 2
    assert "shows pictures" in capsys.readouterr().err
    (tmp_path / "picture-3.png").unlink()
    (tmp_path / "picture-5.png").write_bytes(b"not a picture")
    assert cli_calibrate.main(["--model", str(vlm["engine"].folder), *args, "--num-dialogues", "9",
                               "--method", "max"]) == 2
    err = capsys.readouterr().err
    assert "picture-3.png: cannot read the picture" in err or "picture-5.png is not a picture" in err
    assert not (tmp_path / "s.json").exists()
    bad = [{"messages": [{"role": "user", "content": "hi", "images": "cam0.png"}, {"role": "assistant",
                                                                                   "content": "hello"}]},
           {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello",
                                                              "images": ["cam0.png"]}]}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(b) + "\n" for b in bad), encoding="utf-8")
    report = LoadReport("bad.jsonl")
    assert list(load_jsonl(tmp_path / "bad.jsonl", report)) == []
    assert report.skip_reasons == {"images or audio not a list of file paths on a user message": 2}


def test_a_dialogue_cut_to_its_token_budget_never_ends_inside_a_picture(vlm, tmp_path):
    from cabinllm.calibration.selection import tokenize_dialogue
    from cabinllm.calibration.sources import open_source
    from cabinllm.runtime.sources.model_source import load_model

    model = load_model(str(vlm["engine"].folder))
    dialogue = next(iter(open_source(str(picture_dialogues(tmp_path, 1)))[0]))
    whole = tokenize_dialogue(dialogue, model.tokenizer, 4096, model.vision)
    span = whole.media.spans[0]
    cut = tokenize_dialogue(dialogue, model.tokenizer, span.start + span.length // 2, model.vision)
    assert cut.token_ids == whole.token_ids[:span.start] and cut.media is None and cut.image_positions == []
    assert whole.cut(span.end).media.spans == [span] and whole.cut(span.end).image_positions == whole.image_positions


@pytest.mark.slow
def test_cabin_build_calibrates_on_dialogues_with_pictures(vlm, tmp_path):
    data = picture_dialogues(tmp_path, 90)
    engine = cabin_build(vlm["folder"], tmp_path / "engine", options=("--dtype", "float32", "--calibrate", str(data)))
    scales = json.loads((engine / "kv_scales.json").read_text(encoding="utf-8"))
    assert scales["data"]["pictures"]["count"] == scales["data"]["dialogues"]  # one picture each
    assert scales["data"]["by_kind"]["image"]["positions"] == scales["data"]["pictures"]["image_positions"]
