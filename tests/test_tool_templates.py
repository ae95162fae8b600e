"""Tools in the prompt as the model's own chat template renders them: our rendering equals transformers'
``apply_chat_template(tools=...)`` for Qwen2.5's and Llama 3.1's templates (tests/data/templates), a call written
under our grammar is the text the template writes for it again (so a follow-up reuses its KV), and a template
without tools gets the documented hermes format."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.tools import HERMES, LLAMA3_JSON, TOOL_PROMPT, Tool, template_tool_format

from fakes.tiny_model import TEMPLATE, write_tiny_llama

TEMPLATES = Path(__file__).parent / "data" / "templates"
TOOLS = [Tool("set_temperature", "Set the cabin temperature", {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["driver", "all"]},
                                     "celsius": {"type": "number"}}, "required": ["zone", "celsius"]}),
         Tool("open_window", "Open a window, é", {"type": "object", "properties": {"window": {"type": "string"}}})]
ARGUMENTS = '{"zone": "driver", "celsius": 21.5}'
CONVERSATION = [
    {"role": "system", "content": "You control the car."},
    {"role": "user", "content": "Make it 21.5 on my side."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "set_temperature", "arguments": ARGUMENTS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
]


def _tokenizer(folder: Path, template: str, bos: str | None) -> ChatTokenizer:
    model = write_tiny_llama(folder, byte_tokens=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template, "bos_token": bos}))
    return ChatTokenizer(model)


def _transformers(folder: Path, messages: list[dict], bos: str | None) -> str:
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=bos)
    tok.chat_template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    as_hf = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                  for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return tok.apply_chat_template(as_hf, tools=[t.to_openai() for t in TOOLS], tokenize=False,
                                   add_generation_prompt=True)


@pytest.mark.parametrize("name, bos, tool_format", [("qwen2.5-instruct", None, HERMES),
                                                    ("llama3.1-instruct", "<|begin_of_text|>", LLAMA3_JSON)])
def test_rendering_equals_transformers_and_a_call_renders_as_it_was_written(tmp_path, name, bos, tool_format):
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    tok = _tokenizer(tmp_path / "model", template, bos).with_tools(TOOLS)
    assert template_tool_format(template) is tool_format and tok.tool_format is tool_format
    for messages in (CONVERSATION[:2], CONVERSATION):
        assert tok.render(messages) == _transformers(tmp_path / "model", messages, bos)
    ours = tool_format.call_text("set_temperature", ARGUMENTS)  # what the grammar makes the model write
    reply_start = tok.render(CONVERSATION[:2])
    assert tok.render(CONVERSATION[:3], add_generation_prompt=False).startswith(reply_start + ours)
    assert tool_format.parse(ours) == [("set_temperature", ARGUMENTS)]


def test_a_template_without_tools_gets_the_hermes_format_in_our_words(tmp_path):
    tok = _tokenizer(tmp_path / "model", TEMPLATE, None)
    assert template_tool_format(TEMPLATE) is None and tok.tool_format is HERMES
    assert "<tool_call>" not in tok.render(CONVERSATION[:2])  # no tools, no tool prompt
    text = tok.with_tools(TOOLS).render(CONVERSATION)
    listing = "\n".join(json.dumps(tool.to_openai(), ensure_ascii=False) for tool in TOOLS)
    assert "You control the car.\n\n" + TOOL_PROMPT.replace("{tools}", listing) in text
    assert HERMES.call_text("set_temperature", ARGUMENTS) in text
    assert '<|im_start|> user <tool_response>\n{"ok": true}\n</tool_response> <|im_end|>' in text
