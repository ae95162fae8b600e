"""Write a model's tokenizer beside its checkpoint, so the runtime needs neither the GGUF nor transformers.

The folder gets ``tokenizer.json`` (for ``tokenizers.Tokenizer.from_file``) and
``tokenizer_config.json`` with the fields of ``TokenizerConfig``; the runtime
renders ``chat_template`` with jinja2.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.sources.gguf import read_gguf
from cabinllm.runtime.sources.hf import read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


@dataclass
class TokenizerConfig:
    """What ``tokenizer_config.json`` holds for the runtime."""

    chat_template: str  # Jinja template over ``messages`` and ``add_generation_prompt``
    bos_token: str | None
    eos_token: str
    add_bos_token: bool  # whether a prompt must start with bos_token
    stop_token_ids: list[int]  # every id that ends an assistant turn, eos first


def load_tokenizer_file(path: Path) -> Tokenizer:
    """Load a ``tokenizer.json``; CheckpointError naming the file when it is absent or unreadable."""
    if not path.is_file():
        raise CheckpointError(
            f"{path}: not found; the importer needs a fast tokenizer, make one with "
            "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{path}: unreadable tokenizer file ({err}); download it again") from err


def _token_text(token: str | dict | None) -> str | None:
    """A special token as text; tokenizer_config.json may store it as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(folder: Path, config: dict) -> str:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    if template is None and (folder / CHAT_TEMPLATE_FILE).is_file():
        template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if not template:
        raise CheckpointError(
            f"{folder / TOKENIZER_CONFIG_FILE}: no chat template here nor in {CHAT_TEMPLATE_FILE}; "
            "CabinLLM needs a chat (instruct) model"
        )
    return template


def _finish(
    tokenizer: Tokenizer,
    source: Path,
    chat_template: str,
    bos_token: str | None,
    eos_token: str | None,
    add_bos_token: bool | None,
    extra_stop_ids: list[int],
) -> TokenizerConfig:
    """Resolve token ids against the tokenizer and assemble the config."""
    eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
    if eos_id is None:
        raise CheckpointError(f"{source}: end-of-sequence token {eos_token!r} is not in the tokenizer's vocabulary")
    bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
    if add_bos_token is None:  # not stated: follow what the tokenizer's post-processor does
        add_bos_token = bos_id is not None and tokenizer.encode("a").ids[:1] == [bos_id]
    named = [tokenizer.token_to_id(token) for token in END_OF_TURN_TOKENS]
    stop_ids = [i for i in dict.fromkeys([eos_id, *named, *extra_stop_ids]) if i is not None]
    return TokenizerConfig(chat_template, bos_token, eos_token, bool(add_bos_token), stop_ids)


def _from_hf(folder: Path, output_dir: Path) -> TokenizerConfig:
    source = folder / TOKENIZER_FILE
    tokenizer = load_tokenizer_file(source)
    config = read_json(folder / TOKENIZER_CONFIG_FILE)
    shutil.copyfile(source, output_dir / TOKENIZER_FILE)
    return _finish(
        tokenizer,
        folder / TOKENIZER_CONFIG_FILE,
        _hf_chat_template(folder, config),
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")),
        config.get("add_bos_token"),
        [],
    )


def _from_gguf(path: Path, output_dir: Path) -> TokenizerConfig:
    reader = read_gguf(path)

    def meta(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    chat_template = meta("tokenizer.chat_template")
    if not chat_template:
        raise CheckpointError(f"{path}: no tokenizer.chat_template metadata; CabinLLM needs a chat (instruct) model")
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as err:  # transformers raises many kinds; any of them means no usable tokenizer
        raise CheckpointError(f"{path}: transformers could not build its tokenizer ({err})") from err
    target = output_dir / TOKENIZER_FILE
    hf_tokenizer.backend_tokenizer.save(str(target))
    tokenizer = load_tokenizer_file(target)
    bos_id, eos_id = meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id")
    extra = [meta(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")]
    return _finish(
        tokenizer,
        path,
        chat_template,
        None if bos_id is None else tokenizer.id_to_token(bos_id),
        None if eos_id is None else tokenizer.id_to_token(eos_id),
        meta("tokenizer.ggml.add_bos_token"),
        [i for i in extra if i is not None],
    )


def export_tokenizer(source: Path, output_dir: Path) -> TokenizerConfig:
    """Write tokenizer.json and tokenizer_config.json for a .gguf file or HF folder into ``output_dir``."""
    config = _from_hf(source, output_dir) if source.is_dir() else _from_gguf(source, output_dir)
    text = json.dumps(asdict(config), indent=2, ensure_ascii=False)
    (output_dir / TOKENIZER_CONFIG_FILE).write_text(text, encoding="utf-8")
    return config
